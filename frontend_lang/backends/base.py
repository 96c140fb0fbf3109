"""What the interpreter needs from a backend: one `Call` per generation in, a result out.

A `Call` holds the program's text so far and, for chat APIs, its finished
turns and the open one. Results have the runtime's native shape (`text`,
`output_ids`, `meta_info`). The runtime backends send the native body
(`Call.native_body()`), so a program makes the same requests whichever of
them runs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from radixlm.lang.chat_template import ChatTemplate, from_model


class BackendError(RuntimeError):
    """The backend refused or failed a request; the message is the runtime's."""


@dataclass
class Call:
    """One generation a program asks for."""

    text: str  # everything the program wrote so far: the prompt
    sampling_params: dict[str, Any]  # native names (max_new_tokens, stop, regex, ...)
    messages: list[dict[str, str]] = field(default_factory=list)  # finished chat turns
    turn: tuple[str, str] | None = None  # the open turn: (role, its text so far)
    return_logprob: bool = False
    top_logprobs_num: int = 0

    def native_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"text": self.text, "sampling_params": self.sampling_params}
        if self.return_logprob:
            body.update(return_logprob=True, top_logprobs_num=self.top_logprobs_num)
        return body


class Backend(ABC):
    @abstractmethod
    def generate(self, call: Call) -> dict[str, Any]:
        """The result (`text`, `output_ids`, `meta_info`) of one generation."""

    @abstractmethod
    def stream(self, call: Call) -> Iterator[dict[str, Any]]:
        """The chunks of one generation (each with the new `text`), the last with its finish reason."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """`/get_model_info`: model_path, context_length, chat_template, ..."""

    @cached_property
    def chat_template(self) -> ChatTemplate:
        info = self.model_info()
        return from_model(info.get("chat_template"), info.get("bos_token"))

    def select(self, call: Call, choices: list[str], method: str) -> dict[str, Any]:
        """Score `choices` after the call's text: the result's text is the chosen one, its
        meta_info has `normalized_scores` (one per choice) and `selected_index`."""
        return self.generate(Call(call.text, {"choices": choices, "choices_method": method}))

    def cache_prefix(self, text: str) -> None:
        """Prefill `text` into the prefix cache (no generation), so that what follows shares it."""
        self.generate(Call(text, {"max_new_tokens": 0}))

    def shutdown(self) -> None:
        """Release what the backend holds (processes, connections)."""
