"""A `choices` request, orchestrated: its scoring requests out, their prompt logprobs in, one answer.

`sampling_params.choices` asks which of several continuations the model prefers. Each choice
becomes a prefill-only request (prompt + choice, max_new_tokens 0) returning the logprobs of the
choice's tokens; the unconditional method adds each choice after a bare start token. Once every
one has answered, the scores are combined (the math: constrained/choices.py) and the best choice
is the result's text. Both front doors use this: the tokenizer process sends the scoring
requests to the scheduler and answers when the last comes back; LocalEngine runs them in one go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.runtime.constrained.choices import BY_NAME, METHODS, ChoiceGroup, choice_boundary, result_meta
from radixlm.runtime.messages import GenerateRequest, TokenizedRequest
from radixlm.runtime.native import BadRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.tokenizer.output import RequestOutput
from radixlm.runtime.tokenizer.prepare import RequestPreparer


def is_choices(req: GenerateRequest) -> bool:
    return "choices" in (req.sampling_params or {})


@dataclass
class ChoiceScoring:
    """A `choices` request: the group that collects the scores, and the requests that score (slot i
    is `requests[i]`)."""

    group: ChoiceGroup
    requests: list[TokenizedRequest]


def scoring_requests(prep: RequestPreparer, req: GenerateRequest, client: bytes = b"") -> ChoiceScoring:
    """The scoring requests of a `choices` request, every one checked before any is sent."""
    prompt_ids = prep.prompt_ids(req)
    raw = dict(req.sampling_params)
    choices, method = raw.pop("choices"), raw.pop("choices_method", METHODS[0])
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise BadRequest("choices must be a non-empty list of non-empty strings")
    if method not in METHODS:
        raise BadRequest(f"choices_method must be one of {', '.join(METHODS)}")
    tok = prep.tokenizer
    if tok is None:
        raise BadRequest("choices need a tokenizer")
    params = SamplingParams.from_dict({k: v for k, v in raw.items() if k != "max_new_tokens"} | {"max_new_tokens": 0})
    prompt_text = tok.decode(prompt_ids) if req.text is None else req.text
    scored = []  # (ids, logprob start) per scoring request
    for choice in choices:
        # encoded as the prompt was: a text with its tokenizer's special tokens, ids and chats as they are
        full = prep.encode(prompt_text + choice) if req.text is not None else tok.encode(
            prompt_text + choice, add_special_tokens=False)
        scored.append((full, choice_boundary(prompt_ids, full)))
    group = ChoiceGroup(req.rid, client, choices, method, [b for _, b in scored], prompt_tokens=len(prompt_ids))
    if BY_NAME[method].requires_unconditional_logprobs:
        # the same tokens after nothing but a start-of-text token
        start_token = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        scored += [([start_token, *tok.encode(c, add_special_tokens=False)], 1) for c in choices]
    for i, (ids, _) in enumerate(scored):
        try:
            prep.check_fits(ids)
        except BadRequest as e:
            raise BadRequest(f"prompt plus choice {i % len(choices)}: {e}") from None
        if len(ids) < 2:
            raise BadRequest(f"choice {choices[i % len(choices)]!r} is too short to score without the prompt")
    return ChoiceScoring(group, [TokenizedRequest(f"{req.rid}\x00choice{i}", ids, params, True, start)
                                 for i, (ids, start) in enumerate(scored)])


def record_score(group: ChoiceGroup, slot: int, scored: RequestOutput) -> None:
    """Scoring request `slot` has finished with these outputs."""
    n = len(group.choices)
    tokens = [list(entry) for entry in (scored.input_logprobs or []) if entry[0] is not None]
    if slot < n:
        group.conditional[slot] = tokens
        group.cached_tokens = max(group.cached_tokens, scored.cached_tokens)
    else:
        group.unconditional[slot - n] = tokens


def answer(group: ChoiceGroup) -> tuple[str, dict[str, Any]]:
    """The complete group's result: the chosen text and the meta_info with every choice's score."""
    best, meta = result_meta(group)
    meta.update({"id": group.rid, "prompt_tokens": group.prompt_tokens, "completion_tokens": 0,
                 "cached_tokens": group.cached_tokens, "finish_reason": {"type": "stop", "matched": None}})
    return group.choices[best], meta
