"""Programs in the language against the live runtime (SmolLM2): both backends, and raw /generate."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

import radixlm as rl
from server.conftest import assert_kv_clean

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SYSTEM = "<|im_start|>system\n{}<|im_end|>\n"


@pytest.fixture(scope="module")
def endpoint(server):
    backend = rl.RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def local_runtime():
    backend = rl.Runtime(max_total_tokens=30000, quantization="none")  # as the test server serves
    yield backend
    backend.shutdown()


@rl.function
def interview(s, topic):
    s += rl.system("You answer in one short sentence.")
    s += rl.user(f"Tell me about {topic}.")
    s += rl.assistant(rl.gen("fact", max_tokens=24))
    s += rl.user("Is that true? Answer yes or no.")
    s += rl.assistant(rl.select("verdict", ["yes", "no"]))
    s += rl.user("Give a year.")
    s += rl.assistant(rl.gen("year", regex=r"(1[5-9]|20)[0-9]{2}"))
    s += rl.user("Describe it as JSON.")
    s += rl.assistant(rl.gen("json", max_tokens=64, json_schema={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "old": {"type": "boolean"}},
        "required": ["name", "old"]}))


def test_greedy_programs_agree_across_backends_and_with_raw_generate(endpoint, local_runtime, server):
    via_http = interview.run(topic="the Eiffel Tower", backend=endpoint, temperature=0)
    via_zmq = interview.run(topic="the Eiffel Tower", backend=local_runtime, temperature=0)
    assert via_http.text() == via_zmq.text()
    for var in ("fact", "verdict", "year", "json"):
        assert via_http[var] == via_zmq[var]
    # the same requests by hand
    prompt = SYSTEM.format("You answer in one short sentence.") + CHAT.format("Tell me about the Eiffel Tower.")
    raw = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop": ["<|im_end|>"]}}, timeout=120).json()
    assert raw["text"] == via_http["fact"]
    assert via_http.messages()[2] == {"role": "assistant", "content": raw["text"]}
    assert re.fullmatch(r"(1[5-9]|20)[0-9]{2}", via_http["year"])
    data = json.loads(via_http["json"])
    assert set(data) == {"name", "old"}
    scores = via_http.get_meta_info("verdict")["normalized_scores"]
    assert via_http["verdict"] == ["yes", "no"][scores.index(max(scores))]
    assert_kv_clean(server.url)


def test_default_system_prompt_matches_the_models_template(endpoint, server):
    """A chat without a system turn gets the one the model's own template inserts."""

    @rl.function
    def ask(s):
        s += rl.user("Hi!")
        s += rl.assistant(rl.gen("reply", max_tokens=8, temperature=0))

    state = ask.run(backend=endpoint)
    rendered = httpx.post(server.url + "/generate", json={
        "messages": [{"role": "user", "content": "Hi!"}],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=120).json()
    assert state["reply"] == rendered["text"]
    assert state.messages()[0]["role"] == "system"


def test_fork_branches_share_the_prefix_and_run_in_parallel(endpoint, server):
    @rl.function
    def branches(s):
        s += rl.user("Name three colours of the rainbow, one per line, with a short reason for each.")
        s += rl.assistant_begin()
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += rl.gen("idea", max_tokens=12, temperature=1.0, seed=i)
        forks.join()
        s.set_var("ideas", [f["idea"] for f in forks])
        s.set_var("cached", [f.get_meta_info("idea")["cached_tokens"] for f in forks])
        s += rl.assistant_end()

    state = branches.run(backend=endpoint)
    shared = state.text()[: state.text().index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
    shared_tokens = httpx.post(server.url + "/generate", json={"text": shared, "sampling_params": {
        "max_new_tokens": 0}}, timeout=60).json()["meta_info"]["prompt_tokens"]
    # a branch's prompt is the shared text itself: all but its last token (which must be computed) is cached
    assert all(c >= shared_tokens - 1 for c in state["cached"]), (state["cached"], shared_tokens)
    assert len(set(state["ideas"])) > 1  # different seeds, different branches
    assert_kv_clean(server.url)


def test_streaming_yields_the_variable_as_it_is_generated(endpoint):
    state = interview.run(topic="tea", backend=endpoint, temperature=0, stream=True)
    pieces = list(state.text_iter("fact"))
    assert len(pieces) > 1 and "".join(pieces) == state["fact"]
    whole = interview.run(topic="tea", backend=endpoint, temperature=0)
    assert whole["fact"] == state["fact"] and whole.text() == state.text()


def test_run_batch_of_64_reports_each_programs_success(endpoint, server):
    @rl.function
    def classify(s, n):
        if n % 16 == 5:
            raise ValueError(f"program {n} refuses")
        s += rl.user(f"Is {n} an even number?")
        s += rl.assistant(rl.select("answer", ["yes", "no"]))

    states = classify.run_batch([{"n": n} for n in range(64)], backend=endpoint, progress_bar=True)
    failed = [n for n, st in enumerate(states) if not st.success]
    assert failed == [5, 21, 37, 53]
    assert "program 5 refuses" in str(states[5].error())
    assert all(st["answer"] in ("yes", "no") for st in states if st.success)
    assert_kv_clean(server.url)


def test_a_bad_request_fails_its_program_with_the_text_so_far(endpoint):
    @rl.function
    def bad(s):
        s += rl.user("Hello")
        s += rl.assistant(rl.gen("x", regex="(unclosed"))

    with pytest.raises(rl.ProgramError) as err:
        bad.run(backend=endpoint)
    assert "regex" in str(err.value) and "<|im_start|>user\nHello" in err.value.text


def test_json_and_regex_outputs_validate(endpoint):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
                                               "population": {"type": "integer"}}, "required": ["city", "population"]}

    @rl.function
    def extract(s, text):
        s += rl.user(f"Extract the city and population as JSON: {text}")
        s += rl.assistant(rl.gen("data", max_tokens=48, json_schema=schema, temperature=1.0, seed=1))
        s += rl.user("And its phone prefix?")
        s += rl.assistant(rl.gen("phone", regex=r"\+[0-9]{2,3}"))

    state = extract.run(text="Lyon has 520000 inhabitants.", backend=endpoint)
    jsonschema.validate(json.loads(state["data"]), schema)
    assert re.fullmatch(r"\+[0-9]{2,3}", state["phone"])


