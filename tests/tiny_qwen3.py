"""A tiny random Qwen3 with Qwen3's real chat template and a small tokenizer that has its tags.

The template (tests/fixtures/qwen3_chat_template.jinja) is Qwen3-0.6B's, as published. The
tokenizer is a byte-level BPE trained here on a few lines, with Qwen3's special tokens
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at ids 0, 1, 2: the checkpoint's pad, bos, eos)
and, like Qwen3's, `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as added tokens that are
not special (they stay in decoded text). A few hundred tokens keep constraint vocabularies quick.
"""

from __future__ import annotations

import os

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the answer? Let me think about it.",
    'A JSON object: {"name": "Ada", "age": 36, "city": "London", "ok": true, "items": [1, 2, 3]}',
    "Okay, the user asks a question. First, I should consider the facts, then answer briefly.",
    "system user assistant tool function arguments name description parameters type object",
]


def chat_template() -> str:
    with open(os.path.join(FIXTURES, "qwen3_chat_template.jinja")) as f:
        return f.read()


def make_tokenizer(vocab_size: int = 400):
    from transformers import AddedToken, PreTrainedTokenizerFast

    from tiny_tokenizers import train_bpe

    bpe = train_bpe(SPECIAL, vocab_size, CORPUS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.chat_template = chat_template()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL] == [0, 1, 2]
    return tok


def make_tiny_qwen3(path: str) -> None:
    """Checkpoint and tokenizer in one directory (what `--model-path` takes)."""
    from conftest import make_tiny_checkpoint

    tok = make_tokenizer()
    make_tiny_checkpoint("qwen3", path, vocab_size=len(tok))
    tok.save_pretrained(path)
