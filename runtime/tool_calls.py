"""Tool (function) calling in chat: how tools reach the prompt, how calls are forced, how they are read back.

Prompt. A chat template that knows about tools (its source mentions ``tools``,
as Qwen2.5's, Llama 3.1's and Hermes' templates do) gets the tool list and the
history's calls and results in transformers' convention (``arguments`` as an
object, tool results as ``tool`` turns). Any other template gets plain text:
a system-prompt section that lists the tools and asks for calls written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; earlier calls
are written that way in their assistant turns, and results come back as user
turns wrapped in ``<tool_response>`` tags.

Output, by ``tool_choice``:

* ``none``: plain text, nothing is parsed;
* ``auto``: free text. ``<tool_call>`` blocks holding a JSON object that names
  a known tool are calls (where some tools are ``strict``, a block the model
  opens must hold a valid call of one of them: see `strict_tag`), and the text
  around them is the content. So is an
  output that is nothing but calls in bare JSON (one object or an array, with
  ``arguments`` or ``parameters``, after Mistral's ``[TOOL_CALLS]``, Llama
  3.1's ``<|python_tag|>``, Granite 3's ``<|tool_call|>`` or Phi-4-mini's
  ``functools`` if present);
* ``required``: decoding is constrained to a JSON array of ``{"name",
  "arguments"}`` objects, each matching one tool's parameter schema (one item
  unless parallel calls are allowed), read back as bare calls, as under ``auto``;
* one named function: decoding is constrained to that function's arguments
  object, which is the output itself.

Free of torch and of the server, so the tokenizer process and the HTTP layer
can both use it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# ------------------------------------------------------------------ prompt


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and tools argument) to render with `template`.

    `messages` are OpenAI-shaped: assistant turns may carry ``tool_calls`` (with
    ``arguments`` already parsed into objects) and ``tool`` turns a
    ``tool_call_id``. A template that knows tools gets them as they are (tool
    turns also get the called function's ``name``); for any other, calls,
    results and the tool list become text.
    """
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not uses_tools:
        return messages, None
    if template_knows_tools(template):
        return _named_results(messages), tools or None
    out = [_as_text(m) for m in messages]
    if tools:
        section = _tools_section(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def _named_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    return [{**m, "name": names[m["tool_call_id"]]}
            if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names else m
            for m in messages]


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = [f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{CLOSE}"
               for c in calls]
    text = "\n".join(([message["content"]] if message.get("content") else []) + written)
    return {"role": message["role"], "content": text}


def _tools_section(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("# Tools\n\nYou can call these functions, each described by a JSON schema of its arguments:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call one, answer with its name and arguments as a JSON object between tags, "
            f'one block per call:\n{OPEN}\n{{"name": "the function", "arguments": {{...}}}}\n{CLOSE}\n'
            "The results will come back in <tool_response> tags.")


# -------------------------------------------------------- forcing a call


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of `tool`: its name and its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The JSON schema of `tool_choice="required"`'s output: an array of calls."""
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": [_call_schema(t) for t in tools]}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return json.dumps(array)


def strict_tag(tools: list[dict[str, Any]]) -> str | None:
    """Under `auto`, the structural tag that holds the calls of the tools marked ``strict`` to their
    schemas once the model opens a ``<tool_call>`` (the text around stays free), or None when no
    tool is strict."""
    strict = [t for t in tools if t["function"].get("strict")]
    if not strict:
        return None
    return json.dumps({"type": "structural_tag", "triggers": [OPEN], "structures": [
        {"begin": OPEN + "\n", "schema": _call_schema(t), "end": "\n" + CLOSE} for t in strict]})


def named_schema(tool: dict[str, Any]) -> str:
    """The JSON schema of a named tool_choice's output: that function's arguments."""
    return json.dumps(_parameters(tool))


# ------------------------------------------------------------ reading calls


def parse_auto(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free-text output. A block that is not a call of a known tool stays text."""
    rest, calls = _split(text, names, parallel)
    content = rest.strip() if calls else rest
    return content or None, calls


def _split(text: str, names: set[str], parallel: bool) -> tuple[str, list[ToolCall]]:
    """The text outside the calls, and the calls (only the first unless parallel)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1), names)
        if call is None:
            continue
        kept.append(text[at:block.start()])
        at = block.end()
        if parallel or not calls:  # a call past the first, when only one is allowed, is dropped
            calls.append(call)
    if not calls:
        bare = _bare_calls(text, names, parallel)
        return ("", bare) if bare else (text, [])
    return "".join(kept) + text[at:], calls


# What a family's template has its model write before bare JSON calls: Mistral's, Llama 3.1's,
# Granite 3's, Phi-4-mini's (`functools[...]`)
_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "functools")


def _bare_calls(text: str, names: set[str], parallel: bool) -> list[ToolCall] | None:
    """The calls of an output that is nothing but calls in JSON, after an optional marker: one
    object, or an array of them (the shape `required` forces)."""
    body = text.strip()
    for marker in _MARKERS:
        body = body.removeprefix(marker).lstrip()
    obj = _json(body)
    if obj is None:
        return None
    calls = [_call_object(item, names) for item in (obj if isinstance(obj, list) else [obj])]
    if not calls or None in calls:
        return None
    return calls if parallel else calls[:1]


def _may_be_bare(text: str) -> bool:
    """Whether `text` may still turn out to be bare calls (so a stream must not send it yet)."""
    body = text.lstrip()
    return not body or body[0] in "{[" or any(m.startswith(body[: len(m)]) for m in _MARKERS)


def _call(text: str, names: set[str]) -> ToolCall | None:
    return _call_object(_json(text), names)


def _json(text: str) -> Any:
    """The JSON value `text` holds, or None when it holds none (so it stays text). A model writes
    anything: what no JSON answer can carry (NaN and Infinity, which Python's parser takes; a lone
    surrogate escape such as \\ud800, which UTF-8 cannot encode) and nesting deeper than the
    parser's recursion limit are no JSON here."""
    try:
        value = json.loads(text, parse_constant=_not_json)
        json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # (JSONDecodeError and UnicodeEncodeError are ValueErrors)
        return None
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _call_object(obj: Any, names: set[str]) -> ToolCall | None:
    """The call `obj` is: a JSON object naming a known tool (a name that is no string, an object
    or a list, names none) with an object of arguments."""
    if not isinstance(obj, dict) or not isinstance(name := obj.get("name"), str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args))


class AutoStream:
    """Splits a streamed `auto` output into content to send now and calls read at the end.

    Text is sent as it comes, except what may begin a call: from a ``<tool_call>``
    tag on (or a partial tag at the end), or an output that opens like bare JSON
    calls (``{``, ``[`` or a marker), is held back and parsed when the output is done.
    """

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names, self.parallel = names, parallel
        self.text = ""  # everything so far
        self.sent = 0  # of which this much went out as content

    def feed(self, delta: str) -> str:
        """Content that can go out now."""
        self.text += delta
        if self.sent == 0 and _may_be_bare(self.text):
            return ""
        tag = self.text.find(OPEN, self.sent)
        end = tag if tag >= 0 else len(self.text) - _partial_tag(self.text)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held back, and the calls."""
        rest, calls = _split(self.text[self.sent:], self.names, self.parallel)
        return ("" if calls and not rest.strip() else rest), calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could be the start of OPEN."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
