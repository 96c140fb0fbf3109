"""Six SGLang programs written once, for any module with SGLang's frontend language: `programs(sgl)`
takes `sglang` or `radixlm` (`import radixlm as sgl`) and returns them, each with a way to run it
that gives a plain, comparable result (greedy, so the two frontends must agree on one server).

    import radixlm as sgl                      # or: import sglang as sgl
    from sglang_programs import backend, programs
    results = {name: p.run(backend(sgl, url)) for name, p in programs(sgl).items()}

Both frontends are given the chatml template by name (SGLang's RuntimeEndpoint does not read the
model's), so both write the same text. Only what the two languages share is used here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

NAMES = ("gen", "select", "regex", "fork", "multi_turn", "run_batch")
YEAR = r"(1[5-9]|20)[0-9]{2}"
CAPITALS = ["France", "Japan", "Italy"]


class Program(NamedTuple):
    function: Any  # the @sgl.function
    run: Callable[[Any], dict[str, Any]]  # backend -> a JSON-able result


def backend(sgl: Any, url: str) -> Any:
    return sgl.RuntimeEndpoint(url, chat_template_name="chatml")


def programs(sgl: Any) -> dict[str, Program]:
    @sgl.function
    def completion(s, subject):
        s += f"The capital of {subject} is"
        s += sgl.gen("answer", max_tokens=12, stop="\n")

    @sgl.function
    def choose(s):
        s += sgl.user("What is the capital of France? Answer with one word.")
        s += sgl.assistant(sgl.select("city", choices=["Paris", "Banana", "Seventeen"]))

    @sgl.function
    def year(s):
        s += sgl.user("In which year did the first person walk on the Moon?")
        s += sgl.assistant(sgl.gen("year", max_tokens=8, regex=YEAR))

    @sgl.function
    def branches(s):
        s += "Here are two ideas for a weekend, one line each.\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=10, stop="\n")
        forks.join()  # SGLang's default: the branches' new variables become lists in the parent

    @sgl.function
    def conversation(s, question):
        s += sgl.system("You are a helpful assistant. Answer briefly.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("first", max_tokens=16))
        s += sgl.user("Say it again in other words.")
        s += sgl.assistant(sgl.gen("second", max_tokens=16))

    def run_completion(b):
        st = completion.run(subject="France", backend=b, temperature=0)
        return {"answer": st["answer"], "text": st.text()}

    def run_choose(b):
        st = choose.run(backend=b, temperature=0)
        return {"city": st["city"], "text": st.text()}

    def run_year(b):
        st = year.run(backend=b, temperature=0)
        return {"year": st["year"], "text": st.text()}

    def run_branches(b):
        st = branches.run(backend=b, temperature=0)
        return {"ideas": st["idea"], "text": st.text()}

    def run_conversation(b):
        st = conversation.run(question="What colour is the sky on a clear day?", backend=b, temperature=0)
        return {"first": st["first"], "second": st["second"], "messages": st.messages(), "text": st.text()}

    def run_rows(b):
        states = completion.run_batch([{"subject": c} for c in CAPITALS], backend=b, temperature=0)
        return {"answers": [st["answer"] for st in states]}

    return {
        "gen": Program(completion, run_completion),
        "select": Program(choose, run_choose),
        "regex": Program(year, run_year),
        "fork": Program(branches, run_branches),
        "multi_turn": Program(conversation, run_conversation),
        "run_batch": Program(completion, run_rows),
    }
