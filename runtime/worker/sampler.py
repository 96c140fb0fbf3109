"""Batched next-token sampling over a ``[B, V]`` logits tensor.

One step runs: raw logits -> repetition penalty (prompt + output tokens) ->
frequency / presence penalties (output tokens) -> logit bias -> min-new-tokens
blocking -> greedy rows take the argmax; sampled rows divide by temperature,
softmax, apply top-k, top-p, min-p and draw with an exponential race.

Every per-row setting is one tensor per field per step (``SamplingBatch``), so
the hot path has no per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple, Sequence

import torch

from runtime.sampling_params import SamplingParams

# Below this the softmax of logits / T overflows float32; T -> 0 is argmax anyway.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for B rows, made by ``build``.

    Optional tensors are ``None`` when no row of the batch uses the feature,
    so the sampler skips that work entirely. Rows that do not use a built
    feature carry its neutral value (penalty 1 / 0, bias 0, no tokens).
    """

    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows, which never divide
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; vocab_size where top-k is off
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    repetition_penalties: torch.Tensor | None  # [B, 1]
    seen_mask: torch.Tensor | None  # [B, V] bool: token occurs in prompt + output
    frequency_penalties: torch.Tensor | None  # [B, 1]
    presence_penalties: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in output
    logit_bias: torch.Tensor | None  # [B, V] float32
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) -> -inf
    seeded_rows: list[int]  # sampled rows whose request has a seed
    step_seeds: list[int]  # per seeded row: its seed mixed with len(output_ids)
    grammar_mask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed-token bits (constrained rows)

    @property
    def needs_processing(self) -> bool:
        return (
            self.seen_mask is not None
            or self.output_counts is not None
            or self.logit_bias is not None
            or self.min_tokens_block is not None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather row settings into tensors on ``device``; params must be validated."""
        assert len(params) == len(prompt_ids) == len(output_ids)
        greedy = [p.is_greedy or p.temperature < _MIN_TEMPERATURE for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        rep_penalties, seen = _repetition_tensors(params, prompt_ids, output_ids, vocab_size, device)
        freq, pres, counts = _frequency_presence_tensors(params, output_ids, vocab_size, device)
        seeded = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
        return cls(
            temperatures=_column([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor([_top_k_or_all(p, vocab_size) for p in params], device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_p=any(p.top_p < 1 for p in sampled),
            need_top_k=any(_top_k_or_all(p, vocab_size) < vocab_size for p in sampled),
            need_min_p=any(p.min_p > 0 for p in sampled),
            repetition_penalties=rep_penalties,
            seen_mask=seen,
            frequency_penalties=freq,
            presence_penalties=pres,
            output_counts=counts,
            logit_bias=_logit_bias_tensor(params, vocab_size, device),
            min_tokens_block=_min_tokens_block(params, output_ids, eos_token_ids, device),
            seeded_rows=seeded,
            step_seeds=[_step_seed(params[i].seed, len(output_ids[i])) for i in seeded],
        )


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    # Log-probability of the chosen token under log_softmax(raw logits), i.e.
    # the model's distribution before penalties and temperature.
    logprobs: torch.Tensor | None  # [B] float32
    top_logprobs: torch.Tensor | None  # [B, K] float32, K = top_logprobs_num
    top_logprob_ids: torch.Tensor | None  # [B, K] int64


class Sampler:
    """Chooses the next token of every row; stateless, so one instance serves all steps."""

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        logits = logits.float()  # no-op for the float32 the model runner hands us
        processed = apply_logit_processors(logits, batch)
        if batch.all_greedy:
            next_ids = processed.argmax(dim=-1)
        else:
            next_ids = _sample(processed, batch)
        return _with_logprobs(logits, next_ids, return_logprob, top_logprobs_num)


def apply_logit_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit bias and min-new-tokens blocking, in that order.

    Never modifies ``logits``: returns it unchanged when nothing applies,
    otherwise a new tensor.
    """
    out = logits
    if batch.seen_mask is not None:
        rp = batch.repetition_penalties
        out = torch.where(batch.seen_mask, torch.where(out > 0, out / rp, out * rp), out)
    if batch.output_counts is not None:
        counts = batch.output_counts
        out = out - counts * batch.frequency_penalties - (counts > 0) * batch.presence_penalties
    if batch.logit_bias is not None:
        out = out + batch.logit_bias
    if batch.min_tokens_block is not None:
        minus_inf = torch.tensor(float("-inf"), device=out.device)
        out = out.index_put(batch.min_tokens_block, minus_inf)
    return out


def filter_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p exclude; not renormalised.

    top-p is measured against the mass left after top-k (HF / vLLM order);
    min-p is relative to the largest probability, which every filter keeps.
    """
    if batch.need_top_k or batch.need_top_p:
        probs = _top_k_top_p(probs, batch)
    if batch.need_min_p:
        floor = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    probs = torch.softmax(logits / batch.temperatures, dim=-1)
    probs = filter_probs(probs, batch)
    # Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks index i with
    # probability p_i / sum(p). It is scale-invariant, so no renormalisation,
    # and the whole batch needs a single noise tensor.
    sampled = (probs / _exponential_noise(probs, batch)).argmax(dim=-1)
    if not batch.any_greedy:
        return sampled
    return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)


def _top_k_top_p(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if batch.need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(ranks >= batch.top_ks[:, None], 0.0)
    if batch.need_top_p:
        cumulative = sorted_probs.cumsum(dim=-1)
        mass_before = cumulative - sorted_probs
        top_ps = batch.top_ps[:, None]
        # Keep tokens while the mass before them is under top_p of the kept
        # mass; the top token (mass_before = 0) always survives. Rows with
        # top_p = 1 are exempt so rounding in the cumsum cannot drop a tail.
        drop = (mass_before >= top_ps * cumulative[:, -1:]) & (top_ps < 1)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exp(1) noise; seeded rows draw theirs from a generator of their own.

    A seeded row's noise depends only on (seed, output length), so the request
    samples the same tokens whatever batch it is in and wherever it sits.
    """
    noise = torch.empty_like(probs).exponential_()
    for row, seed in zip(batch.seeded_rows, batch.step_seeds):
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(seed)
        noise[row].exponential_(generator=generator)
    # NOTE: some backends can return exactly 0; p / 0 would win every race.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _with_logprobs(
    raw_logits: torch.Tensor, next_ids: torch.Tensor, return_logprob: bool, top_logprobs_num: int
) -> SampleOutput:
    if not return_logprob and top_logprobs_num <= 0:
        return SampleOutput(next_ids, None, None, None)
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1) if return_logprob else None
    if top_logprobs_num <= 0:
        return SampleOutput(next_ids, chosen, None, None)
    top = logprobs.topk(min(top_logprobs_num, logprobs.shape[-1]), dim=-1)
    return SampleOutput(next_ids, chosen, top.values, top.indices)


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _top_k_or_all(p: SamplingParams, vocab_size: int) -> int:
    return vocab_size if p.top_k < 1 else min(p.top_k, vocab_size)


