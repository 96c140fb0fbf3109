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
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    greedy_token,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
from radixlm.lang.backends.base import Backend, BackendError
from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.interpreter import ForkGroup, ProgramError, ProgramState


def Runtime(model_path=None, attach=None, **server_args):  # noqa: N802 - a class to its users; imported late (torch)
    """A local runtime in the background (or a running server's, `attach=url`), over ZeroMQ; see backends/runtime.py."""
    from radixlm.lang.backends.runtime import Runtime as _Runtime

    return _Runtime(model_path, attach, **server_args)


def OpenAI(model, base_url=None, api_key=None, is_chat_model=True, chat_template="plain"):  # noqa: N802
    """Any OpenAI-compatible server; see backends/openai_backend.py."""
    from radixlm.lang.backends.openai_backend import OpenAI as _OpenAI

    return _OpenAI(model, base_url, api_key, is_chat_model, chat_template)


__all__ = [
    "Backend", "BackendError", "ChatTemplate", "ForkGroup", "Function", "OpenAI", "ProgramError", "ProgramState",
    "Runtime",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "function", "gen", "gen_int", "gen_string",
    "get_chat_template", "get_default_backend", "greedy_token", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user",
    "user_begin", "user_end",
]
