"""Where the OpenAI endpoints answered differently from SGLang, OpenAI and vLLM (issue 32, found by
their API test suites), through the official `openai` client on the app alone: a stand-in client
plays the runtime and keeps the native requests it is given. The last test echoes token ids
through the live server, whose tokenizer decodes them."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from radixlm.runtime.messages import ClientOutput
from radixlm.runtime.server.http_server import ServerState, create_app

# How the stand-in runtime decodes token ids, one by one (as the tokenizer process fills logprob texts)
VOCAB = {5: "Hello", 6: ",", 7: " world"}


class StandInClient:
    """Answers every request with `pieces` (one output each, the last one finished by `finish`);
    a request for its prompt's logprobs from position 0 gets them, with texts when it asks."""

    on_finish = None

    def __init__(self, pieces: tuple[str, ...] = (" a", " b"), finish: dict | None = None) -> None:
        self.pieces, self.finish, self.seen = pieces, finish or {"type": "stop", "matched": 2}, []

    async def stream(self, req):
        self.seen.append(req)
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            meta = {"prompt_tokens": 3, "completion_tokens": i + 1, "cached_tokens": 0}
            if last:
                meta["finish_reason"] = self.finish
            if req.return_logprob and req.input_ids is not None and req.logprob_start_len == 0:
                meta["input_token_logprobs"] = [
                    [None if j == 0 else -1.0, t, VOCAB[t] if req.return_text_in_logprobs else None]
                    for j, t in enumerate(req.input_ids)]
            yield ClientOutput(req.rid, text, [10 + i], meta, finished=last)

    async def control(self, op, args=None):
        assert op == "lora_adapters", op  # (/v1/models lists them; no other op is asked)
        return {"adapters": {}}

    async def generate(self, req):
        outs = [out async for out in self.stream(req)]
        return ClientOutput(req.rid, "".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
                            outs[-1].meta_info, finished=True)


def connect(runtime: StandInClient) -> openai.OpenAI:
    http = TestClient(create_app(ServerState(runtime, {"context_length": 2048}, {}, "smol")))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)


def first_chunks(stream) -> dict[int, str]:
    """Each choice's first streamed text, by choice index."""
    firsts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
    return firsts


# ------------------------------------------------------------------------------- echo (8, 9)


def test_a_streamed_echo_begins_each_choice_with_its_prompt():
    client = connect(StandInClient())
    stream = client.completions.create(model="smol", prompt=["One", "Two"], n=2, echo=True, max_tokens=2, stream=True)
    assert first_chunks(stream) == {0: "One a", 1: "One a", 2: "Two a", 3: "Two a"}


@pytest.mark.parametrize("stream", [False, True])
def test_token_id_prompts_are_echoed_as_the_runtime_decodes_them(stream):
    runtime = StandInClient()
    client = connect(runtime)
    r = client.completions.create(model="smol", prompt=[[5, 6, 7], [7]], echo=True, max_tokens=2, stream=stream)
    if stream:
        assert first_chunks(r) == {0: "Hello, world a", 1: " world a"}
    else:
        assert [c.text for c in r.choices] == ["Hello, world a b", " world a b"]
        assert all(c.logprobs is None for c in r.choices)  # asked of the runtime for the texts, not answered
    asked = runtime.seen[-1]
    assert asked.return_logprob and asked.logprob_start_len == 0 and asked.return_text_in_logprobs


# ------------------------------------------------------------------------------ matched_stop (11)


@pytest.mark.parametrize("finish,matched", [
    ({"type": "stop", "matched": 2}, 2),  # a stop token (EOS included)
    ({"type": "stop", "matched": "END"}, "END"),  # a stop string
    ({"type": "length", "length": 2}, None),
])
def test_each_choice_says_what_stopped_it(finish, matched):
    client = connect(StandInClient(finish=finish))
    messages = [{"role": "user", "content": "hi"}]
    assert client.completions.create(model="smol", prompt="hi", max_tokens=2).choices[0].matched_stop == matched
    assert client.chat.completions.create(model="smol", messages=messages).choices[0].matched_stop == matched
    for chunks in (list(client.completions.create(model="smol", prompt="hi", max_tokens=2, stream=True)),
                   list(client.chat.completions.create(model="smol", messages=messages, stream=True))):
        *running, last = chunks
        assert last.choices[0].finish_reason is not None and last.choices[0].matched_stop == matched
        assert all(c.choices[0].matched_stop is None for c in running)


# ---------------------------------------------------------------- SGLang's request fields (12)


def test_chat_takes_stop_regex_and_continue_final_message():
    runtime = StandInClient()
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    connect(runtime).chat.completions.create(model="smol", messages=messages, extra_body={
        "stop_regex": r"\d{2}", "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}})
    req = runtime.seen[-1]
    assert req.sampling_params["stop_regex"] == r"\d{2}"
    # the tokenizer process renders the messages, so the prefill is asked of it with the template's variables
    assert req.chat_template_kwargs == {"enable_thinking": False, "continue_final_message": True}
    assert req.messages[-1] == {"role": "assistant", "content": "1, 2,"}


def test_completions_take_stop_regex():
    runtime = StandInClient()
    connect(runtime).completions.create(model="smol", prompt="1, 2,", extra_body={"stop_regex": ["x", r"\d{2}"]})
    assert runtime.seen[-1].sampling_params["stop_regex"] == ["x", r"\d{2}"]


def test_responses_take_sglangs_sampling_extras():
    runtime = StandInClient()
    extras = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
              "presence_penalty": -0.5, "seed": 7, "stop": ["END"]}
    connect(runtime).responses.create(model="smol", input="hi", extra_body=extras)
    assert {k: runtime.seen[-1].sampling_params.get(k) for k in extras} == extras
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        connect(runtime).responses.create(model="smol", input="hi", extra_body={"frequency_penalty": 3})


# ---------------------------------------------------------------------------- models (15)


def test_the_served_model_is_retrieved():
    client = connect(StandInClient())
    model = client.models.retrieve("smol")
    assert (model.id, model.object, model.max_model_len) == ("smol", "model", 2048)
    assert [m.id for m in client.models.list().data] == ["smol"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert set(caught.value.body) == {"message", "type", "param", "code"} and "gpt-4o" in caught.value.body["message"]


def test_any_model_name_means_the_served_model():
    client = connect(StandInClient())
    assert client.completions.create(model="gpt-4o", prompt="hi").model == "smol"
    assert client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]).model == "smol"
    assert client.responses.create(model="gpt-4o", input="hi").model == "smol"


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("POST", "/v1/models", 405)])
def test_an_unknown_route_answers_an_openai_error(method, path, status):
    http = TestClient(create_app(ServerState(StandInClient(), {}, {}, "smol")))
    r = http.request(method, path)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and path in error["message"]


# ------------------------------------------------------------------------------ logit_bias (16)


def test_a_logit_bias_error_names_every_bad_entry():
    client = connect(StandInClient())
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smol", prompt="hi", logit_bias={"a": 1, "5": 2, "b": 3})
    assert "'a'" in caught.value.message and "'b'" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                       logit_bias={"1": 101, "2": 0, "3": -200})
    assert "logit_bias[1]" in caught.value.message and "logit_bias[3]" in caught.value.message


# -------------------------------------------------------------------------- the live server (9)


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_are_echoed_by_the_live_server(server, smol_tokenizer, stream):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    text = "The capital of France is"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    r = client.completions.create(model="default", prompt=ids, echo=True, max_tokens=2, temperature=0, stream=stream)
    echoed = next(iter(r)).choices[0].text if stream else r.choices[0].text
    assert echoed.startswith(text)
