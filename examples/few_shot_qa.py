"""Few-shot question answering: `select` over a few-shot prefix that every question shares.

run_batch traces the program, sees that the few-shot examples come before the
first argument, and prefills them once; every question then starts from the
cache (see cached_tokens).
"""

from __future__ import annotations

import radixlm as rl

EXAMPLES = [
    ("Which is a fruit: carrot or apple?", "apple"),
    ("Which is an animal: dog or chair?", "dog"),
    ("Which is a colour: blue or table?", "blue"),
]
QUESTIONS = [
    ("Which is a planet: Mars or spoon?", ["Mars", "spoon"]),
    ("Which is a drink: water or stone?", ["water", "stone"]),
    ("Which is a number: seven or cloud?", ["seven", "cloud"]),
    ("Which is a tool: hammer or banana?", ["hammer", "banana"]),
]


@rl.function
def few_shot(s, question, options):
    s += "Answer each question with one of the two words it offers.\n\n"
    for q, a in EXAMPLES:
        s += f"Question: {q}\nAnswer: {a}\n\n"
    s += f"Question: {question}\nAnswer: " + rl.select("answer", options)


def main(backend: rl.Backend) -> list[dict]:
    states = few_shot.run_batch([{"question": q, "options": o} for q, o in QUESTIONS], backend=backend)
    rows = []
    for (question, _), state in zip(QUESTIONS, states):
        meta = state.get_meta_info("answer")
        rows.append({"question": question, "answer": state["answer"], "scores": meta["normalized_scores"]})
        print(f"{question:<40} -> {state['answer']:<8} scores {[round(x, 2) for x in meta['normalized_scores']]}")
    return rows


if __name__ == "__main__":
    from _backend import backend_from_args

    main(backend_from_args(__doc__.splitlines()[0]))
