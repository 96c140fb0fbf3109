"""Hugging Face transformers on a GGUF file: the reference that tests and benchmarks hold
radixlm to (same weights, fp32).

transformers' GGUF loading spends most of its time on work unrelated to the weights: it parses
the file's metadata twice (SmolLM2's 49k-token vocabulary: 8 s each) and rebuilds gguf's
tensor-name table once per module (397 times: 15 s). Both are pure functions of their
arguments, so while the model loads they are memoized; the weights' conversion (dequantizing,
un-permuting, naming) is transformers' own, untouched.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model for the GGUF file at `path`, in eval mode."""
    import transformers

    with _parse_gguf_once(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    return model.eval()


@contextlib.contextmanager
def _parse_gguf_once(path: str) -> Iterator[None]:
    import gguf

    from radixlm.runtime.model_config import gguf_reader

    parsed = gguf_reader(path)  # once per process, shared with our own loader
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(file: str, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.samefile(file, path):
            return parsed
        return real_reader(file, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
