from __future__ import annotations

import functools

import os
import sys

import pytest
import torch

# `python -m pytest` from the repository root puts the root on sys.path, where kernels/ would shadow
# the installed `kernels` package that transformers imports: take the root off (radixlm is
# installed; tests reach benchmarks/ by appending it). Child processes started with `-m` run
# from another folder for the same reason (helpers.MODULE_CWD).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
sys.path.insert(0, os.path.dirname(__file__))
if not torch.cuda.is_available():
    # Triton kernels run on a CPU only in its interpreter, which must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

from oracle import hf_greedy, random_prompts  # noqa: E402

# Property tests: a quick default for local runs; scripts/test.sh (and so CI) passes
# --hypothesis-profile=ci: many more examples, derandomized so a CI failure replays as is.
settings.register_profile("ci", max_examples=10_000, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("dev")

TINY_VOCAB = 512
NEW_TOKENS = 32

# LongRoPE over 12 of a 16-dimension head: 6 frequencies, each its own factor
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.0], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# Small shapes of each supported family; each exercises a different code path.
TINY_CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # Granite's four multipliers, each far from 1 so that one left out changes the tokens
    "granite": ("GraniteConfig", dict(tie_word_embeddings=True, embedding_multiplier=1.5, residual_multiplier=0.8,
                                      attention_multiplier=0.4, logits_scaling=2.0)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),  # post-norms, q/k norms over whole projections
    # 4 layers, the last without rotary (HF's default step, and llama.cpp's fixed one)
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4)),
    # sliding layers (a window far shorter than the prompts) beside global ones, each family's
    # pattern as llama.cpp fixes it; soft caps small enough to change the tokens (the final one
    # keeps their order: the logprob check is what sees it); Gemma 3's global layers on a
    # scaled rotary, its sliding ones on their own base; head_dim apart from hidden / heads
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                    attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0}})),
    # mixtures of experts: 4 experts, 2 a token, the routers' weights random (every expert is hit)
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # q/k/v and gate/up fused in the checkpoint; Phi-4's partial rotary (12 of 16 dimensions) under
    # LongRoPE's short factors (the context is the original one: no attention factor)
    "phi3": ("Phi3Config", dict(original_max_position_embeddings=1024, rope_parameters=PHI3_ROPE)),
    # a shared expert beside 4 routed ones, its sigmoid gate; HF's default: the top 2 not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, tie_word_embeddings=False)),
    # sinks, sliding layers (window 8) beside global ones, biases on attention's output, the
    # router and every expert; the clamped SwiGLU (its experts' gate/up scaled up so that the
    # clamp at 7 bites); YaRN past an original context of 64 (its ramp rounded, as llama.cpp's
    # is: the GGUF test reads the same)
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters=GPT_OSS_ROPE)),
}


def make_tiny_checkpoint(kind: str, path: str, vocab_size: int = TINY_VOCAB, **overrides) -> None:
    import transformers

    cls_name, extra = TINY_CONFIGS[kind]
    config = getattr(transformers, cls_name)(**{
        **dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1),
        **extra, **overrides})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF starts norm weights at one and biases at zero: a swapped or dropped one would not show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # gpt-oss's: about as large as the scores, so that they matter
                p.uniform_(-1.0, 2.0)
            elif name.endswith("experts.gate_up_proj"):  # gpt-oss's: its SwiGLU's clamps at +-7 reached
                p.mul_(6.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)


