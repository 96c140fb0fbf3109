"""Batched next-token sampling over a ``[B, V]`` logits tensor.

One step runs: raw logits -> the grammar mask (constrained rows' disallowed
tokens to -inf, in place; token_mask.py) -> repetition penalty (prompt +
output tokens) -> frequency / presence penalties (output tokens) -> logit bias
-> min-new-tokens blocking -> greedy rows take the argmax; sampled rows divide
by temperature, softmax, apply top-k, top-p, min-p and draw with an
exponential race. Logprobs are of the masked logits.

Every per-row setting is one tensor per field per step (``SamplingBatch``), so
the hot path has no per-token Python loops. Top-k takes the batch's largest k
with ``topk`` instead of sorting the vocabulary; when every sampled row has a
top-k the race runs over those candidates alone. Seeded rows draw their noise
from a counter-based hash of (seed, step, token id), all in one batched call.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.token_mask import apply_bitmask
from radixlm.runtime.worker.staging import to_device

# Below this the softmax of logits / T overflows float32; T -> 0 is argmax anyway.
_MIN_TEMPERATURE = 1e-5


def _int64(value: int) -> int:
    """``value`` mod 2^64 as the signed int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


# SplitMix64's increment and multipliers, as the int64s torch computes with.
_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for B rows, made by ``build``: the sampler's input, part of the
    ``WorkerBatch`` the scheduler hands the worker (the scheduler builds it; it never reaches
    tensor-parallel followers, since only rank 0 samples).

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
    max_top_k: int  # largest top-k of the sampled rows that use one; 0 if none does
    all_top_k: bool  # every sampled row uses top-k: only the max_top_k best tokens can be drawn
    need_full_sort: bool  # a sampled row uses top-p without top-k
    repetition_penalties: torch.Tensor | None  # [B, 1]
    seen_mask: torch.Tensor | None  # [B, V] bool: token occurs in prompt + output
    frequency_penalties: torch.Tensor | None  # [B, 1]
    presence_penalties: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in output
    logit_bias: torch.Tensor | None  # [B, V] float32
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) -> -inf
    seeded_rows: torch.Tensor | None  # [S] int64: sampled rows whose request has a seed
    step_seeds: torch.Tensor | None  # [S] int64: per seeded row, its seed mixed with len(output_ids)
    grammar_mask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed-token bits (token_mask.py), applied first

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
        counts: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_lens: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Gather row settings into tensors on ``device``; params must be validated. ``counts``:
        the rows' (seen, output counts) kept across steps (``PenaltyCounts.gather``), instead of
        counting the ids here; rows without penalties may hold anything there. ``output_lens``:
        the output length each row samples at (seed step, min-new-tokens), when not
        ``len(output_ids)``: a speculative verify samples a request at several lengths."""
        assert len(params) == len(prompt_ids) == len(output_ids)
        if output_lens is None:
            output_lens = [len(ids) for ids in output_ids]
        greedy = [p.is_greedy or p.temperature < _MIN_TEMPERATURE for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        sampled_top_ks = [_top_k_or_all(p, vocab_size) for p in sampled]
        rep_penalties, seen = _repetition_tensors(params, prompt_ids, output_ids, vocab_size, device,
                                                  counts[0] if counts else None)
        freq, pres, output_counts = _frequency_presence_tensors(params, output_ids, vocab_size, device,
                                                                counts[1] if counts else None)
        seeded_rows, step_seeds = _seed_tensors(params, greedy, output_lens, device)
        return cls(
            temperatures=_column([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            top_ps=to_device([p.top_p for p in params], torch.float32, device),
            top_ks=to_device([_top_k_or_all(p, vocab_size) for p in params], torch.int64, device),
            min_ps=to_device([p.min_p for p in params], torch.float32, device),
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_p=any(p.top_p < 1 for p in sampled),
            need_top_k=any(k < vocab_size for k in sampled_top_ks),
            need_min_p=any(p.min_p > 0 for p in sampled),
            max_top_k=max((k for k in sampled_top_ks if k < vocab_size), default=0),
            all_top_k=bool(sampled) and all(k < vocab_size for k in sampled_top_ks),
            need_full_sort=any(p.top_p < 1 and k == vocab_size for p, k in zip(sampled, sampled_top_ks)),
            repetition_penalties=rep_penalties,
            seen_mask=seen,
            frequency_penalties=freq,
            presence_penalties=pres,
            output_counts=output_counts,
            logit_bias=_logit_bias_tensor(params, vocab_size, device),
            min_tokens_block=_min_tokens_block(params, output_lens, eos_token_ids, device),
            seeded_rows=seeded_rows,
            step_seeds=step_seeds,
        )


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    # Log-probability of the chosen token under log_softmax(raw logits after the
    # grammar mask), i.e. the model's distribution before penalties and temperature
    # (constrained rows': the masked distribution).
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
        if batch.grammar_mask is not None:
            # NOTE: first and in place (on the caller's tensor when it is float32): constrained rows'
            # logprobs then describe the masked distribution
            apply_bitmask(logits, batch.grammar_mask)
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
    Only a top-p row without top-k costs a sort of the vocabulary; top-k takes
    the batch's largest k with ``topk``. Ties at a row's k-th probability are
    broken arbitrarily either way, as by any unstable sort.
    """
    if batch.need_full_sort:
        ranked, token_ids = probs.sort(dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(-1, token_ids, _drop_by_rank(ranked, batch))
    elif batch.need_top_k:
        ranked, token_ids = probs.topk(batch.max_top_k, dim=-1)  # sorted, largest first
        kept = torch.zeros_like(probs).scatter_(-1, token_ids, _drop_by_rank(ranked, batch))
        # Rows without a top-k (nor a top-p, or the sort would have run) keep every token.
        probs = torch.where(batch.top_ks[:, None] <= batch.max_top_k, kept, probs)
    return _min_p(probs, batch)


def top_k_candidates(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, max_top_k] probabilities, their token ids): what each row may draw, filtered.

    For batches whose every sampled row has a top-k (``all_top_k``): no row can
    draw outside the batch's max_top_k best logits. top-p (of the top-k mass),
    min-p (of the top probability) and the race are all relative within those,
    so the candidates' own softmax serves and the vocabulary needs none.
    """
    top, token_ids = logits.topk(batch.max_top_k, dim=-1)  # sorted, largest first
    probs = _drop_by_rank(torch.softmax(top / batch.temperatures, dim=-1), batch)
    return _min_p(probs, batch), token_ids


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.all_top_k:
        probs, token_ids = top_k_candidates(logits, batch)
    else:
        probs = filter_probs(torch.softmax(logits / batch.temperatures, dim=-1), batch)
        token_ids = None
    # Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks index i with
    # probability p_i / sum(p). It is scale-invariant, so no renormalisation,
    # and the whole batch needs a single noise tensor.
    choice = (probs / _exponential_noise(probs, batch, token_ids)).argmax(dim=-1)
    sampled = choice if token_ids is None else token_ids.gather(-1, choice[:, None]).squeeze(-1)
    if not batch.any_greedy:
        return sampled
    return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)


def _drop_by_rank(ranked: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero what top-k and top-p drop from ``[B, C]`` probabilities sorted largest first."""
    if batch.need_top_k:
        ranks = torch.arange(ranked.shape[-1], device=ranked.device)
        ranked = ranked.masked_fill(ranks >= batch.top_ks[:, None], 0.0)
    if batch.need_top_p:
        cumulative = ranked.cumsum(dim=-1)
        mass_before = cumulative - ranked
        top_ps = batch.top_ps[:, None]
        # Keep tokens while the mass before them is under top_p of the kept
        # mass; the top token (mass_before = 0) always survives. Rows with
        # top_p = 1 are exempt so rounding in the cumsum cannot drop a tail.
        drop = (mass_before >= top_ps * cumulative[:, -1:]) & (top_ps < 1)
        ranked = ranked.masked_fill(drop, 0.0)
    return ranked


