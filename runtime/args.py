"""Runtime configuration: one dataclass, filled from the command line or from keyword arguments."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixlm.runtime.cores import check_bind
from radixlm.runtime.reasoning import reasoning_format

if TYPE_CHECKING:
    from radixlm.runtime.model_config import ModelSource

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof")
ATTENTION_BACKENDS = ("torch", "native", "triton")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "fp8_e4m3")  # cache/kv_pool.py's KV_DTYPES, and auto
QUANT_GROUP_SIZES = (32, 64, 128, 256)
GRAMMAR_BACKENDS = ("outlines", "llguidance", "xgrammar")
CPU_STEP_TOKENS, CUDA_STEP_TOKENS = 256, 8192  # --chunked-prefill-size's defaults (see the field)
SPECULATIVE_METHODS = ("off", "auto", "ngram", "radix", "draft")


@dataclass
class ServerArgs:
    model_path: str | None = field(default=None, metadata={"help": "HF checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)"})
    served_model_name: str | None = field(default=None, metadata={"help": "the model name the OpenAI API reports and accepts (default: the file or directory name)"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "tokenizer directory if it differs from the model's"})
    load_format: str = field(default="auto", metadata={
        "help": "auto (the checkpoint's weights) or dummy (random weights of the config's shape, for benchmarks)"})
    dtype: str = field(default="auto", metadata={"help": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16"})
    quantization: str = field(default="auto", metadata={
        "help": "weights served as: auto (a GGUF file's own Q4_0/Q4_1/Q4_K/Q8_0 codes on radixlm's native CPU "
                "kernels, built on first use; dense checkpoints stay dense), none (dequantized to --dtype: HF's exact "
                "arithmetic, no native code), int8 (groups of 32) or int4 (in groups, see --quantization-group-size); "
                "CPU only"})
    quantization_group_size: int = field(default=32, metadata={
        "help": "columns per int4 scale and zero point for --quantization int4 (32, 64, 128 or 256)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "the KV cache's element type: auto (16 bits: on a CPU fp16 where it has F16C, every AVX2 CPU, else "
                "bf16, but fp32 where the weights are served exactly in fp32, --quantization none or a dense "
                "checkpoint, so that serving stays HF's arithmetic; on CUDA the model's dtype), fp32, fp16, bf16, "
                "int8 (a scale per row: a quarter of fp32's bytes and 4 more a row) or fp8_e4m3 (GPUs only: the "
                "triton and torch backends)"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    context_length: int | None = field(default=None, metadata={"help": "cap the model's context length"})
    page_size: int = field(default=0, metadata={"help": "tokens per KV page (0: 1 on CPU, 16 on CUDA)"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens (default: from --mem-fraction)"})
    mem_fraction: float = field(default=0.0, metadata={"help": "fraction of free memory for the KV pool (0: 0.15 on CPU, 0.85 on CUDA)"})
    max_running_requests: int = field(default=256, metadata={"help": "most requests decoding at once"})
    # auto, on a CPU 256: on a 2-core CPU a prefill token costs ~0.7 ms and a batch-32 decode step
    # ~70 ms, so a full budget (224 prefill tokens beside 32 decodes) delays each running request's
    # next token ~3x, once; larger budgets buy no throughput, as per-token cost is flat
    # (benchmarks/step_cost.py). On CUDA 8192 (SGLang's on large GPUs): a 256-token step of an 8B
    # model reads all its weights for ~4 TFLOP of work, far below what the GPU does in that time.
    chunked_prefill_size: int | None = field(default=None, metadata={
        "help": "token budget of one step: the running requests' tokens, then prefill in what is left "
                f"(default: {CPU_STEP_TOKENS} on a CPU, {CUDA_STEP_TOKENS} on CUDA); 0 or -1: no budget (whole "
                "prompts, up to --max-prefill-tokens, beside the decodes)"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "most tokens in one prefill batch"})
    schedule_policy: str = field(default="lpm", metadata={"help": "one of " + ", ".join(SCHEDULE_POLICIES)})
    disable_radix_cache: bool = field(default=False, metadata={"help": "no prefix sharing"})
    disable_window_pages: bool = field(default=False, metadata={
        "help": "sliding-window models: keep the sliding layers' K/V for the whole context, as the global "
                "layers' (by default they keep about a window of each request's)"})
    kv_tier_path: str | None = field(default=None, metadata={
        "help": "a folder for the KV cache's second tier: prefixes evicted from the pool are saved there and read "
                "back when a prompt continues them, also after a restart on the same model (off when unset)"})
    kv_tier_size: int = field(default=16 << 30, metadata={
        "help": "bytes the --kv-tier-path folder may hold; least recently used blocks are deleted past it"})
    disable_jump_forward: bool = field(default=False, metadata={
        "help": "decode text a constraint forces token by token instead of appending it in one step"})
    constraint_timeout: float = field(default=30.0, metadata={
        "help": "seconds a regex or JSON schema may take to compile before its request fails (400)"})
    grammar_backend: str = field(default="xgrammar", metadata={
        "help": "the library that compiles constraints and fills their token masks: " + ", ".join(GRAMMAR_BACKENDS)
                + " (ebnf grammars need xgrammar or llguidance; see benchmarks/README.md for the choice)"})
    speculative: str = field(default="off", metadata={
        "help": "speculative decoding: off; ngram (drafts from the request's own prompt and output), radix (from "
                "everything the prefix cache holds), each on every step; or auto (both, on the steps where the "
                "measured step cost and each request's acceptance rate say it pays: it switches itself off under load); "
                "draft (from a smaller model of the same tokenizer, --speculative-draft-model)"})
    lora_paths: list[str] | None = field(default=None, metadata={
        "help": "LoRA adapters (PEFT format) served beside the base model: name=path ... (or path: named by "
                "its folder); a request names one (native lora_path, OpenAI model)"})
    enable_runtime_lora_updates: bool = field(default=False, metadata={
        "help": "let /load_lora_adapter and /unload_lora_adapter change the adapters served (a load reads the "
                "folder a request names on this machine): off by default, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING"})
    max_loras_per_batch: int = field(default=8, metadata={"help": "most distinct adapters in one step"})
    max_lora_rank: int = field(default=64, metadata={"help": "largest LoRA rank accepted"})
    max_loaded_loras: int = field(default=0, metadata={
        "help": "most adapters kept in memory (0: all): the least recently used one not in the step is "
                "dropped and read from disk again when a request names it"})
    speculative_draft_model: str | None = field(default=None, metadata={
        "help": "HF checkpoint directory or .gguf file of the draft model for --speculative draft (implies it): "
                "a smaller model with the target's vocabulary, its KV in the target's pages"})
    speculative_num_draft_tokens: int = field(default=8, metadata={
        "help": "most tokens proposed for one request in one step"})
    speculative_max_batch_size: int = field(default=8, metadata={
        "help": "auto speculates only while at most this many requests decode: on 2 CPU cores a step's cost grows "
                "with its tokens from about 8 rows on, and the measured costs are too noisy to find the small gains "
                "left there (benchmarks/README.md)"})
    overlap_schedule: str = field(default="auto", metadata={
        "help": "run the scheduler's work for the next step while the model runs this one (SGLang's overlap "
                "scheduler): on, off, or auto (on with CUDA; off on a CPU, where the model's threads need the "
                "cores the scheduler would take: benchmarks/README.md)"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "the same as --overlap-schedule off"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={
        "help": "decode steps of up to this many requests replay a CUDA graph captured per batch-size bucket "
                "(CUDA only; default: --max-running-requests, so that every decode step replays one)"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run every decode step eagerly on CUDA"})
    attention_backend: str = field(default="auto", metadata={
        "help": "torch, native (radixlm's CPU kernels: rotary fused with the K/V store, decode and extend attention) or triton "
                "(auto: triton on CUDA; on CPU native where the weights are served on the native kernels, else torch)"})
    linear_kernel: str = field(default="auto", metadata={
        "help": "the CPU matmul kernel of dense weights: torch (F.linear, MKL), onednn, or auto (oneDNN wherever torch has "
                "it on a CPU, bf16 only where the CPU multiplies it natively; else torch)"})
    deterministic: bool = field(default=False, metadata={
        "help": "batch-invariant: a request's tokens and logprobs bitwise the same whatever it shares a step with, "
                "however its prompt is chunked and whatever the cache holds (greedy or seeded sampling; slower)"})
    random_seed: int = field(default=0, metadata={"help": "seed of the global sampling generator"})
    init_new_token_ratio: float = field(default=0.7, metadata={"help": "share of max_new_tokens reserved per running request at admission"})
    min_new_token_ratio: float = field(default=0.1, metadata={"help": "floor that the reserved share decays to"})
    new_token_ratio_decay: float = field(default=0.001, metadata={"help": "decay of the reserved share per decode step"})
    debug_accounting: bool = field(default=False, metadata={"help": "check KV accounting after every step (slow)"})
    skip_tokenizer_init: bool = field(default=False, metadata={"help": "load no tokenizer: token ids in and out only"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks (processes; one GPU each on CUDA)"})
    nnodes: int = field(default=1, metadata={"help": "machines the tensor-parallel ranks span (see docs/distributed.md)"})
    node_rank: int = field(default=0, metadata={"help": "this machine's place among --nnodes (0 runs the scheduler and the API)"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where node 0 meets the other ranks (default on one machine: a free local port)"})
    dist_timeout: int = field(default=600, metadata={"help": "seconds a rank waits on the others before giving up"})
    num_threads: int = field(default=0, metadata={
        "help": "torch CPU threads of each process that runs the model (0: the physical cores of its --cpu-bind "
                "share; with --cpu-bind none, torch's default)"})
    cpu_bind: str = field(default="auto", metadata={
        "help": "on a CPU, the cores of this machine's tensor-parallel ranks (radixlm router --dp-size: of its "
                "replicas): auto (the cores this process may use, split evenly, each rank pinned to its share), "
                "none (no pinning), or core lists, one per process or one to split: 0-3|4-7"})
    incremental_streaming_output: bool = field(default=False, metadata={
        "help": "native /generate streams send only what is new in each chunk (default, as SGLang: the text, "
                "output ids and output logprobs so far)"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "the model's reasoning format (qwen3, qwen3-thinking, deepseek-r1; gpt-oss: its harmony channels, "
                "tool calls included): chat answers carry the reasoning as reasoning_content, and constraints start "
                "after it"})

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS + ("auto",):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {QUANT_GROUP_SIZES}, "
                             f"got {self.quantization_group_size}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {self.grammar_backend!r}")
        if self.linear_kernel not in ("auto", "torch", "onednn"):
            raise ValueError(f"linear_kernel must be auto, torch or onednn, got {self.linear_kernel!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if self.lora_paths:
            names = [name for name, _ in self.lora_adapters()]
            if len(set(names)) != len(names):
                raise ValueError(f"--lora-paths names an adapter twice: {names}")
            if self.tp_size > 1:
                raise ValueError("LoRA adapters run with --tp-size 1 only")
        if self.max_loras_per_batch < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be >= 1")
        if self.speculative_draft_model is not None and self.speculative == "off":
            self.speculative = "draft"
        if (self.speculative == "draft") != (self.speculative_draft_model is not None):
            raise ValueError("--speculative draft and --speculative-draft-model go together "
                             f"(got --speculative {self.speculative} and --speculative-draft-model "
                             f"{self.speculative_draft_model})")
        if self.speculative == "draft" and self.tp_size > 1:
            raise ValueError("--speculative-draft-model runs with --tp-size 1 only")
        if self.kv_tier_path is not None:
            if self.kv_tier_size <= 0:
                raise ValueError("kv_tier_size must be > 0 bytes")
            if self.disable_radix_cache:
                raise ValueError("--kv-tier-path keeps what the radix cache evicts: not with --disable-radix-cache")
            if self.tp_size > 1:
                raise ValueError("--kv-tier-path runs with --tp-size 1 only")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.disable_overlap_schedule:
            self.overlap_schedule = "off"
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs must be >= 1")
        if self.speculative_max_batch_size < 1:
            raise ValueError("speculative_max_batch_size must be >= 1")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        if self.page_size < 0:
            raise ValueError("page_size must be >= 0")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.tp_size < 1 or self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a positive multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must lie in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("several nodes need --dist-init-addr host:port (node 0's address)")
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)  # raises, naming the known ones
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        check_bind(self.cpu_bind)

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this machine runs (rank 0 is the scheduler's)."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def chunk_size(self, device_type: str) -> int | None:
        """The token budget of one step on a device of `device_type`, or None when there is none
        (chunking off)."""
        if self.chunked_prefill_size is None:
            return CUDA_STEP_TOKENS if device_type == "cuda" else CPU_STEP_TOKENS
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            if str(f.type).startswith("list"):
                parser.add_argument(flag, nargs="*", default=f.default, help=help_text)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            parser.add_argument(flag, type=kind, default=f.default, help=help_text)

    def to_cli_args(self) -> list[str]:
        """The flags that give these options (those that differ from the defaults)."""
        flags = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                flag = "--" + f.name.replace("_", "-")
                flags += [flag] if value is True else [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
        return flags

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora-paths entry."""
        return lora_adapters(self.lora_paths)

    def served_name(self, source: ModelSource) -> str:
        """The name the model served from `source` answers to: --served-model-name, or its file's."""
        return self.served_model_name or source.name

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown runtime option(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)


def lora_adapters(entries: list[str] | None) -> list[tuple[str, str]]:
    """(name, path) of each --lora-paths entry: name=path, or a path named by its last folder."""
    out = []
    for entry in entries or []:
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(entry)), entry
        out.append((name, path))
    return out
