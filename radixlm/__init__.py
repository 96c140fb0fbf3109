"""radixlm: a prefix-sharing, structured-generation LLM runtime.

    import radixlm as rl

    engine = rl.Engine()                      # the runtime in background processes (or rl.LocalEngine())
    print(engine.generate("The capital of France is", {"max_new_tokens": 8})["text"])

    @rl.function                              # the language: SGLang's primitives
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

The packages: `radixlm.runtime` (processes, scheduler, model worker, servers), `radixlm.kernels`
(Triton attention, and the native CPU library in `radixlm.kernels.cpu`) and `radixlm.lang` (the language, re-exported here, so SGLang programs run with
`import radixlm as sgl`).
"""

import os
import sys
from importlib import import_module

__version__ = "0.1.0"

# Run from this repository's folder (`python -m`, `python -c`, a runtime process started by `-m`
# from here), Python puts the folder first on sys.path, where its kernels/ would shadow the
# installed `kernels` package that transformers imports. radixlm is installed (its folders are
# mapped into `radixlm`), so it takes that entry off on import, before anything loads transformers.
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_REPOSITORY, "kernels", "cpu", "build.py")):  # a source checkout, not site-packages
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPOSITORY]

# What `radixlm.<name>` gives, and from where. Imported on first use, so `import radixlm.runtime...`
# (every runtime process does) loads neither the language nor the engines.
_ENGINES = {"Engine": "radixlm.runtime.engine", "LocalEngine": "radixlm.runtime.local_engine"}


def __getattr__(name: str):
    if name in _ENGINES:
        return getattr(import_module(_ENGINES[name]), name)
    language = import_module("radixlm.lang")
    if name == "__all__":  # `from radixlm import *`
        return [*_ENGINES, *language.__all__]
    if name in language.__all__:
        return getattr(language, name)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__getattr__("__all__")])