class TinyModel:
    def __init__(self, kind: str, path: str) -> None:
        import transformers

        self.kind, self.path = kind, path
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.prompts = random_prompts(TINY_VOCAB, 12, seed=7)
        # all share one 64-token prefix: decode batches take the shared-prefix (cascade) path
        self.shared_prompts = random_prompts(TINY_VOCAB, 8, seed=11, min_len=2, max_len=30, shared_prefix=64)
        self.shared_prompts = [self.shared_prompts[-1][:64] + p[-5:] for p in self.shared_prompts]
        self._model = None

    # HF's greedy decodings, made on first use (a test of its own prompts needs none of them)
    @functools.cached_property
    def refs(self):
        return hf_greedy(self.hf, self.prompts, NEW_TOKENS)

    @functools.cached_property
    def shared_refs(self):
        return hf_greedy(self.hf, self.shared_prompts, NEW_TOKENS)

    def engine(self, **kwargs):
        """An Engine over this checkpoint; every engine shares one copy of the weights."""
        from radixlm.runtime.local_engine import LocalEngine

        kwargs.setdefault("max_total_tokens", 8192)
        engine = LocalEngine(self.path, skip_tokenizer_init=True, model=self._model, **kwargs)
        self._model = engine.worker.model
        return engine


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory) -> TinyModel:
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    make_tiny_checkpoint(request.param, path)
    return TinyModel(request.param, path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyModel:
    path = str(tmp_path_factory.mktemp("tiny-llama-variations"))
    make_tiny_checkpoint("llama", path)
    return TinyModel("llama", path)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tiny random Qwen3 with a tokenizer and Qwen3's chat template (tiny_qwen3.py), one directory:
    for server tests of behaviour (start-up, shutdown, processes), which need no real weights and
    start in half SmolLM2's time."""
    from tiny_qwen3 import make_tiny_qwen3

    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    make_tiny_qwen3(path)
    return path


def smollm2_path() -> str:
    from radixlm.runtime.model_config import default_model_path

    return default_model_path()  # raises, naming the missing package, if setup did not install it


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer (byte-level BPE, from its GGUF), loaded once for the whole session."""
    from radixlm.runtime.tokenizer.loader import load_tokenizer
    from radixlm.runtime.model_config import resolve_model

    return load_tokenizer(resolve_model(None))


SMOL_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short tip for writing clean Python code.",
    "What is 17 times 23?",
]


class Smol:
    def __init__(self, tokenizer) -> None:
        from radixlm.runtime.hf_reference import load_hf_model
        from radixlm.runtime.local_engine import LocalEngine

        self.path = smollm2_path()
        # dequantized fp32: the weights HF runs, so greedy tokens and logprobs compare with it
        self.engine = LocalEngine(self.path, tokenizer=tokenizer, max_total_tokens=16384, quantization="none")
        tok = self.engine.tokenizer
        self.prompts = [tok.encode(self.engine.apply_chat_template([{"role": "user", "content": q}]),
                                   add_special_tokens=False) for q in SMOL_QUESTIONS]
        self.hf = load_hf_model(self.path)
        self.refs = hf_greedy(self.hf, self.prompts, NEW_TOKENS)

    def engine_with(self, **kwargs):
        from radixlm.runtime.local_engine import LocalEngine

        kwargs.setdefault("max_total_tokens", 16384)
        kwargs.setdefault("quantization", "none")
        return LocalEngine(self.path, model=self.engine.worker.model, tokenizer=self.engine.tokenizer, **kwargs)


@pytest.fixture(scope="session")
def smol(smol_tokenizer) -> Smol:
    return Smol(smol_tokenizer)


def _child_processes() -> list[tuple[int, str]]:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    children = []
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "resource_tracker" not in cmd:  # multiprocessing's helper lives as long as pytest
            children.append((pid, cmd))
    return children


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test module's fixtures are torn down, hand what they held back to the system: the
    engines and models a module loads are garbage once it ends, but the allocator keeps freed
    blocks on its heap, and the session's resident memory grew by gigabytes over the run (a CI
    run was killed for memory, 1,542 s in)."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        import gc

        from radixlm.runtime.launch import trim_heap

        gc.collect()
        trim_heap()


def pytest_sessionfinish(session, exitstatus):
    """No test may leave a runtime process behind."""
    import gc
    import time

    gc.collect()  # engines the tests dropped stop their helper processes when collected
    deadline = time.time() + 10
    while (left := _child_processes()) and time.time() < deadline:
        time.sleep(0.5)
    if left:
        print(f"\nERROR: processes left behind by the tests: {left}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def server(smol_tokenizer):
    """One live `radixlm serve` (SmolLM2) for the whole session: server and language tests share it.
    (SmolLM2's tokenizer is converted first, as a server after the first finds it: a tokenizer
    process that converts one imports torch, test_lifecycle.py's check.)"""
    from server.conftest import LiveServer

    # outlines: the server tests' exploding constraints ((a|b)*a(a|b){40}) are outlines-core's; the
    # default backend compiles them in milliseconds (tests/unit/test_grammar_backends.py and
    # tests/model/test_constrained_backends.py cover it). 120 s: an ordinary JSON schema took outlines
    # over 10 s on an AVX2-only CPU under load, and over 20 s on a loaded host (test_responses_api's
    # json_schema format); the constraints that never finish go to compile_limit_server
    srv = LiveServer("--constraint-timeout", "120", "--grammar-backend", "outlines")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()


COMPILE_LIMIT_S = 8


@pytest.fixture(scope="session")
def compile_limit_server():
    """A live server for the constraints that never finish compiling (outlines' DFA for
    (a|b)*a(a|b){40} has 2^41 states on any machine): a short --constraint-timeout, so each
    such test waits 8 s, not the shared server's 120."""
    from server.conftest import LiveServer

    srv = LiveServer("--constraint-timeout", str(COMPILE_LIMIT_S), "--grammar-backend", "outlines")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