def _min_p(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not batch.need_min_p:
        return probs
    floor = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < floor, 0.0)


def _exponential_noise(
    probs: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor | None
) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``, strictly positive and finite.

    ``token_ids`` names the token of each column; ``None`` means column j is
    token j. Unseeded rows draw from torch's global generator. A seeded row's
    noise for token t depends only on (seed, output length, t), so the request
    samples the same tokens whatever batch it is in, wherever it sits, and
    whether the race runs over the vocabulary or over top-k candidates.
    """
    uniform = torch.rand_like(probs)
    if batch.seeded_rows is not None:
        if token_ids is None:
            tokens = torch.arange(probs.shape[-1], device=probs.device)[None]
        else:
            tokens = token_ids[batch.seeded_rows]
        uniform[batch.seeded_rows] = counter_uniform(batch.step_seeds[:, None], tokens)
    # NOTE: rand may return exactly 0 (-log -> inf: the token could never win),
    # and a backend that rounds to 1 would give E = 0 (p / 0 wins every race).
    below_one = 1.0 - torch.finfo(uniform.dtype).eps / 2
    return uniform.clamp_(torch.finfo(uniform.dtype).tiny, below_one).log_().neg_()


def counter_uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1): SplitMix64 output number ``counter`` of the stream seeded by ``key``.

    ``keys`` and ``counters`` are int64 and broadcast against each other. The
    top 23 bits make the midpoints (m + 0.5) / 2^23, all exact in float32, so
    neither 0 nor 1 can come out.
    """
    bits = mix64(keys + (counters + 1) * _GAMMA)
    return ((bits >> 41) & ((1 << 23) - 1)).float().add_(0.5).mul_(2.0**-23)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on an int64 tensor, in place (callers pass a fresh tensor).

    int64 multiplication wraps mod 2^64 like the unsigned original; ``>>`` on
    int64 is arithmetic, so each shift is masked to the logical shift.
    """
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= _MIX1
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= _MIX2
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


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
    return to_device(values, torch.float32, device)[:, None]


def _top_k_or_all(p: SamplingParams, vocab_size: int) -> int:
    return vocab_size if p.top_k < 1 else min(p.top_k, vocab_size)


def _seed_tensors(
    params: Sequence[SamplingParams],
    greedy: Sequence[bool],
    output_lens: Sequence[int],
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(sampled rows with a seed, their step seeds); (None, None) when there are none."""
    rows = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
    if not rows:
        return None, None
    seeds = to_device([_int64(params[i].seed) for i in rows], torch.int64, device)
    steps = to_device([output_lens[i] for i in rows], torch.int64, device)
    # Output 0 of the stream keyed by (the seed's output 0) + step: (seed, step) pairs do not alias.
    step_seeds = mix64(mix64(seeds + _GAMMA) + steps + _GAMMA)
    return to_device(rows, torch.int64, device), step_seeds


