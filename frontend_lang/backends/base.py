"""What the interpreter needs from a backend: native `/generate` bodies in, results out.

Every backend speaks the runtime's native body (`text`, `sampling_params`,
`return_logprob`, ...) for exactly one prompt, so a program produces the same
requests whichever backend runs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from frontend_lang.chat_template import ChatTemplate, from_model


class BackendError(RuntimeError):
    """The backend refused or failed a request; the message is the runtime's."""


class Backend(ABC):
    @abstractmethod
    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """The result (`text`, `output_ids`, `meta_info`) of one native request."""

    @abstractmethod
    def stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of one native request (each with the new `text`), the last with its finish reason."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """`/get_model_info`: model_path, context_length, chat_template, ..."""

    @cached_property
    def chat_template(self) -> ChatTemplate:
        info = self.model_info()
        return from_model(info.get("chat_template"), info.get("bos_token"))

    def select(self, text: str, choices: list[str], method: str) -> dict[str, Any]:
        """Score `choices` after `text`: the result's text is the chosen one, its meta_info has the scores."""
        return self.generate({"text": text, "sampling_params": {"choices": choices, "choices_method": method}})

    def cache_prefix(self, text: str) -> None:
        """Prefill `text` into the prefix cache (no generation), so that what follows shares it."""
        self.generate({"text": text, "sampling_params": {"max_new_tokens": 0}})

    def shutdown(self) -> None:
        """Release what the backend holds (processes, connections)."""
