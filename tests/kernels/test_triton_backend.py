"""End to end: a tiny random model with `--attention-backend triton` (the Triton interpreter on a
CPU: slow, so few prompts) gives Hugging Face's greedy tokens, as the torch backend does."""

from __future__ import annotations

from helpers import assert_drained
from oracle import assert_matches

# the interpreter runs each kernel launch in Python: fewer new tokens than the other backends'
# tests (the first 12 of the same references), every prefill and decode kernel still exercised
TOKENS = 12
GREEDY = {"max_new_tokens": TOKENS, "temperature": 0}


def test_triton_backend_matches_hf(tiny_llama):
    engine = tiny_llama.engine(attention_backend="triton")
    results = engine.generate(input_ids=tiny_llama.prompts[:4], sampling_params=GREEDY)
    for i, (res, ref) in enumerate(zip(results, tiny_llama.refs)):
        assert_matches(res["output_ids"], ref.truncated(TOKENS), f"prompt {i} (triton)")
    assert_drained(engine)


def test_triton_backend_with_pages_chunks_and_a_shared_prefix(tiny_llama):
    """Page size 16, 24-token prefill chunks (extends over a cached prefix) and prompts that
    share a 64-token prefix from the radix cache."""
    engine = tiny_llama.engine(attention_backend="triton", page_size=16, chunked_prefill_size=24)
    results = engine.generate(input_ids=tiny_llama.shared_prompts[:3], sampling_params=GREEDY)
    assert sum(r["meta_info"]["cached_tokens"] for r in results) >= 64  # extends over a cached prefix ran
    for i, (res, ref) in enumerate(zip(results, tiny_llama.shared_refs)):
        assert_matches(res["output_ids"], ref.truncated(TOKENS), f"shared-prefix prompt {i} (triton)")
    assert_drained(engine)
