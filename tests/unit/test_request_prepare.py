"""Request preparation and output assembly (tokenizer/prepare.py, tokenizer/output.py), the code both
front doors share; the tokenizer process driven through them with stand-in sockets."""

from __future__ import annotations

import dataclasses

import pytest

from radixlm.runtime import ipc
from radixlm.runtime.messages import CONSTRAINT_NOT_GIVEN, ClientOutput, GenerateRequest, TokenizedRequest, TokenOutput
from radixlm.runtime.native import BadRequest
from radixlm.runtime.sampling_params import SamplingParams, SamplingParamsError
from radixlm.runtime.tokenizer import prepare as prepare_module
from radixlm.runtime.tokenizer.choices import is_choices, scoring_requests
from radixlm.runtime.tokenizer.output import RequestOutput
from radixlm.runtime.tokenizer.prepare import RequestPreparer

CONTEXT = 256
POOL = 1024  # the KV pool's tokens


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def prep(tok):
    return RequestPreparer(tok, V, CONTEXT, POOL)


# ---- the sampling params' schema -----------------------------------------------------------------


def _conforms(value, schema) -> bool:
    if "anyOf" in schema:
        return any(_conforms(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
    if not checks[kind](value):
        return False
    if kind == "array":
        return all(_conforms(v, schema["items"]) for v in value)
    return True


def test_the_sampling_params_schema_is_the_dataclass():
    """Every SamplingParams field (and SGLang's alias names) is in the schema, nothing else but the
    keys `choices` takes; each field's default is a value of its documented type."""
    from radixlm.runtime.native import CHOICE_PARAMS, SAMPLING_PARAMS_SCHEMA
    from radixlm.runtime.sampling_params import ALIASES, field_names

    props = SAMPLING_PARAMS_SCHEMA["properties"]
    assert set(props) == set(field_names()) | set(ALIASES) | set(CHOICE_PARAMS)
    for f in dataclasses.fields(SamplingParams):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default is not None:
            assert _conforms(default, props[f.name]), (f.name, default, props[f.name])
    for alias, name in ALIASES.items():
        assert props[alias] == props[name]
    assert _conforms(["a", "b"], props["stop"]) and _conforms("a", props["stop"])  # one string is a list of one


# ---- the constraint key, once ------------------------------------------------------------------


def test_the_constraint_key_is_worked_out_once_and_crosses_ipc(prep, monkeypatch):
    calls = []
    real = prepare_module.constraint_key
    monkeypatch.setattr(prepare_module, "constraint_key", lambda p: calls.append(p) or real(p))
    tr = prep.prepare(GenerateRequest("r", text="Hi", sampling_params={"regex": "[0-9]+"}))
    assert tr.constraint == ("regex", "[0-9]+") and len(calls) == 1
    back = ipc.decode(ipc.encode(tr))
    assert back == tr and isinstance(back.constraint, tuple) and hash(back.constraint)
    plain = ipc.decode(ipc.encode(prep.prepare(GenerateRequest("p", text="Hi"))))
    assert plain.constraint is None
    # made by hand: not given, on both sides of ipc (the scheduler derives it)
    by_hand = TokenizedRequest("h", [1, 2], SamplingParams(regex="a"))
    assert by_hand.constraint is CONSTRAINT_NOT_GIVEN
    assert ipc.decode(ipc.encode(by_hand)).constraint is CONSTRAINT_NOT_GIVEN


# ---- what prepare refuses ----------------------------------------------------------------------

V = 49152  # SmolLM2's vocabulary
BAD = [
    (dict(), BadRequest, "give exactly one of text, input_ids or messages"),
    (dict(text="a", input_ids=[1]), BadRequest, "give exactly one of text, input_ids or messages"),
    (dict(input_ids=[]), BadRequest, "the prompt is empty"),
    (dict(text=""), BadRequest, "the prompt is empty"),
    (dict(input_ids=[1, True]), BadRequest, "input_ids must be a list of integers"),
    (dict(input_ids=[1, V]), BadRequest, f"input_ids must lie in [0, {V})"),
    (dict(input_ids=[-1, 2]), BadRequest, f"input_ids must lie in [0, {V})"),
    (dict(input_ids=[1] * CONTEXT), BadRequest,
     f"the prompt has {CONTEXT} tokens; the context length is {CONTEXT} (prompt plus at least one new token must fit)"),
    (dict(messages=[{"content": "x"}]), BadRequest, "messages must be a non-empty list of objects with a role"),
    (dict(input_ids=[1, 2], sampling_params={"top_p": 1.5}), SamplingParamsError, "top_p=1.5 is out of range"),
    (dict(input_ids=[1, 2], sampling_params={"max_tokens": 3}), SamplingParamsError, "unknown sampling parameter"),
    (dict(input_ids=[1, 2], sampling_params={"logit_bias": {V: 1, 5: 1, V + 7: 1}}), SamplingParamsError,
     f"logit_bias token id(s) {V}, {V + 7} out of range; allowed: in [0, {V})"),
    (dict(input_ids=[1, 2], return_logprob=True, logprob_start_len=2), BadRequest,
     "logprob_start_len 2 must be below the prompt length 2"),
    (dict(input_ids=[1, 2], top_logprobs_num=21), BadRequest, "top_logprobs_num must lie in [0, 20]"),
    (dict(input_ids=[1, 2], require_reasoning=True), BadRequest,
     "require_reasoning needs a server started with --reasoning-parser (and a tokenizer)"),
    (dict(text="Pick", sampling_params={"choices": []}), BadRequest,
     "choices must be a non-empty list of non-empty strings"),
    (dict(text="Pick", sampling_params={"choices": ["a", 3]}), BadRequest,
     "choices must be a non-empty list of non-empty strings"),
    (dict(text="Pick", sampling_params={"choices": ["a"], "choices_method": "vibes"}), BadRequest,
     "choices_method must be one of token_length_normalized, greedy_token, greedy_token_selection, "
     "unconditional_likelihood_normalized"),
    (dict(text="Pick", sampling_params={"choices": [" apple" * CONTEXT]}), BadRequest,
     f"prompt plus choice 0: the prompt has {CONTEXT + 1} tokens; the context length is {CONTEXT}"),
    (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": CONTEXT - 1}), BadRequest,
     f"max_new_tokens={CONTEXT - 1} does not fit: the prompt has 2 tokens and the context length is {CONTEXT}, "
     f"so at most {CONTEXT - 2}"),
]


def _prepare(prep: RequestPreparer, req: GenerateRequest):
    return scoring_requests(prep, req) if is_choices(req) else prep.prepare(req)


@pytest.mark.parametrize("fields,error,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_prepare_refuses_with_the_message(prep, fields, error, message):
    with pytest.raises(error) as caught:
        _prepare(prep, GenerateRequest("r", **fields))
    assert message in str(caught.value)


def test_without_a_tokenizer_only_input_ids_are_taken():
    bare = RequestPreparer(None, V, CONTEXT, POOL)
    for req in (GenerateRequest("r", text="hi"), GenerateRequest("r", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(BadRequest, match=r"no tokenizer \(--skip-tokenizer-init\): send input_ids"):
            bare.prepare(req)
    with pytest.raises(BadRequest, match="choices need a tokenizer"):
        scoring_requests(bare, GenerateRequest("r", input_ids=[1, 2], sampling_params={"choices": ["a"]}))
    with pytest.raises(BadRequest, match=r"constrained decoding \(regex, json_schema, ebnf\) needs a tokenizer"):
        bare.prepare(GenerateRequest("r", input_ids=[1, 2], sampling_params={"max_new_tokens": 4, "regex": "a"}))
    assert bare.prepare(GenerateRequest("r", input_ids=[1, 2], sampling_params={"max_new_tokens": 4})).input_ids == [1, 2]


def test_a_prompt_longer_than_the_kv_pool_is_refused(tok):
    """The pool's size comes from the scheduler (SchedulerLimits); a prompt that could never be
    held is refused here, not queued forever. The context may be longer than the pool."""
    small = RequestPreparer(tok, V, 1024, kv_pool_tokens=16)
    fits = small.prepare(GenerateRequest("r", input_ids=list(range(1, 17)), sampling_params={"max_new_tokens": 8}))
    assert len(fits.input_ids) == 16
    with pytest.raises(BadRequest, match=r"the prompt has 17 tokens; the KV cache pool holds 16 \(raise --max-total-tokens\)"):
        small.prepare(GenerateRequest("r", input_ids=list(range(1, 18))))
    with pytest.raises(BadRequest, match="prompt plus choice 0: the prompt has .* the KV cache pool holds 16"):
        scoring_requests(small, GenerateRequest("r", text=" apple" * 16, sampling_params={"choices": [" pear"]}))
    assert len(tok.encode(" apple" * 16, add_special_tokens=False)) == 16  # the prompt alone fits


def test_prepare_defaults(prep, tok):
    ids = tok.encode("Hello there", add_special_tokens=False)
    tr = prep.prepare(GenerateRequest("r", text="Hello there", sampling_params={"max_new_tokens": None}))
    assert tr.input_ids == ids and tr.sampling_params.max_new_tokens == CONTEXT - len(ids)  # as many as fit
    assert prep.prepare(GenerateRequest("r", input_ids=[1, 2])).sampling_params.max_new_tokens == 128
    with pytest.raises(BadRequest, match="max_new_tokens=128 does not fit"):  # the default, checked as any
        RequestPreparer(tok, V, 64, POOL).prepare(GenerateRequest("r", input_ids=[1, 2]))
    tr = prep.prepare(GenerateRequest("r", input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=2,
                                      top_logprobs_num=20))
    assert (tr.return_logprob, tr.logprob_start_len, tr.top_logprobs_num, tr.constraint) == (True, 2, 20, None)


def test_the_reasoning_gate(tok):
    prep = RequestPreparer(tok, V, CONTEXT, POOL, reasoning_parser="qwen3")
    end = tok.encode("</think>", add_special_tokens=False)
    gated = prep.prepare(GenerateRequest("r", text="Hi", require_reasoning=True, sampling_params={"regex": "a+"}))
    free = prep.prepare(GenerateRequest("r", text="Hi", require_reasoning=True))
    assert gated.reasoning_end_ids == end and free.reasoning_end_ids == []


def test_choice_scoring_requests(prep, tok):
    scoring = scoring_requests(prep, GenerateRequest("c", text="Colour:", sampling_params={
        "choices": [" red", " blue"], "choices_method": "unconditional_likelihood_normalized", "temperature": 0}))
    assert [tr.rid for tr in scoring.requests] == [f"c\x00choice{i}" for i in range(4)]
    assert all(tr.sampling_params.max_new_tokens == 0 and tr.return_logprob for tr in scoring.requests)
    assert scoring.requests[0].input_ids == tok.encode("Colour: red", add_special_tokens=False)
    assert scoring.group.prompt_tokens == len(tok.encode("Colour:", add_special_tokens=False))


# ---- output assembly ---------------------------------------------------------------------------


def _out(new, replaced=0, finish=None, **kw) -> TokenOutput:
    return TokenOutput("r", list(new), 3, 0, 1, finish_reason=finish, replaced=replaced, **kw)


def test_jump_forward_replacements_are_spliced(tok):
    out = RequestOutput(TokenizedRequest("r", [1, 2, 3], SamplingParams()), tok)
    out.add(_out([10, 11, 12]))
    out.add(_out([20, 21], replaced=2, finish={"type": "length", "length": 3}))
    assert out.token_ids == [10, 20, 21]
    assert out.result()["meta_info"] == {"id": "r", "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 1,
                                         "finish_reason": {"type": "length", "length": 3}}


@pytest.mark.parametrize("params,expect", [
    ({"stop": ["."]}, "One"),
    ({"stop": ["."], "no_stop_trim": True}, "One."),
    ({"stop_regex": [r"\."]}, "One. Two."),  # a stop_regex's match stays in the text, as in SGLang
    ({"stop": [" Two", "."]}, "One"),  # the first stop string in the text
])
def test_the_text_is_cut_at_stop_strings(tok, params, expect):
    ids = tok.encode("One. Two.", add_special_tokens=False)
    out = RequestOutput(TokenizedRequest("r", [1], SamplingParams.from_dict(params)), tok)
    out.add(_out(ids, finish={"type": "stop", "matched": "."}))
    assert out.text() == expect and out.token_ids == ids


def test_logprob_meta(tok):
    prompt = tok.encode("a b c d", add_special_tokens=False)
    tr = TokenizedRequest("r", prompt, SamplingParams(), return_logprob=True, logprob_start_len=1, top_logprobs_num=1)
    out = RequestOutput(tr, tok, text_in_logprobs=True)
    x, y = tok.encode(" e f", add_special_tokens=False)
    out.add(_out([x], output_logprobs=[-0.5], output_top_logprobs=[[(-0.5, x)]],
                 input_logprobs=[-1.0, -2.0, -3.0], input_top_logprobs=[[(-1.0, prompt[1])], None, None]))
    out.add(_out([y], output_logprobs=[-0.25], output_top_logprobs=[[(-0.25, y)]], finish={"type": "length"}))
    meta = out.logprob_meta()
    text = lambda t: tok.decode([t])  # noqa: E731
    assert meta["output_token_logprobs"] == [[-0.5, x, text(x)], [-0.25, y, text(y)]]
    assert meta["output_top_logprobs"] == [[[-0.5, x, text(x)]], [[-0.25, y, text(y)]]]
    assert meta["input_token_logprobs"] == [[lp, t, text(t)] for lp, t in zip([-1.0, -2.0, -3.0], prompt[1:])]
    assert meta["input_top_logprobs"] == [[[-1.0, prompt[1], text(prompt[1])]], None, None]
    assert out.logprob_meta(since=1)["output_token_logprobs"] == [[-0.25, y, text(y)]]
    plain = RequestOutput(tr, tok)
    plain.add(_out([x], output_logprobs=[-0.5], output_top_logprobs=[[(-0.5, x)]]))
    assert plain.logprob_meta()["output_token_logprobs"] == [[-0.5, x, None]]
    assert RequestOutput(TokenizedRequest("r", prompt, SamplingParams()), tok).logprob_meta() == {}


# ---- the tokenizer process, over the same code -------------------------------------------------


class _Sent(list):
    def send(self, raw: bytes) -> None:
        self.append(ipc.decode(raw))


def _manager(prep: RequestPreparer):
    from radixlm.runtime.tokenizer.manager import TokenizerManager

    m = TokenizerManager.__new__(TokenizerManager)  # no process, no sockets: what it sends is kept
    m.prep, m.tokenizer = prep, prep.tokenizer
    m.vocab_size, m.context_length = prep.vocab_size, prep.context_length
    m.in_flight, m.pending_control, m.choice_groups = {}, {}, {}
    m.to_scheduler, m.replies = _Sent(), []
    m._reply = lambda client, msg: m.replies.append(msg)
    return m


@pytest.mark.parametrize("fields,error,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_the_tokenizer_process_refuses_with_the_same_message(prep, fields, error, message):
    m = _manager(prep)
    m._admit(b"c", GenerateRequest("r", **fields))
    (reply,) = m.replies
    assert reply.finished and reply.status == 400 and message in reply.error and not m.to_scheduler
    with pytest.raises(error) as caught:
        _prepare(prep, GenerateRequest("r", **fields))
    assert reply.error == str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
def test_the_tokenizer_process_answers_as_the_output_assembler(prep, tok, stream):
    """The served path's final result (non-stream) and its streamed logprob lists are the
    RequestOutput's; its text is the incremental detokenizer's, here the same."""
    m = _manager(prep)
    req = GenerateRequest("r", text="Say:", sampling_params={"stop": ["."]}, return_logprob=True,
                          logprob_start_len=0, return_text_in_logprobs=True, stream=stream)
    m._admit(b"c", req)
    (tr,) = m.to_scheduler
    assert tr.constraint is None and tr.input_ids == tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(" Hello there. And", add_special_tokens=False)
    n = len(tr.input_ids)
    outs = [TokenOutput("r", ids[:2], n, 2, 0, output_logprobs=[-0.1, -0.2], input_logprobs=[None] + [-1.0] * (n - 1),
                        input_top_logprobs=[None] * n),
            TokenOutput("r", ids[2:], n, len(ids), 0, output_logprobs=[-0.3] * (len(ids) - 2),
                        finish_reason={"type": "stop", "matched": "."})]
    for o in outs:
        m._progress(m.in_flight["r"], o)
    assembled = RequestOutput(tr, tok, True)
    for o in outs:
        assembled.add(o)
    expect = assembled.result()
    replies: list[ClientOutput] = m.replies
    assert replies[-1].finished and not m.in_flight
    meta = dict(replies[-1].meta_info)
    assert {"e2e_latency", "time_to_first_token"} <= set(meta)
    if not stream:
        (only,) = replies
        assert only.text == expect["text"] == " Hello there" and only.token_ids == expect["output_ids"]
        assert {k: v for k, v in meta.items() if "latency" not in k and "time_to" not in k} == expect["meta_info"]
    else:
        assert "".join(r.text for r in replies) == expect["text"]
        assert [t for r in replies for t in r.token_ids] == expect["output_ids"]
        streamed = [e for r in replies for e in r.meta_info["output_token_logprobs"]]
        assert streamed == expect["meta_info"]["output_token_logprobs"]
        assert replies[-1].meta_info["input_token_logprobs"] == expect["meta_info"]["input_token_logprobs"]


def test_the_tokenizer_process_answers_a_choices_request(prep):
    m = _manager(prep)
    m._admit(b"c", GenerateRequest("q", text="Colour:", sampling_params={"choices": [" red", " blue"]}))
    subs = list(m.to_scheduler)
    assert [tr.rid for tr in subs] == ["q\x00choice0", "q\x00choice1"] and "q" in m.choice_groups
    for tr, lp in zip(subs, (-2.0, -1.0)):  # " blue" scores higher
        count = len(tr.input_ids) - tr.logprob_start_len
        m._progress(m.in_flight[tr.rid], TokenOutput(tr.rid, [], len(tr.input_ids), 0, 2, {"type": "length", "length": 0},
                                                     input_logprobs=[lp] * count, input_top_logprobs=[None] * count))
    (reply,) = m.replies
    assert reply.finished and reply.text == " blue" and reply.meta_info["selected_index"] == 1
    assert reply.meta_info["normalized_scores"] == [-2.0, -1.0] and reply.meta_info["cached_tokens"] == 2
    assert not m.in_flight and not m.choice_groups
