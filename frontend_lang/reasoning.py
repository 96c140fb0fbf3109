"""`separate_reasoning`: split a reasoning model's output into its thinking and its answer.

As in SGLang's frontend this runs on the client, on the finished text of a `gen`:
`<think>…</think>answer` becomes the variable `answer` and `{name}_reasoning_content`
holding the thinking. The split is the runtime's (`--reasoning-parser`, runtime/reasoning.py);
this file maps SGLang's model types onto its formats.
"""

from __future__ import annotations

from radixlm.runtime.reasoning import FORMATS, ReasoningFormat, Split, split_reasoning

# SGLang's model types that the server's parsers do not name: the same tags, opened by the
# chat template (toggle None: the output starts inside the block) or by the model
MODEL_TYPES: dict[str, ReasoningFormat] = {
    **FORMATS,
    "step3": ReasoningFormat("step3", "<think>", "</think>", toggle=None),
    "minimax": ReasoningFormat("minimax", "<think>", "</think>", toggle=None),
    "deepseek-v3": ReasoningFormat("deepseek-v3", "<think>", "</think>", toggle="thinking"),
    "glm45": ReasoningFormat("glm45", "<think>", "</think>", toggle="enable_thinking"),
    "kimi": ReasoningFormat("kimi", "◁think▷", "◁/think▷", toggle="thinking"),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    if not model_type:
        raise ValueError(f"separate_reasoning needs model_type, one of {', '.join(MODEL_TYPES)}")
    try:
        return MODEL_TYPES[model_type.lower()]
    except KeyError:
        raise ValueError(f"separate_reasoning knows the model types {', '.join(MODEL_TYPES)}, "
                         f"not {model_type!r}") from None


def separate(text: str, fmt: ReasoningFormat) -> Split:
    """(reasoning, answer) of a finished gen. As SGLang's frontend, with no chat template
    settings to read: a model whose template opens the block thinks; any other has a block only
    if its output opens one."""
    return split_reasoning(text, fmt, thinking=fmt.toggle is None)
