"""Role markers for programs: what `user(...)` and friends put around their text.

A backend that knows its model hands over the tokenizer's Jinja template; we
recognise its family (ChatML, Llama 3) and take the default system prompt it
inserts, so that a program's text is exactly what the model's own template
would render. Anything else gets the plain template.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    prefix: dict[str, str]  # role -> text before its content
    suffix: dict[str, str]  # role -> text after it
    stop: tuple[str, ...] = ()  # end-of-turn strings, added to every gen in an assistant turn
    default_system: str | None = None  # the system turn the model's template adds when a chat has none
    roles: tuple[str, ...] = field(default=("system", "user", "assistant"))


CHATML = ChatTemplate(
    "chatml",
    prefix={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")},
    suffix={r: "<|im_end|>\n" for r in ("system", "user", "assistant")},
    stop=("<|im_end|>",),
)
LLAMA3 = ChatTemplate(
    "llama-3",
    prefix={r: f"<|start_header_id|>{r}<|end_header_id|>\n\n" for r in ("system", "user", "assistant")},
    suffix={r: "<|eot_id|>" for r in ("system", "user", "assistant")},
    stop=("<|eot_id|>",),
)
PLAIN = ChatTemplate(
    "plain",
    prefix={"system": "System: ", "user": "User: ", "assistant": "Assistant: "},
    suffix={r: "\n" for r in ("system", "user", "assistant")},
)
TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, PLAIN)}


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {', '.join(TEMPLATES)}") from None


def from_model(jinja: str | None, bos_token: str | None = None) -> ChatTemplate:
    """The registry template matching a tokenizer's Jinja chat template, with its default system prompt."""
    if not jinja:
        return PLAIN
    if "<|im_start|>" in jinja:
        base = CHATML
    elif "<|start_header_id|>" in jinja:
        base = LLAMA3
    else:
        return PLAIN
    # a template's BOS before its first turn (Llama 3's) is left out of a program's text: the runtime
    # adds it, as it adds it to every text prompt (the tokenizer's special tokens, as SGLang's
    # frontend relies on too). (ChatML's BOS, SmolLM2's <|im_start|>, is the turns' own marker.)
    head = _render(jinja, [{"role": "user", "content": "\x00"}], bos_token)
    if not head.startswith(tuple(base.prefix.values())):
        head = head.removeprefix(bos_token or "")
    default_system = None
    if head.startswith(base.prefix["system"]):
        default_system = head[len(base.prefix["system"]):].split(base.suffix["system"], 1)[0]
    return ChatTemplate(base.name, base.prefix, base.suffix, base.stop, default_system)


def _render(jinja: str, messages: list[dict[str, str]], bos_token: str | None) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(jinja).render(messages=messages, bos_token=bos_token or "", eos_token="",
                                         add_generation_prompt=False)
