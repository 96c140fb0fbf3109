from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from radixlm.runtime.server.openai_builders import (
    MIN_LOGPROB,
    RequestAborted,
    aggregate_usage,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    openai_error,
    usage_chunk,
)
from radixlm.runtime.server.openai_protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from radixlm.runtime.server.openai_to_native import chat_messages, chat_to_generate, completion_to_generate

VOCAB = {i: f"t{i}" for i in range(100)}


def decode(token_id: int) -> str:
    return VOCAB[token_id]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def result(text: str, ids: list[int], prompt_tokens: int, cached: int = 0,
           finish: dict | None = None, logprobs: bool = False) -> dict:
    """A native result; output token k has logprob -k/10 and top-2 alternatives."""
    meta = {
        "id": "x",
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "cached_tokens": cached,
        "finish_reason": finish or {"type": "length", "length": len(ids)},
    }
    if logprobs:
        meta["output_token_logprobs"] = [[-k / 10, t] for k, t in enumerate(ids)]
        meta["output_top_logprobs"] = [[[-k / 10, t], [-5.0, 99]] for k, t in enumerate(ids)]
    return {"text": text, "output_ids": ids, "meta_info": meta}


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"suffix": "end"}, "suffix is not supported"),
        ({"best_of": 2}, "best_of=2 is not supported"),
        ({"logprobs": 6}, "logprobs"),
        ({"logit_bias": {"abc": 1}}, "token ids"),
        ({"logit_bias": {"5": 101}}, "[-100, 100]"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": [[1, 2], []]}, "non-empty"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_completion_request_rejects(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        completion(**fields)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs requires logprobs"),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ],
)
def test_chat_request_rejects(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert needle in str(err.value)


def test_best_of_one_and_nulls_are_accepted() -> None:
    req = completion(best_of=1, temperature=None, n=None, stop=None, suffix=None)
    assert req.n == 1 and req.temperature is None and req.suffix is None


def test_unknown_fields_are_refused_and_openai_bookkeeping_ignored() -> None:
    req = chat(service_tier="auto", store=True)
    assert "service_tier" not in chat_to_generate(req, "p")["sampling_params"]
    with pytest.raises(ValidationError, match="max_token\n.*Extra inputs"):
        completion(max_token=5)
    with pytest.raises(ValidationError, match="functions\n.*Extra inputs"):
        chat(functions=[{"name": "f"}])  # the deprecated form of tools


def test_max_tokens_null_means_no_limit_but_absent_means_16() -> None:
    assert completion().max_tokens == 16
    assert completion(max_tokens=None).max_tokens is None
    assert completion_to_generate(completion(max_tokens=None))["sampling_params"]["max_new_tokens"] is None
    assert chat_to_generate(chat(), "p")["sampling_params"]["max_new_tokens"] is None


def test_non_text_content_part_is_named() -> None:
    req = chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]}])
    with pytest.raises(ValueError, match=r"messages\[0\].*image_url"):
        chat_messages(req)


def test_num_prompts() -> None:
    assert completion(prompt="a").num_prompts == 1
    assert completion(prompt=["a", "b"]).num_prompts == 2
    assert completion(prompt=[1, 2, 3]).num_prompts == 1
    assert completion(prompt=[[1], [2], [3]]).num_prompts == 3


# ------------------------------------------------------------- conversion


def test_chat_messages_joins_parts_and_maps_developer() -> None:
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"},
        {"role": "assistant", "content": None},
    ])
    assert chat_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": ""},
    ]


def test_completion_to_generate_full() -> None:
    req = completion(
        prompt=["a", "b"], max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="END", seed=3,
        presence_penalty=0.1, frequency_penalty=0.2, logit_bias={"42": -100, "7": 2.5}, stream=True,
    )
    assert completion_to_generate(req) == {
        "text": ["a", "b"],
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 7, "n": 2, "temperature": 0.5, "top_p": 0.9, "seed": 3,
            "presence_penalty": 0.1, "frequency_penalty": 0.2,
            "stop": ["END"], "logit_bias": {42: -100.0, 7: 2.5},
        },
    }


