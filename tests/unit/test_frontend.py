"""The language's interpreter against a scripted backend (no model)."""

from __future__ import annotations

import threading

import pytest

import radixlm as rl
from radixlm.lang.chat_template import CHATML, PLAIN, from_model
from radixlm.lang.interpreter import constant_prefix


class Scripted(rl.Backend):
    """Answers every gen with `reply`, records every body, picks the last choice."""

    def __init__(self, reply: str = "ok", template=CHATML) -> None:
        self.reply, self.bodies, self.prefixes = reply, [], []
        self._template = template
        self.lock = threading.Lock()

    def generate(self, call):
        body = call.native_body()
        with self.lock:
            self.bodies.append(body)
        params = body["sampling_params"]
        if params.get("max_new_tokens") == 0:
            self.prefixes.append(body["text"])
            return {"text": "", "output_ids": [], "meta_info": {}}
        if "choices" in params:  # the last choice scores best
            lps = [[-1.0 - (len(params["choices"]) - i)] for i in range(len(params["choices"]))]
            return {"text": params["choices"][-1], "output_ids": [], "meta_info": {"choice_token_logprobs": lps}}
        return {"text": self.reply, "output_ids": [1], "meta_info": {"cached_tokens": 0}}

    def stream(self, call):
        for ch in self.generate(call)["text"]:
            yield {"text": ch, "meta_info": {}}

    def model_info(self):
        return {}

    @property
    def chat_template(self):
        return self._template


@rl.function
def chat(s, q):
    s += rl.system("Be brief.")
    s += rl.user("Q: " + q)
    s += rl.assistant(rl.gen("a", max_tokens=5, stop="\n"))
    with s.user():
        s += "Again?"
    s += rl.assistant(rl.select("b", ["no", "yes"]))


def test_roles_gens_and_selects_render_and_record():
    backend = Scripted("Paris")
    state = chat.run(q="capital?", backend=backend, temperature=0)
    assert state.text() == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: capital?<|im_end|>\n"
                            "<|im_start|>assistant\nParis<|im_end|>\n<|im_start|>user\nAgain?<|im_end|>\n"
                            "<|im_start|>assistant\nyes<|im_end|>\n")
    assert state["a"] == "Paris" and state["b"] == "yes"
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    gen_body = backend.bodies[0]
    assert gen_body["text"].endswith("<|im_start|>assistant\n")
    # run defaults under the gen's own params; the template's end-of-turn string added inside assistant turns
    assert gen_body["sampling_params"] == {"temperature": 0, "max_new_tokens": 5, "stop": ["\n", "<|im_end|>"]}


def test_streamed_state_yields_pieces_and_equals_the_whole_run():
    state = chat.run(q="x", backend=Scripted("abc"), stream=True)
    assert list(state.text_iter("a")) == ["a", "b", "c"]
    assert state.text() == chat.run(q="x", backend=Scripted("abc")).text()


def test_errors_carry_the_text_so_far():
    @rl.function
    def broken(s):
        s += rl.user("hi")
        s += rl.user("nested") + rl.assistant("x")  # fine
        s += rl.user_begin()
        s += rl.assistant_begin()  # a turn inside a turn

    with pytest.raises(rl.ProgramError) as err:
        broken.run(backend=Scripted())
    assert "inside the unfinished user turn" in str(err.value)
    assert err.value.text.endswith("<|im_start|>user\n")


def test_run_batch_isolates_failures_and_caches_the_constant_prefix_once():
    backend = Scripted()

    @rl.function
    def prog(s, n):
        s += rl.system("Shared instructions. " * 5)
        s += rl.user(f"Number {n}")
        if n == 2:
            raise RuntimeError("two")
        s += rl.assistant(rl.gen("a"))

    states = prog.run_batch([{"n": n} for n in range(5)], backend=backend)
    assert [st.success for st in states] == [True, True, False, True, True]
    assert backend.prefixes == ["<|im_start|>system\n" + "Shared instructions. " * 5 + "<|im_end|>\n<|im_start|>user\nNumber "]


def test_constant_prefix_is_empty_when_arguments_are_not_text():
    @rl.function
    def arithmetic(s, n):
        s += f"{n + 1}"

    assert constant_prefix(arithmetic.fn, Scripted(), ["n"], 0) == ""


def test_fork_sends_the_prefix_once_and_branches_diverge():
    backend = Scripted("r")

    @rl.function
    def tree(s):
        s += "Root. "
        forks = s.fork(2)
        forks += rl.gen("x")
        forks[1] += " more"
        forks.join()
        s.set_var("texts", [f.text() for f in forks])

    state = tree.run(backend=backend)
    assert backend.prefixes == ["Root. "]
    assert state["texts"] == ["Root. r", "Root. r more"]


def test_chat_template_from_the_models_jinja(smol_tokenizer):
    t = from_model(smol_tokenizer.chat_template, smol_tokenizer.bos_token)
    assert t.name == "chatml" and t.default_system and "SmolLM" in t.default_system
    assert from_model(None) is PLAIN
    with pytest.raises(ValueError, match="chatml"):
        rl.get_chat_template("nope")


def test_gen_arguments_map_to_native_sampling_params():
    g = rl.gen("x", max_tokens=3, min_tokens=1, stop="\n", dtype=int, json_schema={"type": "integer"})
    assert g.params == {"max_new_tokens": 3, "min_new_tokens": 1, "stop": ["\n"], "dtype": "int",
                        "json_schema": '{"type": "integer"}'}
    assert isinstance(rl.gen("y", choices=["a", "b"]), type(rl.select("y", ["a", "b"])))
    with pytest.raises(ValueError):
        rl.select("z", [])
    with pytest.raises(RuntimeError, match="no backend"):  # as SGLang: calling a program runs it
        chat("not a state", "q")


def test_async_iteration_streams_pieces():
    import asyncio

    async def collect():
        state = chat.run(q="x", backend=Scripted("xyz"), stream=True)
        return [piece async for piece in state.text_async_iter("a")]

    assert asyncio.run(collect()) == ["x", "y", "z"]
