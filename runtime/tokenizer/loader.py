"""Load a Hugging Face tokenizer (with its chat template) from a checkpoint directory or a GGUF file."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime import tool_calls
from runtime.worker.loader import ModelSource


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> PreTrainedTokenizerBase:
    # transformers warns loudly about GGUF conversion details that do not concern users
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if tokenizer_path:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    if source.is_gguf:
        return AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    return AutoTokenizer.from_pretrained(source.path)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a conversation (OpenAI-shaped messages, tool calls and results included),
    rendered with the tokenizer's chat template and opened for the assistant's reply.
    Raises ValueError when the messages do not fit the template."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("messages must be a non-empty list of objects with a role")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = "\n".join(template.values())
    try:
        messages, tools = tool_calls.for_template(messages, tools, template)
        # transformers renders templates in a jinja2 sandbox
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise ValueError(f"cannot apply the chat template: {e}") from e