def test_completion_token_prompts_become_input_ids() -> None:
    assert completion_to_generate(completion(prompt=[1, 2]))["input_ids"] == [1, 2]
    body = completion_to_generate(completion(prompt=[[1, 2], [3]]))
    assert body["input_ids"] == [[1, 2], [3]] and "text" not in body


def test_completion_logprobs_and_echo() -> None:
    body = completion_to_generate(completion(logprobs=2))
    assert (body["return_logprob"], body["top_logprobs_num"]) == (True, 2)
    assert "logprob_start_len" not in body
    assert completion_to_generate(completion(logprobs=0, echo=True))["logprob_start_len"] == 0
    assert "return_logprob" not in completion_to_generate(completion(echo=True))


def test_sglang_extras_pass_through() -> None:
    req = chat(top_k=20, min_p=0.05, repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
               regex="[0-9]+", skip_special_tokens=False, stop_token_ids=[5, 6])
    params = chat_to_generate(req, "p")["sampling_params"]
    assert {k: params[k] for k in ("top_k", "min_p", "repetition_penalty", "min_new_tokens",
                                   "ignore_eos", "regex", "skip_special_tokens", "stop_token_ids")} == {
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_new_tokens": 2,
        "ignore_eos": True, "regex": "[0-9]+", "skip_special_tokens": False, "stop_token_ids": [5, 6],
    }


def test_chat_max_completion_tokens_wins() -> None:
    params = chat_to_generate(chat(max_tokens=5, max_completion_tokens=9), "p")["sampling_params"]
    assert params["max_new_tokens"] == 9
    assert chat_to_generate(chat(max_tokens=5), "p")["sampling_params"]["max_new_tokens"] == 5


def test_chat_to_generate_body() -> None:
    body = chat_to_generate(chat(logprobs=True, top_logprobs=3, stop=["x", "y"]), "PROMPT")
    assert body == {  # (the entries' texts: what OpenAI's logprobs show)
        "text": "PROMPT", "stream": False, "return_logprob": True, "top_logprobs_num": 3,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": None, "n": 1, "stop": ["x", "y"]},
    }
    assert chat_to_generate(chat(logprobs=True), "p")["top_logprobs_num"] == 0


@pytest.mark.parametrize(
    "fmt, expected",
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
            "type": "object", "properties": {"age": {"type": "integer"}}}}},
         {"type": "object", "properties": {"age": {"type": "integer"}}}),
    ],
)
def test_response_format_mapping(fmt: dict, expected: dict | None) -> None:
    params = chat_to_generate(chat(response_format=fmt), "p")["sampling_params"]
    if expected is None:
        assert "json_schema" not in params
    else:
        assert json.loads(params["json_schema"]) == expected


# -------------------------------------------------------- response builders


def two_prompts_two_choices(logprobs: bool = False) -> list[dict]:
    # Prompt-major: prompt 0 has 5 tokens (3 cached on its first choice),
    # prompt 1 has 4 tokens; siblings report more cached, which must not count.
    return [
        result("a0", [1, 2], 5, cached=3, finish={"type": "stop", "matched": 2}, logprobs=logprobs),
        result("a1", [3], 5, cached=5, logprobs=logprobs),
        result("b0", [4, 5, 6], 4, cached=0, finish={"type": "stop", "matched": "\n"}, logprobs=logprobs),
        result("b1", [7], 4, cached=4, logprobs=logprobs),
    ]


def test_usage_counts_prompts_once() -> None:
    assert aggregate_usage(two_prompts_two_choices(), n=2) == {
        "prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_completion_response_exact() -> None:
    body = completion_response(two_prompts_two_choices(), "m", "rid", None, None, decode, n=2)
    created = body.pop("created")
    assert isinstance(created, int)
    assert body == {
        "id": "cmpl-rid",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {"index": 0, "text": "a0", "logprobs": None, "finish_reason": "stop", "matched_stop": 2},
            {"index": 1, "text": "a1", "logprobs": None, "finish_reason": "length", "matched_stop": None},
            {"index": 2, "text": "b0", "logprobs": None, "finish_reason": "stop", "matched_stop": "\n"},
            {"index": 3, "text": "b1", "logprobs": None, "finish_reason": "length", "matched_stop": None},
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                  "prompt_tokens_details": {"cached_tokens": 3}},
    }
    openai.types.Completion.model_validate(body | {"created": created})