@rl.function
def chat_and_pick(s):
    s += rl.system("You are a geography tutor.")
    s += rl.user("What is the capital of Japan?")
    s += rl.assistant(rl.gen("answer", max_tokens=20))


def test_openai_backend_chat_model_equals_the_native_program(endpoint, server):
    native = chat_and_pick.run(backend=endpoint, temperature=0)
    chat = chat_and_pick.run(backend=rl.OpenAI("default", base_url=server.url + "/v1"), temperature=0)
    assert chat["answer"] == native["answer"]
    assert chat.get_meta_info("answer")["prompt_tokens"] == native.get_meta_info("answer")["prompt_tokens"]

    @rl.function
    def pick(s):
        s += rl.user("Yes or no?")
        s += rl.assistant(rl.select("x", ["yes", "no"]))

    with pytest.raises(rl.ProgramError, match="chat completions do not return"):
        pick.run(backend=rl.OpenAI("default", base_url=server.url + "/v1"))

    @rl.function
    def mid_turn(s):
        s += rl.user("Hi")
        s += rl.assistant("Well, " + rl.gen("x", max_tokens=4))

    with pytest.raises(rl.ProgramError, match="whole assistant turns"):
        mid_turn.run(backend=rl.OpenAI("default", base_url=server.url + "/v1"))


def test_openai_backend_completions_model_scores_select_by_echoed_logprobs(endpoint, server):
    completions = rl.OpenAI("default", base_url=server.url + "/v1", is_chat_model=False, chat_template="chatml")
    via_openai = interview.run(topic="the Moon", backend=completions, temperature=0)
    native = interview.run(topic="the Moon", backend=endpoint, temperature=0)
    assert via_openai["fact"] == native["fact"]
    assert via_openai["verdict"] == native["verdict"]
    ours = via_openai.get_meta_info("verdict")["normalized_scores"]
    theirs = native.get_meta_info("verdict")["normalized_scores"]
    assert ours == pytest.approx(theirs, abs=1e-3)
    assert via_openai["year"] == native["year"]  # regex through extra_body
    assert json.loads(via_openai["json"]) == json.loads(native["json"])  # json_schema through response_format


def test_runtime_attaches_to_a_running_server(endpoint, server):
    attached = rl.Runtime(attach=server.url)
    try:
        assert chat_and_pick.run(backend=attached, temperature=0)["answer"] == \
            chat_and_pick.run(backend=endpoint, temperature=0)["answer"]
    finally:
        attached.shutdown()  # disconnects; the server's runtime keeps running
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert chat_and_pick.run(backend=endpoint, temperature=0)["answer"]
    with pytest.raises(ValueError, match="keeps the options"):
        rl.Runtime(attach=server.url, page_size=4)
