"""Tree of thought with `fork`: several next steps are sampled side by side, each is judged
by the model, and the best one is kept and expanded."""

from __future__ import annotations

import radixlm as rl


@rl.function
def tree_of_thought(s, question, width=3, depth=2):
    s += rl.user(question + " Reason in short steps.")
    s += rl.assistant_begin()
    chosen = []
    for level in range(depth):
        forks = s.fork(width)  # the text so far is prefilled once; every branch reuses it
        for i, branch in enumerate(forks):
            branch += f"Step {level + 1}: " + rl.gen("step", max_tokens=24, regex=r"[A-Z0-9][^\n]{4,100}",
                                                     temperature=0.9, seed=100 * level + i)
            branch += "\nIs this step correct and useful? " + rl.select("judge", ["yes", "no"])
        forks.join()
        scores = [b.get_meta_info("judge")["normalized_scores"] for b in forks]
        best = max(range(width), key=lambda i: scores[i][0] - scores[i][1])  # yes minus no
        chosen.append({"candidates": [b["step"] for b in forks], "best": best})
        s += f"Step {level + 1}: {forks[best]['step']}\n"
    s += "Answer: " + rl.gen("answer", max_tokens=24, stop=["\n"], temperature=0)
    s += rl.assistant_end()
    s.set_var("levels", chosen)


def main(backend: rl.Backend) -> dict:
    state = tree_of_thought.run(question="A farmer has 3 pens with 4 sheep each. How many sheep?", backend=backend)
    for n, level in enumerate(state["levels"], 1):
        for i, step in enumerate(level["candidates"]):
            print(f"level {n} {'*' if i == level['best'] else ' '} {step}")
    print("answer:", state["answer"])
    return {"levels": state["levels"], "answer": state["answer"]}


if __name__ == "__main__":
    from _backend import backend_from_args

    main(backend_from_args(__doc__.splitlines()[0]))
