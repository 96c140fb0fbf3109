"""SGLang programs on our language with only the import changed (issue 18, item 5): a scripted
backend (no model) for each feature; SGLang's own frontend, where installed, for its signatures
and its choices methods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import radixlm as sgl
from radixlm.lang.chat_template import CHATML

# SGLang's frontend, installed without dependencies by scripts/setup.sh (another Python: SGLANG_PYTHON)
SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON", sys.executable)


class Fake(sgl.Backend):
    """Answers each gen with `reply(prompt)`; n > 1 with n answers; choices with `choice_logprobs`."""

    def __init__(self, reply=lambda text: "ok", choice_logprobs=None, unconditional=None) -> None:
        self.reply, self.choice_lps, self.unconditional = reply, choice_logprobs, unconditional
        self.bodies, self.threads = [], []
        self.lock = threading.Lock()
        self.flushed = 0

    def generate(self, call):
        body = call.native_body()
        with self.lock:
            self.bodies.append(body)
            self.threads.append(threading.current_thread())
        params = body["sampling_params"]
        if params.get("max_new_tokens") == 0:
            return {"text": "", "output_ids": [], "meta_info": {}}
        if "choices" in params:
            meta = {"choice_token_logprobs": self.choice_lps, "prompt_tokens": 7, "cached_tokens": 6}
            if params["choices_method"] == "unconditional_likelihood_normalized":
                meta["unconditional_token_logprobs"] = self.unconditional
            return {"text": "?", "output_ids": [], "meta_info": meta}
        n = params.get("n", 1)
        results = [{"text": f"{self.reply(body['text'])}{i or ''}", "output_ids": [], "meta_info": {"sample": i}}
                   for i in range(n)]
        return results if n > 1 else results[0]

    def stream(self, call):
        for ch in self.generate(call)["text"]:
            yield {"text": ch, "meta_info": {"piece": ch}}

    def model_info(self):
        return {}

    def flush_cache(self):
        self.flushed += 1
        return True

    def get_server_info(self):
        return {"model_path": "fake"}

    @property
    def chat_template(self):
        return CHATML


def gens(backend):
    return [b for b in backend.bodies if b["sampling_params"].get("max_new_tokens") != 0]


# ---- the state ---------------------------------------------------------------------------------

def test_item_assignment_membership_and_unknown_meta_info():
    @sgl.function
    def prog(s):
        s += "Q: " + sgl.gen("a")
        s["k"] = 42
        s.set_var("j", "x")
        s.set_var("has", ("k" in s, "a" in s, "nope" in s))

    state = prog.run(backend=Fake(lambda t: "A"))
    assert state["k"] == 42 and state["j"] == "x" and state["has"] == (True, True, False)
    assert "a" in state and "missing" not in state
    assert state.get_meta_info("missing") is None  # as SGLang
    assert state.get_meta_info("a") == {"sample": 0}
    with pytest.raises(KeyError, match="missing"):
        state["missing"]


def test_state_role_methods_take_an_expression():
    @sgl.function
    def methods(s):
        s.system("Be brief.")
        returned = s.user("Hi " + sgl.gen("name", max_tokens=2))
        s.set_var("returned_an_expr", returned is not None and not isinstance(returned, sgl.ProgramState))
        s.assistant(sgl.gen("reply"))

    @sgl.function
    def appended(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi " + sgl.gen("name", max_tokens=2))
        s += sgl.assistant(sgl.gen("reply"))

    a, b = methods.run(backend=Fake()), appended.run(backend=Fake())
    assert a.text() == b.text() == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ok<|im_end|>\n"
                                    "<|im_start|>assistant\nok<|im_end|>\n")
    assert a["returned_an_expr"]


def test_role_without_expression_is_an_empty_turn_as_in_sglang():
    @sgl.function
    def empty(s):
        s += sgl.user()
        s += "after"

    assert empty.run(backend=Fake()).text() == "<|im_start|>user\n<|im_end|>\nafter"


def test_error_is_a_method_and_the_state_repr_shows_the_text():
    @sgl.function
    def fine(s):
        s += "x"

    state = fine.run(backend=Fake())
    assert state.error() is None and state.success and repr(state) == "ProgramState('x')"

    @sgl.function
    def failing(s, n):
        s += f"row {n} "
        if n == 1:
            raise ValueError("one")
        s += sgl.gen("a")

    states = failing.run_batch([{"n": 0}, {"n": 1}], backend=Fake())
    assert states[0].error() is None
    assert isinstance(states[1].error(), sgl.ProgramError) and "one" in str(states[1].error())
    assert states[1].error().text == "row 1 "


def test_var_scope_and_copy():
    @sgl.function
    def prog(s):
        with s.var_scope("scoped"):
            s += "inside " + sgl.gen("g")
        s += " outside"
        with s.copy() as c:
            c += " branch " + sgl.gen("in_copy")

    state = prog.run(backend=Fake(lambda t: "G"))
    assert state["scoped"] == "inside G"
    assert state["in_copy"] == ["G"]  # gathered from the one branch
    assert state.text() == "inside G outside"


def test_text_iter_of_a_state_that_did_not_stream_yields_it_whole():
    @sgl.function
    def prog(s):
        s += "a " + sgl.gen("x") + " b"

    state = prog.run(backend=Fake(lambda t: "xyz"))
    assert list(state.text_iter()) == ["a xyz b"]
    assert list(state.text_iter("x")) == ["xyz"]


def test_async_iteration_returns_meta_data_when_asked():
    import asyncio

    @sgl.function
    def prog(s):
        s += sgl.gen("x")

    async def collect():
        state = prog.run(backend=Fake(lambda t: "ab"), stream=True)
        return [item async for item in state.text_async_iter("x", return_meta_data=True)]

    assert asyncio.run(collect()) == [("a", {"piece": "a"}), ("b", {"piece": "b"})]


# ---- fork and join -----------------------------------------------------------------------------

def test_join_gathers_branch_variables_into_the_parent():
    @sgl.function
    def tree(s):
        s += "Root. "
        s["kept"] = "parent's"
        forks = s.fork(3)
        forks += lambda i: f"branch {i}: " + sgl.gen("idea")
        forks[0]["kept"] = "changed in a branch"  # the parent had it: not gathered
        forks.join()

    state = tree.run(backend=Fake(lambda text: "<" + text.rsplit(" ", 2)[-2] + ">"))
    assert state["idea"] == ["<0:>", "<1:>", "<2:>"]  # one per branch, in branch order
    assert state["kept"] == "parent's"
    assert state.text() == "Root. "  # gather_variable leaves the parent's text alone


def test_join_concate_and_append_appends_each_branch_text():
    @sgl.function
    def tree(s):
        s += "Root."
        forks = s.fork(2)
        forks += [" one", " two"]
        forks.join("concate_and_append")
        s += " end"

    assert tree.run(backend=Fake()).text() == "Root. one two end"
    with pytest.raises(sgl.ProgramError, match="join mode"):
        @sgl.function
        def bad(s):
            s.fork(1).join("zip")

        bad.run(backend=Fake())


def test_fork_of_two_or_more_sends_the_prefix_once():
    backend = Fake()

    @sgl.function
    def tree(s):
        s += "Root. "
        forks = s.fork(2)
        forks += sgl.gen("x")
        forks.join()

    tree.run(backend=backend)
    assert [b["text"] for b in backend.bodies if b["sampling_params"].get("max_new_tokens") == 0] == ["Root. "]


# ---- gen, gen_int, gen_string, select -----------------------------------------------------------

def test_gen_positional_arguments_follow_sglangs_order():
    g = sgl.gen("x", 5, 1, 2, "\n", [7], r"\d\d", 0.5, 0.9, 40, 0.1, 0.2, 0.3, True)
    assert g.params == {"max_new_tokens": 5, "min_new_tokens": 1, "n": 2, "stop": ["\n"], "stop_token_ids": [7],
                        "stop_regex": r"\d\d", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1,
                        "frequency_penalty": 0.2, "presence_penalty": 0.3, "ignore_eos": True}


def test_gen_sends_sglangs_sampling_and_logprob_arguments_where_the_native_body_has_them():
    backend = Fake()

    @sgl.function
    def prog(s):
        s += sgl.gen("x", max_tokens=4, stop_regex=["a+b"], no_stop_trim=True, return_logprob=True,
                     logprob_start_len=3, top_logprobs_num=2, return_text_in_logprobs=True, sampling_seed=9)

    prog.run(backend=backend)
    body = gens(backend)[0]
    assert body["sampling_params"] == {"max_new_tokens": 4, "stop_regex": ["a+b"], "no_stop_trim": True,
                                       "sampling_seed": 9}
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"],
            body["return_text_in_logprobs"]) == (True, 3, 2, True)


def test_gen_with_n_stores_every_sample_and_continues_with_the_first():
    @sgl.function
    def prog(s):
        s += "Q: " + sgl.gen("x", n=3) + " end"

    state = prog.run(backend=Fake(lambda t: "s"))
    assert state["x"] == ["s", "s1", "s2"]
    assert state.text() == "Q: s end"
    assert state.get_meta_info("x") == [{"sample": 0}, {"sample": 1}, {"sample": 2}]


def test_positional_gen_int_and_gen_string():
    i = sgl.gen_int("n", 4, None, "\n", None, None, 0.0)
    assert i.params == {"max_new_tokens": 4, "stop": ["\n"], "temperature": 0.0, "dtype": "int"}
    s = sgl.gen_string("t", 8, top_k=3)
    assert s.params == {"max_new_tokens": 8, "top_k": 3, "dtype": "str"}
    with pytest.raises(TypeError, match="both by position and by name"):
        sgl.gen_int("n", 4, max_tokens=5)
    with pytest.raises(TypeError, match="regex"):
        sgl.gen_int("n", regex="[0-9]")


def test_dtype_is_sent_as_sglangs_regex_and_stops():
    backend = Fake(lambda t: "4")

    @sgl.function
    def typed(s):
        s += sgl.user("Legs of a cat?")
        s += sgl.assistant(sgl.gen_int("legs", stop="."))
        s += sgl.gen_string("name") + sgl.gen("flag", dtype=bool) + sgl.gen("x", dtype="float")

    typed.run(backend=backend)
    legs, name, flag, x = (b["sampling_params"] for b in gens(backend))
    assert legs == {"regex": r"[-+]?[0-9]+[ \n]*", "stop": [".", "<|im_end|>", " ", "\n"]}
    assert name == {"regex": r'\"[\w\d\s]*\"'} and flag == {"regex": "(True|False)"}  # SGLang's, quotes escaped
    assert x == {"regex": r"[-+]?[0-9]*\.?[0-9]+[ \n]*", "stop": [" ", "\n"]}

    @sgl.function
    def both(s):
        s += sgl.gen("x", dtype=int, regex="[0-9]")

    with pytest.raises(sgl.ProgramError, match="one of dtype, regex"):
        both.run(backend=Fake())
    with pytest.raises(ValueError, match="dtype is int"):
        sgl.gen("x", dtype=list)


def test_select_positional_temperature_is_not_the_method():
    sel = sgl.select("x", ["a", "b"], 0.0, sgl.greedy_token_selection)
    assert sel.method is sgl.greedy_token_selection
    assert sgl.select("x", ["a", "b"], 0).method is sgl.token_length_normalized
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", ["a", "b"], 0.7)
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.gen("x", choices=["a", "b"], temperature=0.7)
    assert sgl.gen("x", choices=["a", "b"], choices_method=sgl.unconditional_likelihood_normalized).method \
        is sgl.unconditional_likelihood_normalized


# three choices, each method picks a different one:
#   means: a -1.0, bb -1.25, c -0.9              -> token_length_normalized: c
#   first token: bb -0.5 is the highest         -> greedy_token_selection: bb
#   mean minus unconditional mean: 2.0, -0.25, -0.4 -> unconditional_likelihood_normalized: a
CHOICES = ["a", "bb", "c"]
CONDITIONAL = [[-1.0], [-0.5, -2.0], [-0.9]]
UNCONDITIONAL = [[-3.0], [-1.0, -1.0], [-0.5]]
SGLANG_KEYS = {
    "token_length_normalized": {"normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs"},
    "greedy_token_selection": {"normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs",
                               "greedy_logprob_matrix"},
    "unconditional_likelihood_normalized": {"normalized_prompt_logprobs", "input_token_logprobs",
                                            "output_token_logprobs", "unconditional_token_logprobs",
                                            "normalized_unconditional_prompt_logprobs"},
}


@pytest.mark.parametrize("method,expected", [("token_length_normalized", "c"), ("greedy_token_selection", "bb"),
                                             ("unconditional_likelihood_normalized", "a")])
def test_select_methods_decide_and_report_sglangs_meta_info(method, expected):
    @sgl.function
    def pick(s):
        s += "Pick: " + sgl.select("x", CHOICES, choices_method=getattr(sgl, method))

    state = pick.run(backend=Fake(choice_logprobs=CONDITIONAL, unconditional=UNCONDITIONAL))
    meta = state.get_meta_info("x")
    assert state["x"] == expected and state.text() == "Pick: " + expected
    assert SGLANG_KEYS[method] <= set(meta)
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-1.0, -1.25, -0.9])
    assert meta["input_token_logprobs"] == [[[-1.0, None, None]], [[-0.5, None, None], [-2.0, None, None]],
                                            [[-0.9, None, None]]]
    assert meta["output_token_logprobs"] == [[], [], []]
    assert meta["selected_index"] == CHOICES.index(expected)  # ours, beside SGLang's
    assert (meta["prompt_tokens"], meta["cached_tokens"]) == (7, 6)
    if method == "greedy_token_selection":
        assert meta["greedy_logprob_matrix"] == [[-1.0, -1.0], [-0.5, -2.0], [-0.9, -0.9]]
    if method == "unconditional_likelihood_normalized":
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([2.0, -0.25, -0.4])


def test_a_programs_own_choices_method_is_called_with_sglangs_arguments():
    class Shortest(sgl.ChoicesSamplingMethod):
        def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                     unconditional_token_logprobs=None):
            best = min(range(len(choices)), key=lambda i: len(input_token_logprobs[i]))
            return sgl.ChoicesDecision(choices[best], {"lengths": [len(t) for t in input_token_logprobs]})

    @sgl.function
    def pick(s):
        s += sgl.select("x", ["bb", "a"], choices_method=Shortest())

    state = pick.run(backend=Fake(choice_logprobs=[[-0.1, -0.1], [-5.0]]))
    assert state["x"] == "a" and state.get_meta_info("x")["lengths"] == [2, 1]


# ---- programs: function, run, run_batch ---------------------------------------------------------

def test_function_decorator_with_arguments_and_bind():
    @sgl.function(num_api_spec_tokens=64)
    def prog(s, a, b="B"):
        s += f"{a}-{b}"

    assert prog.run("A", backend=Fake()).text() == "A-B"
    assert prog.bind(b="bound").run(a="A", backend=Fake()).text() == "A-bound"
    with pytest.raises(TypeError, match="no arguments"):
        prog.bind(c=1)
    sgl.set_default_backend(Fake())
    try:
        assert prog(a="called").text() == "called-B"  # as SGLang: calling a program runs it
    finally:
        sgl.set_default_backend(None)


def test_run_and_run_batch_take_logprob_arguments_as_defaults():
    backend = Fake()

    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("a") + sgl.gen("b", return_logprob=False)

    prog.run("x", backend=backend, return_logprob=True, top_logprobs_num=3, logprob_start_len=0, n=1,
             stop_regex="z", max_new_tokens=9)
    first, second = gens(backend)
    assert (first["return_logprob"], first["top_logprobs_num"], first["logprob_start_len"]) == (True, 3, 0)
    assert second["return_logprob"] is False  # the gen's own value wins
    assert first["sampling_params"] == {"max_new_tokens": 9, "n": 1, "stop_regex": "z"}
    backend.bodies.clear()
    prog.run_batch([{"q": "p"}, {"q": "r"}], backend=backend, return_text_in_logprobs=True, return_logprob=True)
    bodies = gens(backend)
    assert len(bodies) == 4 and all(b["return_text_in_logprobs"] for b in bodies)
    assert sorted(b["return_logprob"] for b in bodies) == [False, False, True, True]


def test_run_batch_rows_may_be_lists_in_argument_order():
    @sgl.function
    def prog(s, a, b="-"):
        s += a + b

    states = prog.run_batch([["x", "y"], ("z",), {"a": "p", "b": "q"}], backend=Fake())
    assert [st.text() for st in states] == ["xy", "z-", "pq"]
    with pytest.raises(TypeError, match="1 to 2 arguments"):
        prog.run_batch([["a", "b", "c"]], backend=Fake())


def test_run_batch_generator_style_yields_states_in_order():
    @sgl.function
    def prog(s, n):
        s += f"{n}"

    states = prog.run_batch([{"n": n} for n in range(5)], backend=Fake(), generator_style=True)
    assert not isinstance(states, list)
    assert [st.text() for st in states] == ["0", "1", "2", "3", "4"]


def test_precache_with_tracing_can_be_turned_off():
    @sgl.function
    def prog(s, n):
        s += "Shared header. " + n + sgl.gen("a")

    on, off = Fake(), Fake()
    prog.run_batch([{"n": "1"}, {"n": "2"}], backend=on)
    sgl.global_config.enable_precache_with_tracing = False
    try:
        prog.run_batch([{"n": "1"}, {"n": "2"}], backend=off)
    finally:
        sgl.global_config.enable_precache_with_tracing = True
    prefills = [b["text"] for b in on.bodies if b["sampling_params"].get("max_new_tokens") == 0]
    assert prefills == ["Shared header. "]
    assert not [b for b in off.bodies if b["sampling_params"].get("max_new_tokens") == 0]


def test_use_thread_false_runs_in_the_callers_thread():
    backend = Fake()

    @sgl.function
    def prog(s):
        s += sgl.gen("a")

    prog.run(backend=backend, use_thread=False)
    assert backend.threads == [threading.current_thread()]
    prog.run(backend=backend)
    assert backend.threads[1] is not threading.current_thread()


# ---- threads ----------------------------------------------------------------------------------

def test_finished_states_release_their_threads():
    @sgl.function
    def prog(s, n):
        s += f"Row {n}: " + sgl.gen("a")
        forks = s.fork(2)
        forks += sgl.gen("b")
        forks.join()
        s += sgl.gen("c")

    before = threading.active_count()
    states = prog.run_batch([{"n": n} for n in range(200)], backend=Fake())
    assert all(st.success for st in states) and states[199]["b"] == ["ok", "ok"]
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]
    one = prog.run(n=1, backend=Fake())
    assert one["c"] == "ok" and threading.active_count() == before


# ---- backends, reasoning, what cannot exist here -------------------------------------------------

def test_flush_cache_and_get_server_info_use_the_default_backend():
    assert sgl.flush_cache() is False and sgl.get_server_info() is None  # no backend: as SGLang
    backend = Fake()
    sgl.set_default_backend(backend)
    try:
        assert sgl.flush_cache() is True and backend.flushed == 1
        assert sgl.get_server_info() == {"model_path": "fake"}
    finally:
        sgl.set_default_backend(None)
    assert sgl.get_server_info(backend) == {"model_path": "fake"}


@pytest.mark.parametrize("model_type,reply,answer,reasoning", [
    ("deepseek-r1", "<think>Paris is in France.</think>Paris", "Paris", "Paris is in France."),
    ("deepseek-r1", "No start tag.</think>Paris", "Paris", "No start tag."),  # R1 starts thinking unasked
    ("qwen3", "Paris", "Paris", ""),  # did not think
    ("qwen3", "<think>cut short", "", "cut short"),
    ("qwen3", "\n<think>a</think>Paris", "Paris", "a"),
    ("kimi", "◁think▷b◁/think▷Paris", "Paris", "b"),
])
def test_separate_reasoning_splits_the_gen(model_type, reply, answer, reasoning):
    @sgl.function
    def ask(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type=model_type))
        s += sgl.user("Thanks")

    state = ask.run(backend=Fake(lambda t: reply))
    assert state["answer"] == answer and state["answer_reasoning_content"] == reasoning
    assert state.text() == ("<|im_start|>user\nCapital of France?<|im_end|>\n"
                            f"<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n")
    assert state.messages()[1] == {"role": "assistant", "content": answer}


def test_separate_reasoning_outside_a_turn_and_with_two_gens():
    @sgl.function
    def two(s):
        s += "A: " + sgl.separate_reasoning(sgl.gen("a") + " / " + sgl.gen("b"), model_type="deepseek-r1")
        s += " end"

    replies = iter(["<think>x</think>1", "<think>yy</think>2"])
    state = two.run(backend=Fake(lambda t: next(replies)))
    assert state.text() == "A: 1 / 2 end"
    assert (state["a"], state["a_reasoning_content"], state["b"], state["b_reasoning_content"]) == ("1", "x", "2", "yy")


def test_separate_reasoning_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("a"))
    with pytest.raises(ValueError, match="not 'nope'"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="nope")
    with pytest.raises(ValueError, match="named"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_what_cannot_exist_here_says_so():
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.image("cat.png")
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.video("cat.mp4", 4)
    with pytest.raises(NotImplementedError, match="OpenAI"):
        sgl.Anthropic("claude")
    with pytest.raises(NotImplementedError, match="trace"):
        sgl.function(lambda s: None).trace()
    with pytest.raises(ValueError, match="unknown chat template"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", chat_template_name="nope")


# ---- against SGLang's own frontend ----------------------------------------------------------------

SIGNATURES = r"""
import inspect, json, sglang
from sglang.lang.interpreter import ProgramState, ProgramStateGroup
from sglang.lang.ir import SglFunction
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
def params(f):
    return [(p.name, p.kind.name) for p in inspect.signature(f).parameters.values()]
