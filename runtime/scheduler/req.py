"""A request as the scheduler sees it: lengths say where it stands."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from radixlm.runtime.messages import TokenizedRequest
from radixlm.runtime.worker.draft_model import DRAFT_PENDING


class FinishKind(Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"


@dataclass(frozen=True)
class Finish:
    kind: FinishKind
    detail: Any = None  # matched token id / stop string; length; abort message
    status: int | None = None  # set when the request was refused (400: its own fault)

    def to_dict(self) -> dict[str, Any]:
        key = {FinishKind.STOP: "matched", FinishKind.LENGTH: "length", FinishKind.ABORT: "message"}[self.kind]
        out = {"type": self.kind.value, key: self.detail}
        if self.status is not None:
            out["status"] = self.status
        return out


class Req:
    """One request in the scheduler.

    Positions [0, prefix_len) share KV with the prefix cache (locked at `node`);
    positions [prefix_len, cached_len) have KV in pages this request owns; the
    tokens from cached_len to seq_len are what the next forward pass must feed.
    Prefill, a prefill chunk, decode and re-prefill after retraction are all
    that one rule.
    """

    def __init__(self, tr: TokenizedRequest, arrival: int) -> None:
        self.rid = tr.rid
        self.prompt_ids = list(tr.input_ids)
        self.params = tr.sampling_params
        self.output_ids: list[int] = []
        self.arrival = arrival
        self.return_logprob = tr.return_logprob
        self.top_logprobs_num = tr.top_logprobs_num
        self.logprob_start_len = tr.logprob_start_len
        self.embed = tr.embed  # "last" / "mean": an embedding request (no output)
        self.lora: str | None = None  # its LoRA adapter's name (None: the base model), set by the scheduler
        # its prefixes' keys in the radix cache: a LoRA request's tokens moved to a range of their
        # own per adapter (KVManager.lora_namespace), so no prefix is shared across adapters
        self.key_offset = 0
        self.embed_sum: Any = None  # its pooled hidden states so far (a tensor), and how many
        self.embed_count = 0
        self.row: int | None = None
        self.prefix_len = 0
        self.cached_len = 0
        self.window_dropped = 0  # its own pages below this position have given their window pages back
        self.node: Any = None
        self.cached_tokens = 0  # prefix-cache hits reported to the client
        self.finish: Finish | None = None
        self.sent_len = 0  # output tokens already reported
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        # prompt logprobs, filled while prefilling; None until wanted
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
        self.input_ranks: list[int | None] | None = None
        self.input_logprobs_sent = False
        if self.wants_input_logprobs and self.prompt_len == 1:  # position 0 alone: no logprob, nothing to compute
            self.input_logprobs, self.input_top_logprobs, self.input_ranks = [None], [None], [None]
        self.grammar_key: tuple[str, str] | None = None  # constraint, while its index compiles
        self.grammar: Any = None  # its compiled Grammar, once ready
        self.guide: Any = None  # its constrained.backend.Matcher: its place in the constraint
        self.reasoning_end_ids = tr.reasoning_end_ids  # the guide waits for these (reasoning_gate.py)
        self.replaced = 0  # already reported output tokens that jump-forward re-encoded, to report
        self.penalty_counted = 0  # output tokens in its row of the kept penalty counts (-1: rebuild)
        # overlap scheduling (overlap.py)
        self.in_flight = 0  # launched steps that hold it and have not been taken back yet
        self.awaiting = False  # its last output token is a placeholder for a step still running
        self.drop_kv = False  # failed while a step held it: its own KV is freed, not cached, on release
        # speculative decoding (speculation.py)
        self.draft: list[int] = []  # tokens proposed after its last one, checked by this step
        self.spec_index: Any = None  # its n-gram index (cache/continuations.NgramIndex), made on first use
        self.spec_acceptance: Any = None  # speculation.Acceptance, made on first use
        self.spec_idle = 0  # steps since its last probe, while its proposals do not pay
        self.spec_verify_ct = self.spec_proposed = self.spec_accepted = 0

    @property
    def drafts_pending(self) -> bool:
        """Its drafts are placeholders the draft model fills in this step (worker/draft_model.py)."""
        return bool(self.draft) and self.draft[0] == DRAFT_PENDING

    def outputs_rewritten(self) -> None:
        """Its output tokens changed in place (jump-forward re-encoded them): what was counted or
        indexed from them is rebuilt."""
        self.penalty_counted = -1
        self.spec_index = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.cached_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < self.prompt_len

    @property
    def input_logprobs_done(self) -> bool:
        # position 0 has no logprob but holds a None, so the list always ends at prompt_len
        got = len(self.input_logprobs) if self.input_logprobs is not None else 0
        return got == self.prompt_len - max(self.logprob_start_len, 0)

    def token_at(self, position: int) -> int:
        n = self.prompt_len
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = self.prompt_len
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n]

    def cache_key(self, start: int, end: int) -> list[int]:
        """`tokens(start, end)` as the radix cache keys them (`key_offset`)."""
        tokens = self.tokens(start, end)
        return tokens if not self.key_offset else [t + self.key_offset for t in tokens]

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, cached={self.cached_len})"