def test_completion_response_echo_prefixes_each_prompt() -> None:
    body = completion_response(two_prompts_two_choices(), "m", "r", ["P0 ", "P1 "], None, decode, n=2)
    assert [c["text"] for c in body["choices"]] == ["P0 a0", "P0 a1", "P1 b0", "P1 b1"]


def test_completion_logprobs_format() -> None:
    body = completion_response(two_prompts_two_choices(logprobs=True), "m", "r", None, 2, decode, n=2)
    assert body["choices"][2]["logprobs"] == {
        "tokens": ["t4", "t5", "t6"],
        "token_logprobs": [0.0, -0.1, -0.2],
        "top_logprobs": [{"t4": 0.0, "t99": -5.0}, {"t5": -0.1, "t99": -5.0}, {"t6": -0.2, "t99": -5.0}],
        "text_offset": [0, 2, 4],
    }
    openai.types.Completion.model_validate(body)


def test_completion_top_logprobs_hold_the_chosen_token() -> None:
    """OpenAI's rule (and SGLang's and vLLM's): up to logprobs + 1 entries, the token itself among
    them. logprobs=0 asks for no alternatives, so each entry is the token alone (it was {})."""
    res = result("X", [3, 4], 2, logprobs=True)
    res["meta_info"]["output_top_logprobs"] = []  # top_logprobs_num 0: the runtime sends none
    body = completion_response([res], "m", "r", ["p"], 1, decode, n=1)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"t3": 0.0}, {"t4": -0.1}]
    res = result("X", [3], 2, logprobs=True)
    res["meta_info"]["output_top_logprobs"] = [[[-0.01, 7]]]  # sampled (not greedy): not in the top 1
    body = completion_response([res], "m", "r", ["p"], 1, decode, n=1)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"t7": -0.01, "t3": 0.0}]


def test_completion_echo_logprobs_cover_the_prompt() -> None:
    res = result("X", [3], 2, logprobs=True)
    res["meta_info"]["input_token_logprobs"] = [[None, 1], [-1.5, 2]]
    res["meta_info"]["input_top_logprobs"] = [None, [[-1.0, 9]]]
    body = completion_response([res], "m", "r", ["t1t2"], 2, decode, n=1)
    # The first prompt token has no logprob: null, as OpenAI sends it (the
    # SDK's generated type is stricter than its wire format, so no validation).
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["t1", "t2", "t3"],
        "token_logprobs": [None, -1.5, 0.0],
        "top_logprobs": [None, {"t9": -1.0, "t2": -1.5}, {"t3": 0.0, "t99": -5.0}],
        "text_offset": [0, 2, 4],
    }
    assert body["choices"][0]["text"] == "t1t2X"


def test_chat_response_exact() -> None:
    results = [result("hello", [1, 2], 6, cached=4, finish={"type": "stop", "matched": 0}), result("hi", [3], 6, cached=6)]
    body = chat_response(results, "m", "rid", False, 0, decode)
    created = body.pop("created")
    assert body == {
        "id": "chatcmpl-rid",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None, "finish_reason": "stop",
             "matched_stop": 0},
            {"index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "length",
             "matched_stop": None},
        ],
        "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 4}},
    }
    ChatCompletion.model_validate(body | {"created": created})


def test_chat_logprobs_format_and_truncation() -> None:
    res = result("x", [10, 11], 3, logprobs=True)
    res["meta_info"]["output_token_logprobs"][1][0] = float("-inf")
    body = chat_response([res], "m", "r", True, 1, decode)
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "t10", "logprob": 0.0, "bytes": [116, 49, 48],
         "top_logprobs": [{"token": "t10", "logprob": 0.0, "bytes": [116, 49, 48]}]},
        {"token": "t11", "logprob": MIN_LOGPROB, "bytes": [116, 49, 49],
         "top_logprobs": [{"token": "t11", "logprob": -0.1, "bytes": [116, 49, 49]}]},
    ]}
    ChatCompletion.model_validate(body)
    no_top = chat_response([res], "m", "r", True, 0, decode)
    assert all(tok["top_logprobs"] == [] for tok in no_top["choices"][0]["logprobs"]["content"])


