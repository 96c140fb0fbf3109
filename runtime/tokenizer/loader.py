"""Load a Hugging Face tokenizer (with its chat template) from a checkpoint directory or a GGUF file.

Loaded without importing torch whenever it can be: transformers' `AutoTokenizer` reads the model's
config through its configuration module, which imports torch (seconds of a process's start, and
its memory, in the tokenizer process that needs none of it). So the class `AutoTokenizer` picks is
worked out once and kept in the cache (a GGUF file's converted tokenizer names it; a checkpoint
directory's is remembered beside its key), and later starts load that class directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Iterator

import transformers
from transformers import PreTrainedTokenizerBase

from radixlm.runtime import tool_calls
from radixlm.runtime.model_config import ModelSource


log = logging.getLogger(__name__)

_CLASS_RECORD = "tokenizer_class.json"  # a checkpoint directory's entry: {"tokenizer_class": name}


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> PreTrainedTokenizerBase:
    # transformers warns loudly about GGUF conversion details that do not concern users
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if tokenizer_path or not source.is_gguf:
        return _directory_tokenizer(tokenizer_path or source.path)
    return _gguf_tokenizer(source.path)


def _directory_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer` makes of a checkpoint directory (or a hub name, which is never
    cached). Its class is remembered under the cache directory, keyed by the files that decide it."""
    entry = _directory_cache_dir(path) if os.path.isdir(path) else None
    record = os.path.join(entry, _CLASS_RECORD) if entry else None
    if record and os.path.exists(record):
        try:
            with open(record) as f:
                return _load_class(json.load(f)["tokenizer_class"], path)
        except Exception as e:  # noqa: BLE001 - a damaged record is rewritten, not fatal
            log.warning("ignoring the tokenizer class recorded in %s: %s", record, e)
    tokenizer = _auto_tokenizer(path)
    if record and _transformers_class(type(tokenizer).__name__) is type(tokenizer):  # not remote code
        _write_entry(entry, lambda d: _write_json(os.path.join(d, _CLASS_RECORD),
                                                  {"tokenizer_class": type(tokenizer).__name__}))
    return tokenizer


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer. transformers converts it in seconds (it parses ~50k token strings in
    Python) every time, so the result is kept as a tokenizer.json under the cache directory, keyed by
    the file and the transformers version; from there it loads in a tenth of a second, as the class
    its tokenizer_config.json names. One process converts at a time (the scheduler and the tokenizer
    process start together): the other waits for it, then loads what it wrote."""
    cache = tokenizer_cache_dir(path)
    tokenizer = _cached_gguf_tokenizer(cache)
    if tokenizer is None:
        with _one_at_a_time(cache):
            tokenizer = _cached_gguf_tokenizer(cache)
            if tokenizer is None:
                tokenizer = _auto_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))
                _write_entry(cache, tokenizer.save_pretrained)
    return tokenizer


def _cached_gguf_tokenizer(cache: str) -> PreTrainedTokenizerBase | None:
    if not os.path.exists(os.path.join(cache, "tokenizer.json")):
        return None
    try:
        with open(os.path.join(cache, "tokenizer_config.json")) as f:
            return _load_class(json.load(f)["tokenizer_class"], cache)
    except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, not fatal
        log.warning("ignoring the cached tokenizer in %s: %s", cache, e)
        return None


@contextlib.contextmanager
def _one_at_a_time(entry: str) -> Iterator[None]:
    """Hold the cache entry's lock file (an exclusive flock) while inside; without a writable cache
    directory, nothing to hold."""
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        lock = open(entry + ".lock", "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _auto_tokenizer(path: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # imports torch: only when nothing in the cache says the class

    return AutoTokenizer.from_pretrained(path, **kwargs)


def _transformers_class(name: str) -> type | None:
    """transformers' own tokenizer class of that name (its module imported alone, without torch)."""
    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _load_class(name: str, path: str) -> PreTrainedTokenizerBase:
    cls = _transformers_class(name)
    if cls is None:
        raise ValueError(f"{name!r} is not a tokenizer class of transformers {transformers.__version__}")
    return cls.from_pretrained(path)


