"""`OpenAI`: any OpenAI-compatible server (ours included), through the official client.

A chat model (`is_chat_model=True`, the default) gets the program's finished
turns as `messages`, so a `gen` must open an assistant turn. A completions
model gets the program's text as the prompt, rendered with `chat_template`
(plain unless named). `select` needs the logprobs of given text, which only the
completions API offers (`echo` with `logprobs`): with a chat model it is a
clear error. Sampling parameters beyond OpenAI's (top_k, min_p, regex, ...) go
in `extra_body`, as SGLang-compatible servers read them (so does a completions
model's `json_schema`; a chat model's becomes `response_format`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from radixlm.lang.backends.base import Backend, BackendError, Call, ChoiceLogprobs
from radixlm.lang.chat_template import ChatTemplate, get_chat_template

_STANDARD = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed", "n": "n"}
_EXTENSIONS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "regex": "regex",
               "ignore_eos": "ignore_eos", "min_new_tokens": "min_tokens", "stop_token_ids": "stop_token_ids"}


class OpenAI(Backend):
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: str = "plain", timeout: float = 600) -> None:
        import openai

        self.model = model
        self.is_chat_model = is_chat_model
        self._template = get_chat_template(chat_template)
        self._errors = openai.OpenAIError
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                                    timeout=timeout)

    @property
    def chat_template(self) -> ChatTemplate:  # type: ignore[override]
        return self._template

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model}

    def generate(self, call: Call) -> dict[str, Any] | list[dict[str, Any]]:
        r = self._create(call, stream=False)
        results = [{"text": (c.message.content or "") if self.is_chat_model else c.text, "output_ids": [],
                    "meta_info": {**_usage(r.usage), "finish_reason": {"type": c.finish_reason}}} for c in r.choices]
        return results if call.sampling_params.get("n", 1) > 1 else results[0]

    def stream(self, call: Call) -> Iterator[dict[str, Any]]:
        for chunk in self._create(call, stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = (choice.delta.content or "") if self.is_chat_model else choice.text
            meta = {"finish_reason": {"type": choice.finish_reason}} if choice.finish_reason else {}
            yield {"text": text, "output_ids": [], "meta_info": meta}

    def choice_logprobs(self, call: Call, choices: list[str], unconditional: bool) -> ChoiceLogprobs:
        """The logprobs of each choice's tokens after the text (the prompt echoed with logprobs)."""
        if self.is_chat_model:
            raise BackendError("select needs the logprobs of given text, which chat completions do not return: "
                               "use OpenAI(..., is_chat_model=False) with a server whose completions offer echo "
                               "and logprobs, or the RuntimeEndpoint backend")
        if unconditional:
            raise BackendError("unconditional_likelihood_normalized needs logprobs without the prompt, which the "
                               "OpenAI API cannot give: use the RuntimeEndpoint backend")
        return ChoiceLogprobs([self._choice_tokens(call.text, choice) for choice in choices], None, {})

    def cache_prefix(self, text: str) -> None:
        """Nothing to send: OpenAI-compatible servers cache prompts on their own."""

    def _choice_tokens(self, text: str, choice: str) -> list[list[Any]]:
        try:
            r = self.client.completions.create(model=self.model, prompt=text + choice, max_tokens=0, echo=True,
                                               logprobs=0, temperature=0)
        except self._errors as e:
            raise BackendError(f"scoring a choice failed: {e}") from None
        lp = r.choices[0].logprobs
        if lp is None or not lp.token_logprobs:
            raise BackendError("the server returned no prompt logprobs for echo: select is not possible through it")
        # the choice's tokens: those that end past the text (the first may also hold its last characters)
        ends = [*lp.text_offset[1:], len(text + choice)]
        return [[x, None, token] for end, x, token in zip(ends, lp.token_logprobs, lp.tokens)
                if end > len(text) and x is not None]

    def _create(self, call: Call, stream: bool) -> Any:
        if call.options:
            raise BackendError(f"{', '.join(call.options)} need the RuntimeEndpoint backend: the OpenAI API "
                               "returns no such logprobs")
        kwargs = self._arguments(call.sampling_params)
        try:
            if self.is_chat_model:
                return self.client.chat.completions.create(messages=_chat_messages(call), stream=stream, **kwargs)
            return self.client.completions.create(prompt=call.text, stream=stream, **kwargs)
        except self._errors as e:
            raise BackendError(str(e)) from None

    def _arguments(self, params: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model}
        extra: dict[str, Any] = {}
        for key, value in params.items():
            if key in _STANDARD:
                kwargs[_STANDARD[key]] = value
            elif key in _EXTENSIONS:
                extra[_EXTENSIONS[key]] = value
            elif key == "json_schema" and self.is_chat_model:
                kwargs["response_format"] = {"type": "json_schema",
                                             "json_schema": {"name": "output", "schema": json.loads(value)}}
            elif key == "json_schema":
                extra["json_schema"] = value  # completions have no response_format: SGLang's extension
            else:
                raise BackendError(f"{key} is not available through the OpenAI API; use the RuntimeEndpoint backend")
        if extra:
            kwargs["extra_body"] = extra
        return kwargs


def _chat_messages(call: Call) -> list[dict[str, str]]:
    if call.turn != ("assistant", ""):
        raise BackendError("a chat model writes whole assistant turns: put the gen first in an assistant turn, "
                           "or use OpenAI(..., is_chat_model=False) for a completions model")
    return call.messages


def _usage(usage: Any) -> dict[str, int]:
    if usage is None:
        return {}
    details = getattr(usage, "prompt_tokens_details", None)
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": getattr(details, "cached_tokens", 0) or 0}
