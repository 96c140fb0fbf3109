"""The reasoning parser (runtime/reasoning.py) and the constraint's reasoning gate, without a model."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.args import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.grammar import grammar_bitmask, make_backend
from radixlm.runtime.constrained.reasoning_gate import NOTHING_FORCED, ReasoningGate
from radixlm.runtime.reasoning import FORMATS, ReasoningStream, Split, gate_ids, reasoning_format, split_reasoning
from radixlm.runtime.server.openai_builders import chat_response
from radixlm.runtime.server.openai_protocol import ChatCompletionRequest
from radixlm.runtime.server.openai_to_native import chat_messages, chat_to_generate
from radixlm.runtime.server.output_readers import ChoiceStream, ReasoningReader, ToolReader
from radixlm.runtime.token_mask import apply_bitmask

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]

# (text, thinking) -> (reasoning, content), written out by hand
WHOLE = [
    ("<think>\nLet me see.\n</think>\n\nParis.", True, ("\nLet me see.\n", "\n\nParis.")),
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "\n\nParis.")),
    ("Paris.", False, ("", "Paris.")),
    ("Paris.", True, ("Paris.", "")),  # thinking, cut off before the end tag: all reasoning
    ("hm</think>Paris.", True, ("hm", "Paris.")),  # R1: the template opened the block
    ("hm</think>Paris.", False, ("", "hm</think>Paris.")),  # no block opened: the tag is text
    ("  <think>a</think>b", False, ("a", "b")),  # whitespace before the start tag goes
    ("x<think>a</think>b", False, ("", "x<think>a</think>b")),  # a block opens the output or not at all
    ("<think>a</think>b</think>c", True, ("a", "b</think>c")),  # the first end tag ends it
    ("<think>a</thin", True, ("a</thin", "")),  # cut inside the end tag: still reasoning
    ("<thi", False, ("", "<thi")),  # cut inside the start tag, thinking off: content
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,thinking,expected", WHOLE)
@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=lambda f: f.name)
def test_split_whole(fmt, text, thinking, expected):
    assert split_reasoning(text, fmt, thinking) == Split(*expected)


def test_formats():
    assert QWEN3.thinking(None) and QWEN3.thinking({"enable_thinking": True})
    assert not QWEN3.thinking({"enable_thinking": False})
    assert R1.thinking({"enable_thinking": False}), "R1's template always opens the block"
    assert FORMATS["qwen3-thinking"].thinking({"enable_thinking": False})
    with pytest.raises(ValueError, match="deepseek-r1, gpt-oss, qwen3, qwen3-thinking"):
        reasoning_format("nope")


def _streamed(text: str, cuts: list[int], thinking: bool) -> tuple[Split, list[Split]]:
    stream = ReasoningStream(QWEN3, thinking)
    bounds = [0, *sorted(cuts), len(text)]
    parts = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    return Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts)), parts


@pytest.mark.parametrize("thinking", [True, False])
def test_tags_cut_at_every_position(thinking):
    text = " <think>ab</think>cd"
    expected = Split("ab", "cd")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            whole, parts = _streamed(text, [i, j], thinking)
            assert whole == expected, (i, j)
            assert not any("<" in p.reasoning + p.content for p in parts), f"a tag leaked at cuts {i}, {j}"


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "a", "b", " ", "\n", ">"]


@settings(max_examples=2000)  # of texts of at most 12 pieces: the CI profile's 10,000 cost 40 s
@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), st.lists(st.integers(0, 80), max_size=6),
       st.booleans())
def test_stream_equals_whole(text, cuts, thinking):
    cuts = [c for c in cuts if c <= len(text)]
    assert _streamed(text, cuts, thinking)[0] == split_reasoning(text, QWEN3, thinking) == _reference(text, thinking)


def _reference(text: str, thinking: bool) -> Split:
    """The rule of the module's docstring, in its plainest form."""
    head = text.lstrip()
    if head.startswith("<think>"):
        text, thinking = head[len("<think>"):], True
    if not thinking:
        return Split("", text)
    reasoning, tag, content = text.partition("</think>")
    return Split(reasoning, content) if tag else Split(text, "")


def test_stream_reasoning_false_sends_the_reasoning_once_it_ends():
    reader = ReasoningReader(QWEN3, thinking=True, whole=True)
    deltas = reader.stream()
    got = [deltas.feed(t, finished=False) for t in ["<think>", "a", "b</th", "ink>c", "d"]]
    got.append(deltas.feed("", finished=True))
    assert [g.reasoning for g in got] == ["", "", "", "ab", "", ""]
    assert "".join(g.content for g in got) == "cd"


def test_stream_reasoning_false_flushes_a_cut_off_block_at_the_end():
    deltas = ReasoningReader(R1, thinking=True, whole=True).stream()
    assert deltas.feed("ab", finished=False) == Split("", "")
    assert deltas.feed("c</thi", finished=True) == Split("abc</thi", "")


