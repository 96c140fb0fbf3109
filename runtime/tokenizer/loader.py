"""Load a Hugging Face tokenizer (with its chat template) from a checkpoint directory or a GGUF file."""

from __future__ import annotations

import logging
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.worker.loader import ModelSource


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> PreTrainedTokenizerBase:
    # transformers warns loudly about GGUF conversion details that do not concern users
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if source.is_gguf:
        return AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    return AutoTokenizer.from_pretrained(source.path)
