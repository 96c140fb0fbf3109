"""SGLang programs with only the import changed (`import radixlm as sgl`), against the live server
(SmolLM2): the shared programs of sglang_programs.py, each checked against the raw /generate
requests it stands for, and the SGLang-only features that need a model."""

from __future__ import annotations

import re

import httpx
import pytest

import radixlm as sgl
from server.conftest import assert_kv_clean
from sglang_programs import CAPITALS, YEAR, backend, programs

CHAT = "<|im_start|>{}\n{}<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ours(server):
    b = backend(sgl, server.url)
    yield {name: p.run(b) for name, p in programs(sgl).items()}
    b.shutdown()


def raw(server, text, **params):
    body = {"text": text, "sampling_params": {"temperature": 0, **params}}
    return httpx.post(server.url + "/generate", json=body, timeout=120).json()


def test_gen_is_the_raw_generation(ours, server):
    prompt = "The capital of France is"
    assert ours["gen"]["answer"] == raw(server, prompt, max_new_tokens=12, stop=["\n"])["text"]
    assert ours["gen"]["text"] == prompt + ours["gen"]["answer"]


def test_select_is_the_servers_choice(ours, server):
    prompt = CHAT.format("user", "What is the capital of France? Answer with one word.") + ASSISTANT
    choices = ["Paris", "Banana", "Seventeen"]
    expected = raw(server, prompt, choices=choices)["text"]
    assert ours["select"]["city"] == expected
    assert ours["select"]["text"] == prompt + expected + "<|im_end|>\n"


def test_regex_output_matches_and_is_the_raw_generation(ours, server):
    prompt = CHAT.format("user", "In which year did the first person walk on the Moon?") + ASSISTANT
    assert re.fullmatch(YEAR, ours["regex"]["year"])
    assert ours["regex"]["year"] == raw(server, prompt, max_new_tokens=8, regex=YEAR, stop=["<|im_end|>"])["text"]


def test_fork_join_gathers_each_branchs_idea(ours, server):
    head = "Here are two ideas for a weekend, one line each.\n"
    expected = [raw(server, head + f"Idea {i + 1}:", max_new_tokens=10, stop=["\n"])["text"] for i in range(2)]
    assert ours["fork"]["ideas"] == expected
    assert ours["fork"]["text"] == head  # the parent's text stays; the branches' variables came back


def test_multi_turn_keeps_the_history(ours, server):
    r = ours["multi_turn"]
    history = (CHAT.format("system", "You are a helpful assistant. Answer briefly.")
               + CHAT.format("user", "What colour is the sky on a clear day?"))
    assert r["first"] == raw(server, history + ASSISTANT, max_new_tokens=16, stop=["<|im_end|>"])["text"]
    history += CHAT.format("assistant", r["first"]) + CHAT.format("user", "Say it again in other words.")
    assert r["second"] == raw(server, history + ASSISTANT, max_new_tokens=16, stop=["<|im_end|>"])["text"]
    assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert r["messages"][4]["content"] == r["second"] and r["text"] == history + ASSISTANT + r["second"] + "<|im_end|>\n"


def test_run_batch_equals_one_run_per_row(ours, server):
    assert ours["run_batch"]["answers"][0] == ours["gen"]["answer"]
    assert ours["run_batch"]["answers"] == [raw(server, f"The capital of {c} is", max_new_tokens=12, stop=["\n"])["text"]
                                            for c in CAPITALS]
    assert_kv_clean(server.url)


# ---- SGLang's features that need a model --------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint(server):
    b = sgl.RuntimeEndpoint(server.url)
    yield b
    b.shutdown()


def test_gen_n_and_logprob_arguments(endpoint):
    @sgl.function
    def sampled(s):
        s += "Once upon a time"
        s += sgl.gen("story", max_tokens=6, n=2, temperature=1.0, seed=3, return_logprob=True, top_logprobs_num=2,
                     return_text_in_logprobs=True)

    st = sampled.run(backend=endpoint)
    stories, metas = st["story"], st.get_meta_info("story")
    assert isinstance(stories, list) and len(stories) == 2 and len(metas) == 2
    assert st.text() == "Once upon a time" + stories[0]
    for meta in metas:
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        assert all(isinstance(entry[2], str) for entry in meta["output_token_logprobs"])  # the token's text


def test_logprob_start_len_from_run(endpoint):
    @sgl.function
    def scored(s):
        s += "One two three four five"
        s += sgl.gen("next", max_tokens=2)

    st = scored.run(backend=endpoint, temperature=0, return_logprob=True, logprob_start_len=2)
    meta = st.get_meta_info("next")
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 2


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection",
                                    "unconditional_likelihood_normalized"])
def test_select_methods_on_the_model(endpoint, server, method):
    @sgl.function
    def pick(s):
        s += sgl.user("Is water wet? Answer yes or no.")
        s += sgl.assistant(sgl.select("answer", ["yes", "no"], 0.0, getattr(sgl, method)))

    st = pick.run(backend=endpoint)
    meta = st.get_meta_info("answer")
    assert st["answer"] == ["yes", "no"][meta["selected_index"]]
    assert {"normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs"} <= set(meta)
    prompt = st.text()[: -len(st["answer"] + "<|im_end|>\n")]
    server_method = "unconditional_likelihood_normalized" if "unconditional" in method else "token_length_normalized"
    server_meta = raw(server, prompt, choices=["yes", "no"], choices_method=server_method)["meta_info"]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        [sum(lps) / len(lps) for lps in server_meta["choice_token_logprobs"]], abs=1e-4)
    if method == "unconditional_likelihood_normalized":
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(server_meta["normalized_scores"],
                                                                                 abs=1e-4)
        assert st["answer"] == server_meta["choices"][server_meta["selected_index"]]
    if method == "greedy_token_selection":
        assert len(meta["greedy_logprob_matrix"]) == 2


def test_flush_cache_and_server_info(endpoint):
    info = sgl.get_server_info(endpoint)
    assert "model_path" in info or "max_total_tokens" in info
    assert sgl.flush_cache(endpoint) is True


def test_stop_regex_and_no_stop_trim_reach_the_runtime(endpoint):
    """Needs the runtime's stop_regex / no_stop_trim (SGLang's sampling params)."""

    @sgl.function
    def count(s):
        s += "1, 2, 3, 4, 5, 6, 7, 8, 9,"
        s += sgl.gen("regex_stopped", max_tokens=16, stop_regex=r"[0-9]+,")
        s += "\n1, 2, 3,"
        s += sgl.gen("kept", max_tokens=16, stop=",", no_stop_trim=True)

    st = count.run(backend=endpoint, temperature=0)
    # unconstrained, the model counts on (" 10, 11, 12, ..."): the pattern ends it at its first match
    assert re.search(r"[0-9]", st["regex_stopped"]) and st["regex_stopped"].rstrip(",").count(",") == 0
    assert st["kept"].endswith(",") and st["kept"].count(",") == 1
