"""`choices`: pick one of several continuations by scoring each with prompt logprobs.

Every choice becomes a prefill-only request (prompt + choice, max_new_tokens 0)
that returns the logprobs of the choice's tokens; the requests share the
prompt through the radix cache. The scores are combined by one of SGLang's three
methods, written once here and used by both the server's `choices` request and
the language's `select` (radixlm.lang.choices re-exports them).

A method is called with keyword arguments (SGLang's interface, so a program's own
method works too) and returns a `ChoicesDecision`: the chosen text and the
meta info that `s.get_meta_info(name)` reports. Every entry of a token list is
`[logprob, token_id, token_text]`; the methods read only the logprob.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the method also needs each choice's logprobs without the prompt."""
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[Any]], output_token_logprobs: list[list[Any]],
                 unconditional_token_logprobs: list[list[Any]] | None = None) -> ChoicesDecision:
        """Pick one of `choices`."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _logprobs(tokens: list[Any]) -> list[float]:
    return [t[0] for t in tokens]


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _common_meta(normalized: list[float], inputs: list[list[Any]], outputs: list[list[Any]]) -> dict[str, Any]:
    return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
            "output_token_logprobs": outputs}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The highest mean logprob per token."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        return ChoicesDecision(choices[_argmax(normalized_prompt_logprobs)],
                               _common_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token, keep the choices with the highest logprob at that position, until one is
    left. A choice shorter than the longest continues with its own mean logprob, so that a
    choice that is a prefix of another can still be compared with it."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix = []
        for tokens in input_token_logprobs:
            row = _logprobs(tokens)
            matrix.append(row + [_mean(row)] * (width - len(row)))
        remaining = list(range(len(choices)))
        for column in range(width):
            best = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == best]
            if len(remaining) == 1:
                break
        meta = _common_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest mean logprob given the prompt minus the mean logprob without it: how much the
    prompt raises the choice above its prior likelihood."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        # a missing (None) logprob, as for a first token without context, counts as 0
        lifted = [_mean(_logprobs(cond)) - _mean([x or 0.0 for x in _logprobs(plain)])
                  for cond, plain in zip(input_token_logprobs, unconditional_token_logprobs)]
        meta = _common_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta.update(unconditional_token_logprobs=unconditional_token_logprobs,
                    normalized_unconditional_prompt_logprobs=lifted)
        return ChoicesDecision(choices[_argmax(lifted)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
greedy_token = greedy_token_selection  # radixlm's earlier name

# radixlm's earlier string names (still accepted) -> the methods
BY_NAME: dict[str, ChoicesSamplingMethod] = {
    "token_length_normalized": token_length_normalized,
    "greedy_token": greedy_token_selection,
    "greedy_token_selection": greedy_token_selection,
    "unconditional_likelihood_normalized": unconditional_likelihood_normalized,
}


def as_method(method: Any) -> Any:
    """A choices method from an object with SGLang's call interface, or one of the names above."""
    if isinstance(method, str):
        try:
            return BY_NAME[method]
        except KeyError:
            raise ValueError(f"unknown choices_method {method!r}; known: {', '.join(BY_NAME)}") from None
    if not callable(method):
        raise TypeError(f"choices_method must be a ChoicesSamplingMethod (e.g. token_length_normalized), "
                        f"not {type(method).__name__}")
    return method


METHODS = tuple(BY_NAME)


@dataclass
class ChoiceGroup:
    """The scoring requests of one `choices` request, until all have answered."""

    rid: str
    client: bytes
    choices: list[str]
    method: str  # a name in BY_NAME
    boundaries: list[int]  # where each choice's tokens start in its request
    conditional: list[list[list[Any]] | None] = field(default_factory=list)  # [logprob, id, text] a token
    unconditional: list[list[list[Any]] | None] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.conditional = [None] * len(self.choices)
        needs_plain = BY_NAME[self.method].requires_unconditional_logprobs
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


def result_meta(group: ChoiceGroup) -> tuple[int, dict[str, Any]]:
    """The selected index (by the group's method) and the meta_info that reports every choice's
    score: the one it was ranked by, as `normalized_scores`."""
    normalized = [_mean(_logprobs(tokens)) for tokens in group.conditional]
    decision = BY_NAME[group.method](choices=group.choices, normalized_prompt_logprobs=normalized,
                                     input_token_logprobs=group.conditional,
                                     output_token_logprobs=[[] for _ in group.choices],
                                     unconditional_token_logprobs=group.unconditional or None)
    extra = decision.meta_info or {}
    best = group.choices.index(decision.decision)
    return best, {
        "choices": group.choices,
        "selected_index": best,
        "normalized_scores": extra.get("normalized_unconditional_prompt_logprobs", normalized),
        "choice_token_logprobs": [_logprobs(tokens) for tokens in group.conditional],
        "method": group.method,
        **({"greedy_logprob_matrix": extra["greedy_logprob_matrix"]} if "greedy_logprob_matrix" in extra else {}),
        **({"unconditional_token_logprobs": [_logprobs(t) for t in group.unconditional]} if group.unconditional else {}),
    }