def test_abort_raises_with_message() -> None:
    res = result("", [], 3, finish={"type": "abort", "message": "out of memory"})
    with pytest.raises(RequestAborted, match="out of memory"):
        chat_response([res], "m", "r", False, 0, decode)
    with pytest.raises(RequestAborted):
        completion_response([res], "m", "r", None, None, decode, n=1)


# --------------------------------------------------------------- streaming


def test_completion_chunk_format() -> None:
    chunk = completion_chunk("r", "m", 123, 1, "abc", None)
    assert chunk == {
        "id": "cmpl-r", "object": "text_completion", "created": 123, "model": "m",
        "choices": [{"index": 1, "text": "abc", "logprobs": None, "finish_reason": None, "matched_stop": None}],
    }
    # The SDK streams completions as Completion objects; a finished one must parse.
    openai.types.Completion.model_validate(completion_chunk("r", "m", 123, 0, "", "length"))


def test_chat_chunk_format() -> None:
    first = chat_chunk("r", "m", 5, 0, {"role": "assistant", "content": ""}, None)
    assert first == {
        "id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 5, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None, "matched_stop": None}],
    }
    last = chat_chunk("r", "m", 5, 0, {"content": "!"}, "stop",
                      logprobs={"content": [{"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": []}]})
    for chunk in (first, last):
        ChatCompletionChunk.model_validate(chunk)


def test_usage_chunks() -> None:
    usage = aggregate_usage(two_prompts_two_choices(), n=2)
    chat_usage = usage_chunk("r", "m", 5, usage, chat=True)
    assert chat_usage == {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 5,
                          "model": "m", "choices": [], "usage": usage}
    assert ChatCompletionChunk.model_validate(chat_usage).usage.total_tokens == 16
    text_usage = usage_chunk("r", "m", 5, usage, chat=False)
    assert text_usage["object"] == "text_completion" and text_usage["id"] == "cmpl-r"
    assert openai.types.Completion.model_validate(text_usage).usage.prompt_tokens_details.cached_tokens == 3


def test_include_usage_only_when_streaming() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage
    # stream options without a stream are refused, as OpenAI, vLLM and SGLang refuse them (issue 47)
    with pytest.raises(ValidationError, match="stream_options is only allowed when stream is true"):
        chat(stream=False, stream_options={"include_usage": True})


def test_openai_error_body() -> None:
    assert openai_error("bad n", param="n") == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": 400}
    }
    assert openai_error("boom", "internal_error", code=500)["error"]["code"] == 500


# --------------------------------------------------------------- tool calls

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Is the host up?"}}


@pytest.mark.parametrize("fields,fragment", [
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"tools": [ADD, ADD]}, "distinct"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "the tool name 'no spaces'"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tool name 'f{65}' \\(65 characters\\)"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}, "regex": "x"}, "regex"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "tool_call_id"),
])
def test_tool_requests_are_checked(fields, fragment) -> None:
    with pytest.raises(ValidationError, match=fragment):
        chat(**fields)


def test_tool_choice_sets_the_constraint_and_the_tools_reach_the_template() -> None:
    from radixlm.runtime import tool_calls

    assert chat().tool_mode == "none" and chat(tools=[ADD]).tool_mode == "auto"
    auto = chat_to_generate(chat(tools=[ADD, PING]), "p")
    assert auto["tools"] == [ADD, PING] and "json_schema" not in auto["sampling_params"]
    required = chat_to_generate(chat(tools=[ADD, PING], tool_choice="required", parallel_tool_calls=False), "p")
    assert required["sampling_params"]["json_schema"] == tool_calls.required_schema([ADD, PING], parallel=False)
    named = chat_to_generate(chat(tools=[ADD, PING], tool_choice={"type": "function", "function": {"name": "add"}}), "p")
    assert json.loads(named["sampling_params"]["json_schema"]) == ADD["function"]["parameters"]
    assert "tools" not in chat_to_generate(chat(), "p")


