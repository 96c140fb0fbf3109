"""A GGUF file's tokenizer is converted once and loaded from the cache afterwards, unchanged; a
checkpoint directory's tokenizer class is worked out once; either then loads without torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from helpers import MODULE_CWD
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


def _load_in_a_fresh_process(model_path: str | None) -> list[str]:
    """What a process that only loads the tokenizer (as the tokenizer process does) imports of torch."""
    code = ("import sys; from radixlm.runtime.model_config import resolve_model; "
            "from radixlm.runtime.tokenizer.loader import load_tokenizer; "
            f"load_tokenizer(resolve_model({model_path!r})); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=MODULE_CWD, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_a_cached_tokenizer_loads_without_torch(tmp_path, monkeypatch, tiny_qwen3):
    """transformers' AutoTokenizer imports torch (its configuration module does): once the cache says
    which class a model's tokenizer is, loading it imports none of torch, for a GGUF file and for a
    checkpoint directory alike."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    for path in (None, tiny_qwen3):
        load_tokenizer(resolve_model(path))  # worked out once (here, in a process that has torch anyway)
        assert _load_in_a_fresh_process(path) == [], path


def test_a_directory_tokenizer_is_autotokenizers(tmp_path, monkeypatch, tiny_qwen3):
    """The class remembered for a checkpoint directory is the one AutoTokenizer picks, loaded from the
    directory itself; a damaged record is rewritten, and a changed tokenizer file makes a new one."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    auto = AutoTokenizer.from_pretrained(tiny_qwen3)
    first = load_tokenizer(resolve_model(tiny_qwen3))
    again = load_tokenizer(resolve_model(tiny_qwen3))
    assert type(first) is type(again) is type(auto)
    _same(again, auto)
    (record,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == "tokenizer_class.json"]
    with open(record, "w") as f:
        f.write('{"tokenizer_class": "NoSuchTokenizer"}')
    _same(load_tokenizer(resolve_model(tiny_qwen3)), auto)
    with open(record) as f:
        assert type(auto).__name__ in f.read()
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen3, copy)
    load_tokenizer(resolve_model(str(copy)))
    os.utime(copy / "tokenizer_config.json", ns=(0, 0))
    load_tokenizer(resolve_model(str(copy)))
    records = [f for _, _, files in os.walk(tmp_path) for f in files if f == "tokenizer_class.json"]
    assert len(records) == 3  # the original, the copy, the copy after its change


def test_a_conversion_under_way_is_waited_for(tmp_path, monkeypatch, smol_tokenizer):
    """The scheduler and the tokenizer process start together: while one converts a GGUF file's
    tokenizer (it holds the entry's lock), the other waits, then loads what it wrote instead of
    converting it again (seconds of CPU on a machine whose cores both are starting)."""
    import fcntl
    import threading

    from radixlm.runtime.tokenizer import loader

    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    src = resolve_model(None)
    entry = tokenizer_cache_dir(src.path)
    conversions, waiting, flock = [], threading.Event(), fcntl.flock
    monkeypatch.setattr(loader, "_auto_tokenizer", lambda *a, **k: conversions.append(a) or smol_tokenizer)
    monkeypatch.setattr(fcntl, "flock", lambda f, op: (waiting.set(), flock(f, op))[1])
    os.makedirs(os.path.dirname(entry))
    with open(entry + ".lock", "a") as lock:
        flock(lock, fcntl.LOCK_EX)  # another process converting
        got = []
        waiter = threading.Thread(target=lambda: got.append(load_tokenizer(src)))
        waiter.start()
        assert waiting.wait(60), "it did not wait for the conversion under way"
        smol_tokenizer.save_pretrained(entry)  # what the other process writes
    waiter.join(60)
    assert conversions == [] and len(got) == 1
    _same(got[0], smol_tokenizer)