def test_gate_ids():
    assert gate_ids(False, [], constrained=True) == []
    assert gate_ids(True, [7], constrained=False) == []  # nothing to hold back
    assert gate_ids(True, [7], constrained=True) == [7]
    with pytest.raises(ValueError, match="--reasoning-parser"):
        gate_ids(True, [], constrained=True)


# ---- the gate, over each grammar backend's matcher on a toy vocabulary

TOKENS = {"a": 1, "b": 2, "ab": 3, "x": 40, "y": 70, "</think>": 50, "</": 60, "think>": 61}
VOCAB, EOS = 80, 0
TABLE = [None] * VOCAB
for _text, _id in TOKENS.items():
    TABLE[_id] = _text.encode()
REGEX = ("regex", "(a|b)+[xy]")


def _encode(text: str) -> list[int]:  # greedy longest match over the toy vocabulary
    ids, i = [], 0
    while i < len(text):
        token = max((t for t in TOKENS if text.startswith(t, i)), key=len)
        ids.append(TOKENS[token])
        i += len(token)
    return ids


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def matcher(request):
    """A maker of fresh matchers on REGEX, from one backend (all three are dependencies: none skips)."""
    backend = make_backend(request.param, TABLE, EOS, _encode)
    grammar = backend.load(REGEX, backend.builder.build(REGEX))
    return lambda: backend.matcher(grammar)


def allowed(m) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, grammar_bitmask([m], VOCAB))
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_gate_is_free_until_the_end_tag_then_the_constraint_starts_fresh(matcher):
    gate = ReasoningGate(matcher(), [50])
    for token in (40, 70, 61, 3):  # tokens the constraint would refuse at its start
        assert allowed(gate) == set(range(VOCAB)) and not gate.open and gate.can_end()
        assert gate.max_rollback == 0, "jump-forward must not re-encode reasoning"
        assert gate.forced() == NOTHING_FORCED, "nor force constraint text into it"
        assert gate.accepts([40, 50, 3]) and not gate.accepts([50, 40]), "what follows the tag is checked"
        gate.advance(token)
    gate.advance(50)
    assert gate.open
    assert allowed(gate) == {1, 2, 3}, "the constraint begins at its initial state"
    assert gate.max_rollback == 0, "nor re-encode the end tag"
    assert not gate.can_end() and gate.accepts([3, 40]) and not gate.accepts([40])
    gate.advance(3)
    assert allowed(gate) == {1, 2, 3, 40, 70}
    assert gate.max_rollback == 1
    gate.rollback(1)
    assert allowed(gate) == {1, 2, 3}
    gate.advance(1)
    gate.advance(40)
    assert allowed(gate) == {EOS} and gate.can_end()


def test_gates_fill_their_rows_in_one_batch(matcher):
    shut, opened, plain = ReasoningGate(matcher(), [50]), ReasoningGate(matcher(), [50]), matcher()
    opened.advance(50)
    plain.advance(3)
    mask = grammar_bitmask([shut, None, opened, plain], VOCAB)
    logits = torch.zeros(4, VOCAB)
    apply_bitmask(logits, mask)
    rows = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in logits]
    assert rows == [set(range(VOCAB)), set(range(VOCAB)), {1, 2, 3}, {1, 2, 3, 40, 70}]


def test_gate_matches_an_end_tag_of_several_tokens(matcher):
    gate = ReasoningGate(matcher(), [60, 61])
    for token in (60, 1, 61, 60, 60):  # a broken match starts over; a repeated first token still counts
        gate.advance(token)
        assert not gate.open
    gate.advance(61)
    assert gate.open and allowed(gate) == {1, 2, 3}


@settings(max_examples=2000)  # 3 tokens, at most 12 of them: far fewer cases than the CI profile's 10,000
@given(st.lists(st.sampled_from([60, 61, 1]), max_size=12), st.sampled_from([(60, 61), (60, 60, 61), (61,)]))
def test_gate_opens_right_after_the_first_end_tag(tokens, end):
    gate = ReasoningGate(_Any(), end)
    first = next((i + len(end) for i in range(len(tokens)) if tuple(tokens[i:i + len(end)]) == end), None)
    for i, token in enumerate(tokens):
        if i == first:
            break
        assert not gate.open
        gate.advance(token)
    assert gate.open == (first is not None)


class _Any:
    """A matcher that takes anything (the gate's matching alone is under test)."""

    def advance(self, token: int) -> None:
        pass


def test_chat_request_fields():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "yes", "reasoning_content": "so"}],
        "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "json_object"}})
    assert req.separate_reasoning and req.stream_reasoning
    body = chat_to_generate(req, "", reasoning=QWEN3)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "require_reasoning" not in body, "thinking is off: the constraint holds from the first token"
    assert chat_messages(req)[1]["reasoning_content"] == "so"
    on = req.model_copy(update={"chat_template_kwargs": None})
    assert chat_to_generate(on, "", reasoning=QWEN3)["require_reasoning"] is True
    assert "require_reasoning" not in chat_to_generate(on, ""), "no parser, no gate"