out = {name: params(getattr(sglang, name)) for name in (
    "gen", "gen_int", "gen_string", "select", "function", "separate_reasoning", "flush_cache", "get_server_info",
    "set_default_backend", "image", "video", "system", "user", "assistant")}
for cls, names in ((SglFunction, ("run", "run_batch", "bind", "trace", "cache")),
                   (ProgramState, ("get_var", "set_var", "get_meta_info", "text", "messages", "sync", "error", "fork",
                                   "copy", "var_scope", "user", "system", "assistant", "text_iter", "text_async_iter")),
                   (ProgramStateGroup, ("join",)), (RuntimeEndpoint, ("__init__",))):
    for n in names:
        out[f"{cls.__name__}.{n}"] = params(getattr(cls, n))[1:]
out["__all__"] = sglang.__all__
"""

OURS = {"SglFunction": sgl.Function, "ProgramState": sgl.ProgramState, "ProgramStateGroup": sgl.ForkGroup,
        "RuntimeEndpoint": sgl.RuntimeEndpoint}
NOT_LANGUAGE = {"Engine", "ServerArgs", "__version__"}  # the runtime's, not the language's


@pytest.fixture(scope="module")
def sglang_facts():
    """SGLang's signatures and its choices methods' decisions on CHOICE_CASES, from one run of its
    Python (importing sglang takes seconds)."""
    script = SIGNATURES + CHOICES_SCRIPT.replace("CASES", repr(json.dumps(CHOICE_CASES)))
    out = subprocess.run([SGLANG_PYTHON, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_sglang_name_and_parameter_exists_here_in_the_same_position(sglang_facts):
    import inspect

    from radixlm.lang.api import _TYPED_ORDER, SAMPLING_DEFAULTS

    theirs = dict(sglang_facts["signatures"])
    assert len(theirs) > 30
    missing = [name for name in theirs.pop("__all__") if name not in NOT_LANGUAGE and not hasattr(sgl, name)]
    assert not missing
    # gen_int / gen_string take *args, in SGLang's order
    for typed in ("gen_int", "gen_string"):
        assert [n for n, _ in theirs.pop(typed)] == ["name", *_TYPED_ORDER]
    for qualname, their_params in theirs.items():
        owner, _, attr = qualname.rpartition(".")
        ours = getattr(OURS[owner], attr) if owner else getattr(sgl, attr)
        our_params = list(inspect.signature(ours).parameters.values())[1 if owner else 0:]  # less self
        names = [p.name for p in our_params]
        kinds = {p.kind.name for p in our_params}
        for position, (name, kind) in enumerate(their_params):
            if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
                assert kind in kinds, (qualname, kind)
            elif name not in names:  # taken by **kwargs: run's sampling defaults
                assert "VAR_KEYWORD" in kinds and (attr not in ("run", "run_batch") or name in SAMPLING_DEFAULTS), \
                    (qualname, name)
            elif kind == "POSITIONAL_OR_KEYWORD":
                assert names.index(name) == position, (qualname, name, names)


CHOICES_SCRIPT = r"""
from sglang.lang import choices as c
decisions = []
for choices, cond, plain in json.loads(CASES):
    inputs = [[[x, 0, "t"] for x in row] for row in cond]
    case = {}
    for name in ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"):
        d = getattr(c, name)(choices=choices, normalized_prompt_logprobs=[sum(r) / len(r) for r in cond],
                             input_token_logprobs=inputs, output_token_logprobs=[[] for _ in choices],
                             unconditional_token_logprobs=[[[x, 0, "t"] for x in row] for row in plain])
        case[name] = [d.decision, d.meta_info]
    decisions.append(case)