class PenaltyCounts:
    """Token occurrences of request rows kept on the device across steps.

    Rebuilding them every step costs Python work in the context length;
    here a row is reset once (when a request takes it, or is recomputed) and
    then grows by the tokens each step emits. ``gather`` gives the two
    ``[B, V]`` tensors ``SamplingBatch`` penalises with.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.seen = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)  # prompt + output
        self.output = torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)

    def reset(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        device = self.seen.device
        self.seen[row] = _seen_mask([[prompt_ids, output_ids]], self.vocab_size, device)[0]
        self.output[row] = _token_counts([[output_ids]], self.vocab_size, device)[0]

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count ``token_ids[i]`` as emitted by ``rows[i]``; a row may repeat (several tokens a step)."""
        self.seen.index_put_((rows, token_ids), torch.ones((), dtype=torch.bool, device=self.seen.device))
        ones = torch.ones(token_ids.shape, dtype=torch.float32, device=self.output.device)
        self.output.index_put_((rows, token_ids), ones, accumulate=True)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[B, V]`` bool seen in prompt + output, ``[B, V]`` float32 output counts) of ``rows``."""
        return self.seen[rows], self.output[rows]


def _flat_token_index(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``row * vocab_size + token`` for every token id of every row; a row is a list of id lists.

    One flat index over all rows' ids: unlike a padded [B, Lmax] layout one
    long prompt costs no padding in the others, and no list is concatenated.
    """
    # array("q", ids) converts a list of ints in C, ~4x faster than torch.tensor(ids).
    parts = [torch.frombuffer(array("q", ids), dtype=torch.int64) for row in rows for ids in row if ids]
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=device)
    tokens = torch.cat(parts)
    # NOTE: an id >= vocab_size would silently count in the next row; checked here, on the host.
    low, high = torch.aminmax(tokens)
    assert 0 <= int(low) and int(high) < vocab_size, f"token ids outside [0, {vocab_size})"
    tokens = to_device(tokens, torch.int64, device)
    lengths = to_device([sum(len(ids) for ids in row) for row in rows], torch.int64, device)
    offsets = torch.arange(len(rows), device=device) * vocab_size
    return torch.repeat_interleave(offsets, lengths, output_size=len(tokens)) + tokens


def _seen_mask(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``[B, V]`` bool: the token occurs in the row."""
    index = _flat_token_index(rows, vocab_size, device)
    seen = torch.zeros(len(rows) * vocab_size, dtype=torch.bool, device=device)
    return seen.index_fill_(0, index, True).view(len(rows), vocab_size)


def _token_counts(
    rows: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``[B, V]`` float32 occurrence counts of each row's token ids."""
    index = _flat_token_index(rows, vocab_size, device)
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(index.shape, dtype=torch.float32, device=device)
    return counts.index_add_(0, index, ones).view(len(rows), vocab_size)


def _repetition_tensors(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(p.repetition_penalty == 1.0 for p in params):
        return None, None
    if kept is not None:  # penalty 1 leaves a row's logits bit-identical, whatever it holds here
        return _column([p.repetition_penalty for p in params], device), kept
    rows = [
        [prompt, output] if p.repetition_penalty != 1.0 else []
        for p, prompt, output in zip(params, prompt_ids, output_ids)
    ]
    seen = _seen_mask(rows, vocab_size, device)
    return _column([p.repetition_penalty for p in params], device), seen


def _frequency_presence_tensors(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    uses = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(uses):
        return None, None, None
    if kept is None:
        rows = [[output] if use else [] for output, use in zip(output_ids, uses)]
        kept = _token_counts(rows, vocab_size, device)
    return (
        _column([p.frequency_penalty for p in params], device),
        _column([p.presence_penalty for p in params], device),
        kept,
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
    index = (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device))
    return bias.index_put_(index, to_device(values, torch.float32, device))


def _min_tokens_block(
    params: Sequence[SamplingParams],
    output_lens: Sequence[int],
    eos_token_ids: Sequence[int],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of every stop token a row may not emit yet.

    ``ignore_eos`` does not lift this: it only changes the stop check.
    """
    rows, cols = [], []
    for i, (p, produced) in enumerate(zip(params, output_lens)):
        if produced < p.min_new_tokens:
            blocked = set(eos_token_ids) | set(p.stop_token_ids)
            rows.extend([i] * len(blocked))
            cols.extend(blocked)
    if not rows:
        return None
    return to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)