def test_chat_response_reads_tools_and_reasoning_apart():
    reader = ReasoningReader.of(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), "qwen3")
    tools = ToolReader("auto", {"f"}, True)
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = f"<think>maybe {call}?</think>ok {call}"
    result = {"text": text, "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": 1,
                                          "completion_tokens": 1}}
    message = chat_response([result], "m", "r", False, 0, lambda _: "", tools, reader)["choices"][0]["message"]
    assert message["reasoning_content"] == f"maybe {call}?"
    assert message["content"].strip() == "ok"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"x": 1}], \
        "only the call after the reasoning counts"


def test_choice_stream_reads_calls_from_the_content_only():
    reader = ReasoningReader(QWEN3, thinking=True)
    stream = ChoiceStream(ToolReader("auto", {"f"}, True), reader)
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = f"<think>maybe {call}?</think>ok {call}"
    deltas = [d for i, ch in enumerate(text) for d in stream.feed(ch, finished=i == len(text) - 1)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == f"maybe {call}?"
    assert "".join(d.get("content") or "" for d in deltas).strip() == "ok"
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}] and stream.called
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:]), "reasoning comes first"


# ---- gpt-oss's harmony messages -----------------------------------------------------------------

GPT_OSS = reasoning_format("gpt-oss")
# an analysis, a preamble to the user, a call (its recipient after the channel, as gpt-oss writes
# it, or in the header's first part), the answer; messages ended by <|end|>, <|call|>, <|return|>
HARMONY_MESSAGES = [
    "<|channel|>analysis<|message|>User wants weather. Call <tool>.<|end|>",
    "<|start|>assistant<|channel|>commentary<|message|>Checking <|the|> sky.<|end|>",
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|call|>",
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>',
    "<|start|>assistant<|channel|>final<|message|>It is 20°C < 25°C, sunny.<|return|>",
]


def _harmony_reference(messages: list[str]) -> Split:
    """What the messages above mean, written out by hand."""
    want = {0: ("User wants weather. Call <tool>.", ""), 1: ("", "Checking <|the|> sky."),
            2: ("", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
            3: ("", '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'),
            4: ("", "It is 20°C < 25°C, sunny.")}
    parts = [want[HARMONY_MESSAGES.index(m)] for m in messages]
    return Split("".join(r for r, _ in parts), "".join(c for _, c in parts))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(HARMONY_MESSAGES), min_size=1, max_size=5), st.lists(st.integers(0, 400), max_size=8),
       st.booleans())
def test_harmony_stream_reads_any_cut_as_the_whole(messages, cuts, stop_trimmed):
    """Any cut of the deltas (the markers and multi-byte text split anywhere) reads as the whole
    text does, and as the messages mean; whether the stop token ends the text or was trimmed."""
    from radixlm.runtime.reasoning import HarmonyStream, split_harmony

    messages = [m.removeprefix("<|start|>assistant") if i == 0 else m for i, m in enumerate(messages)]
    text = "".join(messages)
    if stop_trimmed:
        text = text.removesuffix("<|call|>").removesuffix("<|return|>")
    want = _harmony_reference([next(h for h in HARMONY_MESSAGES if h.endswith(m)) for m in messages])
    assert split_harmony(text) == want
    assert split_reasoning(text, GPT_OSS, True) == want
    stream, parts = HarmonyStream(), []
    edges = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(edges, edges[1:]):
        parts.append(stream.feed(text[a:b]))
    parts.append(stream.finish())
    assert Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == want


def test_harmony_streams_reasoning_as_it_comes_and_reads_calls_through_the_tool_reader():
    """Through a chat choice's stream: the analysis streams as reasoning before the rest, a call
    comes out as a call of the request's tools, and a text with no harmony at all is the answer."""
    reader = ReasoningReader.of(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), "gpt-oss")
    stream = ChoiceStream(ToolReader("auto", {"get_weather"}, True), reader)
    text = "".join(HARMONY_MESSAGES[:3])
    deltas = [d for i, ch in enumerate(text) for d in stream.feed(ch, finished=i == len(text) - 1)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "User wants weather. Call <tool>."
    assert deltas[1] == {"reasoning_content": "s"}, "reasoning goes out as it comes, not held to the end"
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking <|the|> sky."
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})] and stream.called
    from radixlm.runtime.reasoning import split_harmony

    assert split_harmony("plain words") == Split("", "plain words")


def test_gpt_oss_requests_keep_special_tokens_and_gate_on_the_final_channel():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    body = chat_to_generate(req, "", reasoning=GPT_OSS)
    assert body["sampling_params"]["skip_special_tokens"] is False and body["require_reasoning"] is True
    asked = req.model_copy(update={"skip_special_tokens": True})
    assert chat_to_generate(asked, "", reasoning=GPT_OSS)["sampling_params"]["skip_special_tokens"] is True
    assert "skip_special_tokens" not in chat_to_generate(req, "", reasoning=QWEN3)["sampling_params"]
    assert GPT_OSS.end == "<|channel|>final<|message|>"  # what a constraint waits for: the answer's body
