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
from typing import Any, NamedTuple

from radixlm.lang.chat_template import ChatTemplate, from_model


class BackendError(RuntimeError):
    """The backend refused or failed a request; the message is the runtime's."""


# the /generate body's fields (beside the sampling params) that a gen may set
LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass
class Call:
    """One generation a program asks for."""

    text: str  # everything the program wrote so far: the prompt
    sampling_params: dict[str, Any]  # native names (max_new_tokens, stop, regex, ...)
    messages: list[dict[str, str]] = field(default_factory=list)  # finished chat turns
    turn: tuple[str, str] | None = None  # the open turn: (role, its text so far)
    options: dict[str, Any] = field(default_factory=dict)  # LOGPROB_OPTIONS the program set

    def native_body(self) -> dict[str, Any]:
        return {"text": self.text, "sampling_params": self.sampling_params, **self.options}


class ChoiceLogprobs(NamedTuple):
    """The logprobs of each choice's tokens after a prompt, as `[logprob, token_id, token_text]`
    entries (id and text None where the backend does not report them)."""

    conditional: list[list[list[Any]]]
    unconditional: list[list[list[Any]]] | None  # the same tokens without the prompt, when asked for
    meta_info: dict[str, Any]  # the request's prompt_tokens, cached_tokens, ...


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

    def choice_logprobs(self, call: Call, choices: list[str], unconditional: bool) -> ChoiceLogprobs:
        """Score `choices` after the call's text: the runtime's `choices` request (one shared
        prefill; prompt/choice token merges handled there)."""
        method = "unconditional_likelihood_normalized" if unconditional else "token_length_normalized"
        meta = self.generate(Call(call.text, {"choices": choices, "choices_method": method}))["meta_info"]
        plain = meta.pop("unconditional_token_logprobs", None)
        if unconditional and plain is None:
            raise BackendError("the server did not return unconditional_token_logprobs for "
                               "unconditional_likelihood_normalized")
        scores = meta.pop("choice_token_logprobs")
        for decided in ("choices", "method", "selected_index", "normalized_scores", "greedy_logprob_matrix"):
            meta.pop(decided, None)  # the runtime's own decision: the method decides on the client
        return ChoiceLogprobs(_entries(scores), _entries(plain), meta)

    def cache_prefix(self, text: str) -> None:
        """Prefill `text` into the prefix cache (no generation), so that what follows shares it."""
        self.generate(Call(text, {"max_new_tokens": 0}))

    def flush_cache(self) -> bool:
        """Empty the runtime's prefix cache; False when it refused (requests are running)."""
        raise BackendError(f"{type(self).__name__} cannot flush a cache")

    def get_server_info(self) -> dict[str, Any]:
        raise BackendError(f"{type(self).__name__} reports no server info")

    def shutdown(self) -> None:
        """Release what the backend holds (processes, connections)."""


def _entries(lists: list[list[Any]] | None) -> list[list[list[Any]]] | None:
    """SGLang's per-token entries, [logprob, token_id, token_text], from the runtime's lists (bare
    logprobs, or entries with fewer fields: what is missing is None)."""
    if lists is None:
        return None
    return [[[*x, None, None][:3] if isinstance(x, (list, tuple)) else [x, None, None] for x in tokens]
            for tokens in lists]
