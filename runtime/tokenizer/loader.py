"""Load a Hugging Face tokenizer (with its chat template) from a checkpoint directory or a GGUF file."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixlm.runtime import tool_calls
from radixlm.runtime.model_config import ModelSource


log = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> PreTrainedTokenizerBase:
    # transformers warns loudly about GGUF conversion details that do not concern users
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if source.is_gguf:
        return _gguf_tokenizer(source.path)
    return AutoTokenizer.from_pretrained(source.path)


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer. transformers converts it in seconds (it parses ~50k token strings in
    Python) every time, so the result is kept as a tokenizer.json under the cache directory, keyed by
    the file and the transformers version; from there it loads in a tenth of a second."""
    cache = tokenizer_cache_dir(path)
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt, not fatal
            log.warning("ignoring the cached tokenizer in %s: %s", cache, e)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(cache))
        tokenizer.save_pretrained(staging)
        try:
            shutil.rmtree(cache, ignore_errors=True)  # a damaged entry
            os.rename(staging, cache)
        except OSError:  # another process (the scheduler and the tokenizer start together) got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        log.info("not caching the tokenizer (%s)", e)
    return tokenizer


def tokenizer_cache_dir(gguf_path: str) -> str:
    """Where the converted tokenizer of a GGUF file is kept: under $RADIXLM_CACHE_DIR (default
    ~/.cache/radixlm), named after the file's path, size and modification time and the transformers
    version, so any change to either makes a new entry."""
    root = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(root, "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:20])


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation (OpenAI-shaped messages, tool calls and results included),
    rendered with the tokenizer's chat template and opened for the assistant's reply;
    `template_kwargs` are extra variables the template reads (Qwen3's `enable_thinking`), and
    SGLang's `continue_final_message`: a last message of the assistant's is left open for the reply
    to continue (no generation prompt; ignored after any other role, as SGLang ignores it).
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
    try:
        messages, tools = tool_calls.for_template(messages, tools, template)
        # transformers renders templates in a jinja2 sandbox
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=not prefill,
                                             continue_final_message=prefill, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise ValueError(f"cannot apply the chat template: {e}") from e


# apply_chat_template's own arguments (and the variables it sets): not for chat_template_kwargs
_RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs"})
