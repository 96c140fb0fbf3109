"""Messages between the runtime's parts, grouped by who receives them.

Plain dataclasses of plain values, so that they can cross a socket as orjson
(never pickle) once the parts live in separate processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.sampling_params import SamplingParams

# ---- to the scheduler --------------------------------------------------------------------------


@dataclass
class TokenizedRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned (-1: none)
    top_logprobs_num: int = 0


@dataclass
class AbortRequest:
    rid: str


# ---- from the scheduler ------------------------------------------------------------------------


@dataclass
class TokenOutput:
    """What one step produced for one request: new tokens since the last output, and the end if it came."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched"/"length"/"message": ...}
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # prompt logprobs come once, with the first output after the prefill
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
