"""A chat session whose turns reuse the cached history: each turn's cached_tokens grows."""

from __future__ import annotations

import radixlm as rl

TURNS = ["Hi! My name is Ada and I like astronomy.", "What is my name?", "Suggest one thing to look at in the sky tonight."]


@rl.function
def session(s, turns):
    for i, turn in enumerate(turns):
        s += rl.user(turn)
        s += rl.assistant(rl.gen(f"reply{i}", max_tokens=40, temperature=0))


def main(backend: rl.Backend) -> list[dict]:
    state = session.run(turns=TURNS, backend=backend)
    rows = []
    for i, turn in enumerate(TURNS):
        meta = state.get_meta_info(f"reply{i}")
        rows.append({"prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"]})
        print(f"user: {turn}\nassistant: {state[f'reply{i}']}\n"
              f"  [{meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} from the cache]")
    return rows


if __name__ == "__main__":
    from _backend import backend_from_args

    main(backend_from_args(__doc__.splitlines()[0]))