print(json.dumps({"signatures": out, "choices": decisions}))
"""
CHOICE_CASES = [
    (CHOICES, CONDITIONAL, UNCONDITIONAL),
    (["yes", "no", "maybe"], [[-0.2, -3.0], [-0.2, -0.1], [-0.2, -0.1, -0.05]], [[-1, -1], [-2, -2], [-1, -1, -1]]),
    (["x", "y"], [[-0.7], [-0.7]], [[-0.1], [-0.3]]),  # ties: the first wins in both
]


@pytest.mark.parametrize("index", range(len(CHOICE_CASES)))
def test_choices_methods_decide_as_sglangs(sglang_facts, index):
    choices, cond, plain = CHOICE_CASES[index]
    inputs = [[[x, 0, "t"] for x in row] for row in cond]
    for name, (decision, meta) in sglang_facts["choices"][index].items():
        ours = getattr(sgl, name)(choices=choices, normalized_prompt_logprobs=[sum(r) / len(r) for r in cond],
                                  input_token_logprobs=inputs, output_token_logprobs=[[] for _ in choices],
                                  unconditional_token_logprobs=[[[x, 0, "t"] for x in row] for row in plain])
        assert ours.decision == decision, name
        assert set(ours.meta_info) == set(meta), name
        for key, value in meta.items():
            assert _close(json.loads(json.dumps(ours.meta_info[key])), value), (name, key)


def _close(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, abs=1e-9)
    return a == b