def _write_entry(entry: str, write: Any) -> None:
    """Fill the cache entry `entry` by `write(folder)`, atomically: written in a staging folder, then
    renamed into place (another process that got there first wins)."""
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(entry))
        write(staging)
        try:
            shutil.rmtree(entry, ignore_errors=True)  # a damaged entry
            os.rename(staging, entry)
        except OSError:  # another process (the scheduler and the tokenizer start together) got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        log.info("not caching the tokenizer (%s)", e)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _cache_root() -> str:
    return os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")


def _cache_entry(key: str) -> str:
    return os.path.join(_cache_root(), "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:20])


def tokenizer_cache_dir(gguf_path: str) -> str:
    """Where the converted tokenizer of a GGUF file is kept: under $RADIXLM_CACHE_DIR (default
    ~/.cache/radixlm), named after the file's path, size and modification time and the transformers
    version, so any change to either makes a new entry."""
    st = os.stat(gguf_path)
    return _cache_entry(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}")


# what AutoTokenizer reads to choose a directory's tokenizer class
_CLASS_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def _directory_cache_dir(path: str) -> str:
    """Where the tokenizer class of a checkpoint directory is remembered: named after the directory,
    the size and modification time of each file the choice reads, and the transformers version."""
    stats = []
    for name in _CLASS_FILES:
        file = os.path.join(path, name)
        st = os.stat(file) if os.path.exists(file) else None
        stats.append(f"{name}:{st.st_size}:{st.st_mtime_ns}" if st else f"{name}:-")
    return _cache_entry("|".join([os.path.abspath(path), *stats, transformers.__version__]))


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (OpenAI-shaped messages, tool calls and results included),
    rendered with the tokenizer's chat template and opened for the assistant's reply (unless
    `add_generation_prompt` is false: /tokenize's, as vLLM's); `template_kwargs` are extra
    variables the template reads (Qwen3's `enable_thinking`), and SGLang's
    `continue_final_message`: a last message of the assistant's is left open for the reply to
    continue (no generation prompt; ignored after any other role, as SGLang ignores it).
    A system message past the first stays where it stands; a template that refuses one there
    (a system message only first: Qwen3.5's, Gemma's) gets every system message joined, in order,
    into one at the start, as vLLM and SGLang do for such templates.
    Raises ValueError when the messages do not fit the template."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("messages must be a non-empty list of objects with a role")
    template_kwargs = dict(template_kwargs or {})
    reserved = sorted(set(template_kwargs) & _RENDER_ARGUMENTS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets those")
    prefill = template_kwargs.pop("continue_final_message", False)
    if not isinstance(prefill, bool):
        raise ValueError("chat_template_kwargs.continue_final_message must be a boolean")
    prefill = prefill and messages[-1]["role"] == "assistant"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = "\n".join(template.values())

    def render(messages: list[dict[str, Any]]) -> str:
        rendered, listed = tool_calls.for_template(messages, tools, template)
        # transformers renders templates in a jinja2 sandbox
        return tokenizer.apply_chat_template(rendered, tools=listed, tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not prefill,
                                             continue_final_message=prefill, **template_kwargs)

    try:
        return render(messages)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        if any(m["role"] == "system" for m in messages[1:]):
            with contextlib.suppress(Exception):
                return render(_system_first(messages))
        raise ValueError(f"cannot apply the chat template: {e}") from e


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every system message's text joined, in order, into one at the start."""
    system = [m for m in messages if m["role"] == "system"]
    joined = {"role": "system", "content": "\n\n".join(str(m.get("content") or "") for m in system)}
    return [joined] + [m for m in messages if m["role"] != "system"]


# apply_chat_template's own arguments (and the variables it sets): not for chat_template_kwargs
_RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs"})
