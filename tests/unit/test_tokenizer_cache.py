"""A GGUF file's tokenizer is converted once and loaded from the cache afterwards, unchanged."""

from __future__ import annotations

import os
import shutil
import time

from radixlm.runtime.tokenizer.loader import load_tokenizer, tokenizer_cache_dir
from radixlm.runtime.model_config import resolve_model

TEXTS = ["Hello world", "wörld  \t 🤖 12345\n\n", "<|im_start|>user\nHi<|im_end|>\n", " leading space", ""]


def _same(a, b) -> None:
    assert a.get_vocab() == b.get_vocab()
    assert a.convert_ids_to_tokens(list(range(len(a)))) == b.convert_ids_to_tokens(list(range(len(b))))
    assert (a.bos_token, a.eos_token, a.all_special_ids) == (b.bos_token, b.eos_token, b.all_special_ids)
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        assert a.encode(text) == b.encode(text) and a.decode(a.encode(text)) == b.decode(b.encode(text))
    chat = [{"role": "user", "content": "Hi"}]
    assert a.apply_chat_template(chat, tokenize=False) == b.apply_chat_template(chat, tokenize=False)


def test_the_cached_tokenizer_is_the_converted_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    src = resolve_model(None)
    converted = load_tokenizer(src)
    entry = tokenizer_cache_dir(src.path)
    assert entry.startswith(str(tmp_path)) and os.path.exists(os.path.join(entry, "tokenizer.json"))
    started = time.perf_counter()
    cached = load_tokenizer(src)
    assert time.perf_counter() - started < 2  # the conversion takes several seconds
    _same(converted, cached)


def test_a_damaged_or_stale_entry_is_rebuilt(tmp_path, monkeypatch, smol_tokenizer):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    src = resolve_model(None)
    entry = tokenizer_cache_dir(src.path)
    os.makedirs(entry)
    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{not json")
    _same(load_tokenizer(src), smol_tokenizer)
    _same(load_tokenizer(src), smol_tokenizer)  # now from the rebuilt entry
    # another file (or the same one changed) gets its own entry
    copy = str(tmp_path / "copy.gguf")
    shutil.copyfile(src.path, copy)
    before = tokenizer_cache_dir(copy)
    assert before != entry
    os.utime(copy, ns=(0, 0))
    assert tokenizer_cache_dir(copy) != before
