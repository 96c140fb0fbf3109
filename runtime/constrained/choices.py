"""`choices`: pick one of several continuations by scoring each with prompt logprobs.

Every choice becomes a prefill-only request (prompt + choice, max_new_tokens 0)
that returns the logprobs of the choice's tokens; the requests share the
prompt through the radix cache. The scores are combined by one of the methods
SGLang offers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

METHODS = ("token_length_normalized", "greedy_token", "unconditional_likelihood_normalized")


@dataclass
class ChoiceGroup:
    """The scoring requests of one `choices` request, until all have answered."""

    rid: str
    client: bytes
    choices: list[str]
    method: str
    boundaries: list[int]  # where each choice's tokens start in its request
    conditional: list[list[float] | None] = field(default_factory=list)
    unconditional: list[list[float] | None] = field(default_factory=list)
    greedy_runs: list[int] = field(default_factory=list)  # leading choice tokens that were the argmax
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.conditional = [None] * len(self.choices)
        self.greedy_runs = [0] * len(self.choices)
        needs_plain = self.method == "unconditional_likelihood_normalized"
        self.unconditional = [None] * len(self.choices) if needs_plain else []

    @property
    def complete(self) -> bool:
        return all(x is not None for x in self.conditional + self.unconditional)


def choice_boundary(prompt_ids: Sequence[int], full_ids: Sequence[int]) -> int:
    """First position of the choice's tokens in prompt+choice: where the two tokenizations part
    (the tokenizer may merge the prompt's last token with the choice's first), at least 1."""
    n = 0
    for a, b in zip(prompt_ids, full_ids):
        if a != b:
            break
        n += 1
    return max(min(n, len(full_ids) - 1), 1)


def greedy_run(token_logprobs: Sequence[Sequence[Any]], top1: Sequence[Sequence[Sequence[Any]] | None]) -> int:
    """How many of the choice's first tokens are each the model's top-1 token at their position."""
    run = 0
    for (_, token), top in zip(token_logprobs, top1):
        if not top or top[0][1] != token:
            break
        run += 1
    return run


def scores(group: ChoiceGroup) -> list[float]:
    """Higher is better. Mean logprob of the choice's tokens given the prompt; for the
    unconditional method, minus their mean logprob without the prompt; for greedy_token,
    the mean logprob (the selection ranks by greedy run first)."""
    cond = [sum(lps) / len(lps) for lps in group.conditional]
    if group.method != "unconditional_likelihood_normalized":
        return cond
    return [c - sum(u) / len(u) for c, u in zip(cond, group.unconditional)]


def result_meta(group: ChoiceGroup) -> tuple[int, dict[str, Any]]:
    """The selected index and the meta_info that reports every choice's score.

    greedy_token picks the choice that greedy decoding follows furthest (ties: higher mean logprob)."""
    s = scores(group)
    if group.method == "greedy_token":
        best = max(range(len(s)), key=lambda i: (group.greedy_runs[i], s[i]))
    else:
        best = max(range(len(s)), key=s.__getitem__)
    return best, {
        "choices": group.choices,
        "selected_index": best,
        "normalized_scores": s,
        "choice_token_logprobs": group.conditional,
        "method": group.method,
        **({"greedy_runs": group.greedy_runs} if group.method == "greedy_token" else {}),
        **({"unconditional_token_logprobs": group.unconditional} if group.unconditional else {}),
    }
