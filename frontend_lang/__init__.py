"""radixlm's language for LLM programs (SGLang's frontend primitives).

    import radixlm as rl

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    rl.set_default_backend(rl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="Capital of France?")["answer"])
"""

from radixlm.lang.api import (
    Function,
    GlobalConfig,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    global_config,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.backends.base import Backend, BackendError
from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.interpreter import ForkGroup, ProgramError, ProgramState


def Runtime(model_path=None, attach=None, **server_args):  # noqa: N802 - a class to its users; imported late (torch)
    """A local runtime in the background (or a running server's, `attach=url`), over ZeroMQ; see backends/runtime.py.
    SGLang's `log_level` and `launch_timeout` are accepted (ours logs as configured and waits until ready)."""
    from radixlm.lang.backends.runtime import Runtime as _Runtime

    server_args.pop("launch_timeout", None)
    server_args.pop("log_level", None)
    return _Runtime(model_path, attach, **server_args)


def OpenAI(model, base_url=None, api_key=None, is_chat_model=True, chat_template="plain"):  # noqa: N802
    """Any OpenAI-compatible server; see backends/openai_backend.py."""
    from radixlm.lang.backends.openai_backend import OpenAI as _OpenAI

    return _OpenAI(model, base_url, api_key, is_chat_model, chat_template)


def _unavailable(name: str):
    def backend(*args, **kwargs):
        raise NotImplementedError(f"{name}: radixlm has no {name} backend; OpenAI(model, base_url=...) talks to "
                                  "any OpenAI-compatible server or proxy")

    backend.__name__ = name
    return backend


Anthropic, Crusoe, LiteLLM, VertexAI = (_unavailable(n) for n in ("Anthropic", "Crusoe", "LiteLLM", "VertexAI"))

__all__ = [
    "Anthropic", "Backend", "BackendError", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "Crusoe",
    "ForkGroup", "Function", "GlobalConfig", "LiteLLM", "OpenAI", "ProgramError", "ProgramState", "Runtime",
    "RuntimeEndpoint", "VertexAI", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_chat_template", "get_default_backend", "get_server_info", "global_config",
    "greedy_token", "greedy_token_selection", "image", "select", "separate_reasoning", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user",
    "user_begin", "user_end", "video",
]