def _token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``[B, V]`` float32 occurrence counts of each row's token ids."""
    # One flat index_put over all rows' ids; unlike a padded [B, Lmax] layout
    # one long prompt costs no padding in the others.
    lengths = torch.tensor([len(r) for r in rows], device=device)
    row_index = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    token_index = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64, device=device)
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(token_index.shape, dtype=torch.float32, device=device)
    return counts.index_put_((row_index, token_index), ones, accumulate=True)


def _repetition_tensors(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(p.repetition_penalty == 1.0 for p in params):
        return None, None
    rows = [
        [*prompt, *output] if p.repetition_penalty != 1.0 else []
        for p, prompt, output in zip(params, prompt_ids, output_ids)
    ]
    seen = _token_counts(rows, vocab_size, device) > 0
    return _column([p.repetition_penalty for p in params], device), seen


def _frequency_presence_tensors(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    uses = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(uses):
        return None, None, None
    rows = [output if use else [] for output, use in zip(output_ids, uses)]
    return (
        _column([p.frequency_penalty for p in params], device),
        _column([p.presence_penalty for p in params], device),
        _token_counts(rows, vocab_size, device),
    )


def _logit_bias_tensor(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    if not any(p.logit_bias for p in params):
        return None
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return bias.index_put_(index, torch.tensor(values, dtype=torch.float32, device=device))


def _min_tokens_block(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of every stop token a row may not emit yet.

    ``ignore_eos`` does not lift this: it only changes the stop check.
    """
    rows, cols = [], []
    for i, (p, output) in enumerate(zip(params, output_ids)):
        if len(output) < p.min_new_tokens:
            blocked = set(eos_token_ids) | set(p.stop_token_ids)
            rows.extend([i] * len(blocked))
            cols.extend(blocked)
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(cols, device=device)


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: spreads nearby integers over all 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_seed(seed: int, step: int) -> int:
    """Generator seed for a request's ``step``-th token; (seed, step) pairs do not alias."""
    return _mix64((_mix64(seed & _MASK64) + step) & _MASK64)