def test_past_calls_reach_the_template_with_object_arguments() -> None:
    req = chat(messages=[
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])
    assert chat_messages(req)[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    bad = chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object"):
        chat_messages(bad)


def _tool_response(req: ChatCompletionRequest, text: str, finish: str = "stop") -> dict:
    from radixlm.runtime.server.output_readers import ToolReader

    body = chat_response([result(text, [1], 5, finish={"type": finish})], "m", "r", False, 0, decode, ToolReader.of(req))
    ChatCompletion.model_validate(body)
    return body["choices"][0]


def test_a_chat_response_carries_the_calls() -> None:
    required = _tool_response(chat(tools=[ADD], tool_choice="required"), '[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] is None
    (call,) = required["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    # cut short by the length limit: no call, the text as it is
    cut = _tool_response(chat(tools=[ADD], tool_choice="required"), '[{"name": "add", "argu', "length")
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '[{"name": "add", "argu'
    assert "tool_calls" not in cut["message"]
    by_name = chat(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    named = _tool_response(by_name, '{"a": 4, "b": 5}')
    assert named["finish_reason"] == "stop" and named["message"]["content"] is None  # as OpenAI answers a forced call
    assert named["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 4, "b": 5}'}
    cut = _tool_response(by_name, '{"a": 4, "b', "length")  # cut short: the arguments as they are
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert cut["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 4, "b'}
    auto = _tool_response(chat(tools=[ADD]), 'Adding.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Adding."
    assert [c["function"] for c in auto["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a": 1, "b": 1}'}]
    plain = _tool_response(chat(tools=[ADD]), "Two.")
    assert plain == {"index": 0, "message": {"role": "assistant", "content": "Two."}, "logprobs": None,
                     "finish_reason": "stop", "matched_stop": None}


@pytest.mark.parametrize("tool_choice,pieces", [
    ({"type": "function", "function": {"name": "add"}}, ['{"a"', ": 1, ", '"b": 2}']),
    ("required", ['[{"name": "add", ', '"arguments": {"a": 1, "b": 2}}]']),
    ("auto", ["Sum", ":<tool", '_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>']),
])
def test_streamed_calls_add_up_to_the_whole_answer(tool_choice, pieces) -> None:
    from radixlm.runtime.server.output_readers import ToolReader

    req = chat(tools=[ADD, PING], tool_choice=tool_choice)
    whole = _tool_response(req, "".join(pieces))
    stream = ToolReader.of(req).stream()
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content, calls = "", {}
    for delta in deltas:
        ChatCompletionChunk.model_validate(chat_chunk("r", "m", 1, 0, delta, None))
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            got = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            got["name"] += call.get("function", {}).get("name", "")
            got["arguments"] += call["function"].get("arguments", "")
    assert content == (whole["message"]["content"] or "")
    assert list(calls.values()) == [c["function"] for c in whole["message"]["tool_calls"]]
    assert stream.called
    if tool_choice != "required":
        assert len(deltas) > 1  # sent as it came, not all at the end


def test_strict_tools_under_auto_hold_opened_calls_to_their_schemas() -> None:
    from radixlm.runtime import tool_calls

    strict_add = {"type": "function", "function": {**ADD["function"], "strict": True}}
    params = chat_to_generate(chat(tools=[strict_add, PING]), "p")["sampling_params"]
    tag = json.loads(params["structural_tag"])
    assert tag["triggers"] == [tool_calls.OPEN] and [s["schema"]["properties"]["name"] for s in tag["structures"]] == [
        {"const": "add"}]  # only the strict tool is held to its schema
    assert "structural_tag" not in chat_to_generate(chat(tools=[ADD, PING]), "p")["sampling_params"]
    assert "structural_tag" not in chat_to_generate(chat(tools=[strict_add], tool_choice="none"), "p")["sampling_params"]
    with pytest.raises(ValidationError, match="strict tools under tool_choice auto"):
        chat(tools=[strict_add], response_format={"type": "json_object"})


def test_responses_tool_choice_auto_needs_no_tools() -> None:
    """OpenAI's response objects carry tool_choice "auto" beside tools: [] and clients send them
    back; SGLang accepts that. "required" (or a named call) with no tools is still refused."""
    from radixlm.runtime.server.responses_protocol import ResponsesRequest, to_chat

    for extra in ({"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []}):
        chat = to_chat(ResponsesRequest.model_validate({"model": "m", "input": "hi", **extra}))
        assert chat.tool_choice is None and not chat.tools
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        to_chat(ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "required"}))
