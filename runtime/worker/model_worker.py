"""The model worker: loads the model, owns the KV pool, and turns one scheduled batch into tokens."""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from radixlm.kernels.cpu.build import cpu_flags
from radixlm.runtime.args import ServerArgs
from radixlm.runtime.cache.kv_pool import KVDtype, KVPool, ReqToTokenTable, kv_dtype
from radixlm.runtime.model_config import ModelConfig, ModelSource, load_config, resolve_model, weights_fingerprint
from radixlm.runtime.worker import gemm, lora, quant
from radixlm.runtime.worker.attention.base import AttentionBackend
from radixlm.runtime.worker.cuda_graph import DecodeGraphRunner, graph_batch_limit
from radixlm.runtime.worker.draft_model import DraftModel
from radixlm.runtime.worker.forward_batch import FUTURE_BASE, ForwardBatch, WorkerBatch
from radixlm.runtime.worker.layers import fit_positions, materialize_all, use_native_ops
from radixlm.runtime.worker.loader import iter_weights
from radixlm.runtime.worker.models.llama import ARCHITECTURES
from radixlm.runtime.worker.native_decoder import NativeDecoder
from radixlm.runtime.worker.parallel import SINGLE, TPContext, receive_batch, send_batch
from radixlm.runtime.worker.sampler import Sampler

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Readback:
    """A step's sampled tensors on their way to the host, read as lists when first needed: on CUDA
    copied into pinned memory without waiting, an event recorded after the copies, so the step
    thread returns as soon as the step is launched and launches the next one behind it (the GPU
    never waits on the host between overlapped steps); the scheduler waits on the event when it
    takes the step back (`WorkerOutput.settle`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.host = {name: t.to("cpu", non_blocking=True) for name, t in tensors.items()}  # pinned on CUDA
        self.done = None
        if any(t.is_cuda for t in tensors.values()):
            self.done = torch.cuda.Event()
            self.done.record()

    def lists(self) -> dict[str, list]:
        if self.done is not None:
            self.done.synchronize()
        return {name: t.tolist() for name, t in self.host.items()}


@dataclass
class WorkerOutput:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[float]] | None = None
    top_logprob_ids: list[list[int]] | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top_logprob_ids: list[list[int]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)  # each prompt target's rank in its row (from 1)
    drafts: list[list[int]] = field(default_factory=list)  # the draft model's, per WorkerBatch.draft_rows
    embed_hidden: torch.Tensor | None = None  # [E, hidden] float32 on the CPU, per WorkerBatch.embed_rows
    pending: Readback | None = None  # the sampled fields above, still on their way (read by `settle`)

    def settle(self) -> WorkerOutput:
        """The sampled fields as lists, waiting for their copies where they are still pending."""
        if self.pending is not None:
            for name, value in self.pending.lists().items():
                setattr(self, name, value)
            self.pending = None
        return self


def pick_device(name: str, tp: TPContext = SINGLE) -> torch.device:
    """The device named (auto: CUDA when there is one); a tensor-parallel rank takes its own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and tp.size > 1:
        return torch.device("cuda", torch.cuda.current_device())  # init_group chose it
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":  # bf16 on CPU is several times slower than fp32 for these shapes
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


class ModelWorker:
    def __init__(self, args: ServerArgs, source: ModelSource, tp: TPContext = SINGLE,
                 model: torch.nn.Module | None = None, draft_model: torch.nn.Module | None = None) -> None:
        """`model`, `draft_model`: weights already loaded from `source` and from
        `args.speculative_draft_model` (tests and benchmarks share one copy between workers of
        different cache layouts); loaded from those paths when None."""
        self.args = args
        self.tp = tp
        self.device = pick_device(args.device, tp)
        self.dtype = pick_dtype(args.dtype, self.device)
        if args.num_threads > 0:
            torch.set_num_threads(args.num_threads)
        self.source = source
        self.config: ModelConfig = load_config(source)
        self.model = model if model is not None else self._load_model(source, self.config, tp)
        self.quantization: quant.Summary = self._quantization(self.model)
        self.draft_config: ModelConfig | None = None
        if args.speculative_draft_model is not None:
            draft_source = resolve_model(args.speculative_draft_model)
            self.draft_config = self._draft_config(draft_source)
            if draft_model is None:
                draft_model = self._load_model(draft_source, self.draft_config, tp)
            self._quantization(draft_model)
        self.context_length = min(self.config.context_length, args.context_length or 1 << 62)
        self.page_size = args.page_size or (16 if self.device.type == "cuda" else 1)
        self.kv_dtype = self._kv_dtype()
        self.num_pages = self._pool_pages()
        if tp.size > 1:  # every rank's pool must have the same slots: the smallest wins
            agreed = torch.tensor([self.num_pages], device=self.device)
            dist.all_reduce(agreed, dist.ReduceOp.MIN, group=tp.group)
            self.num_pages = int(agreed)
        cfg = self.config
        self.kv_pool = self._kv_pool(cfg)
        # sliding layers keep their K/V in window pages (cache/allocator.WindowedPageAllocator), with
        # one rank (each would need the window rows), no draft model (its own layers) and no KV tier
        # (it saves every layer of a page)
        windowed = (cfg.sliding_window is not None and tp.size == 1 and draft_model is None
                    and args.kv_tier_path is None and not args.disable_window_pages)
        # the positions a request can reach, and one more (a token-table row's width): below its
        # length, which the pool bounds (every token of it has a slot) unless sliding layers keep
        # only their window's
        reach = self.context_length if windowed else min(self.context_length, self.num_pages * self.page_size)
        self.positions = reach + 1
        self.req_to_token = ReqToTokenTable(args.max_running_requests + 1, self.positions, self.device, windowed=windowed)
        fit_positions(self.model, self.positions, exactly=model is None)
        if draft_model is not None:
            fit_positions(draft_model, self.positions, exactly=False)
        self.attn_backend = self._attention_backend()
        self.linear_mode = self._linear_mode(self.model)
        self.pad_slot = self.num_pages * self.page_size  # in the pool's spare page: padding rows write here
        self.draft: DraftModel | None = None
        if draft_model is not None:
            self.draft = DraftModel(draft_model, self._linear_mode(draft_model), self._kv_pool(self.draft_config),
                                    self.attn_backend)
        self.graph_runner = self._graph_runner()
        self.native_decoder = NativeDecoder.build(self)
        # the adapters served, by name: the one table of them, changed by control.py between steps
        self.loras: dict[str, lora.LoraAdapter] = {}
        self._lora_stacks: dict = {}  # the last step's set of adapters' stacked pairs, per projection
        self._lora_clock = itertools.count(1)  # each use of an adapter's turn (LoraAdapter.last_used)
        self.sampler = Sampler()
        self._sampled = torch.zeros(1, dtype=torch.int64, device=self.device)  # the latest step's tokens
        torch.manual_seed(args.random_seed)

    # ---- set-up ------------------------------------------------------------------------------

    def _load_model(self, source: ModelSource, config: ModelConfig, tp: TPContext) -> torch.nn.Module:
        """The model as --quantization serves it: its parameters made empty (meta), then each read
        straight into its served layout as the file is read (quant.plan_serving; layers.py), so
        no float32 copy of a quantized model is ever held."""
        model_cls = ARCHITECTURES[config.architecture]
        method, group = self.args.quantization, self.args.quantization_group_size
        if self.args.load_format == "dummy":
            with torch.device(self.device):  # made where it runs: an 8B model never passes through host memory
                model = model_cls(config, tp)
                materialize_all(model, self.device)
            for name, param in model.named_parameters():  # small random weights, unit norms: finite activations
                if name.endswith("norm.weight"):
                    param.data.fill_(1.0)
                else:
                    param.data.normal_(0.0, 0.02)
            model = model.to(self.dtype)
            kernels = quant.quantize_dense(model, method, group, self.device)
        else:
            model = model_cls(config, tp)
            kernels = quant.plan_serving(model, method, group, self.device)
            model.load_weights(iter_weights(source, config))
        model = model.to(device=self.device, dtype=self.dtype).eval()
        quant.summarize(model, (method, group), kernels, self.dtype)
        return model

    def _draft_config(self, source: ModelSource) -> ModelConfig:
        """The draft model's config, once it is known to speak the target's vocabulary."""
        draft = load_config(source)
        if draft.vocab_size != self.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
                             f"{self.config.vocab_size}: a draft model must share the target's tokenizer")
        return draft

    def _quantization(self, model: torch.nn.Module) -> quant.Summary:
        """How the weights are served (decided as they were loaded: a model shared between workers
        keeps the first one's, which must be what this one asks for)."""
        asked = (self.args.quantization, self.args.quantization_group_size)
        done: quant.Summary = model.quantization
        if done.requested != asked:
            raise ValueError(f"the shared model is served as --quantization {done.requested[0]} "
                             f"(group {done.requested[1]}), not {asked[0]} (group {asked[1]})")
        if done.kernels != "none":
            use_native_ops(model)
        log.info("weights: %s, %.1f MB (%s); native CPU kernels: %s", done.method, done.weight_bytes / 1e6,
                 "; ".join(f"{k}: {v}" for k, v in done.formats.items()), done.kernels)
        if done.kernels_failure:
            log.warning("the weights are served dense, %.1f MB (several times the file's quantized size, and "
                        "slower), because the native CPU kernels could not be built here: %s. Fix that and start "
                        "again, or pass --quantization none to serve dense weights on purpose",
                        done.weight_bytes / 1e6, done.kernels_failure)
        return done

    def _kv_pool(self, cfg: ModelConfig) -> KVPool:
        """The pages the allocator hands out, and one spare that no request owns: where a CUDA
        graph's padding rows write their K/V (`pad_slot`)."""
        return KVPool(cfg.num_layers, (self.num_pages + 1) * self.page_size, self.tp.kv_heads(cfg.num_kv_heads)[0],
                      cfg.head_dim, self.kv_dtype, self.device)

    def _kv_dtype(self) -> KVDtype:
        """The pool's element type: --kv-cache-dtype, `auto` resolved from the facts (ServerArgs'
        help), refused by name where it cannot run."""
        name = self.args.kv_cache_dtype
        if name == "auto":
            name = self._auto_kv_dtype()
        kv = kv_dtype(name)
        if kv.name == "fp8_e4m3" and self.device.type != "cuda":
            raise ValueError("--kv-cache-dtype fp8_e4m3 runs on GPUs only (the CPU kernels have no fp8 path): "
                             "on a CPU use int8, fp16 or bf16")
        if kv.scaled:
            odd = [c for c in [self.config, self.draft_config] if c is not None and c.head_dim % 4]
            if odd:
                raise ValueError(f"--kv-cache-dtype int8 keeps each row's fp32 scale after its codes, 4-byte "
                                 f"aligned: it needs a head dimension divisible by 4, not {odd[0].head_dim}")
        return kv

    def _auto_kv_dtype(self) -> str:
        """16 bits, but fp32 where the weights are served exactly in fp32 (HF's arithmetic: greedy
        tokens and logprobs as HF's, to 1e-4; a 16-bit KV moves logprobs by ~1e-3). fp16 keeps 3
        more bits than bf16 (benchmarks/README.md: its agreement with HF is the closer), and its
        conversion is one F16C instruction, which every AVX2 CPU has; without F16C (the portable
        path) bf16, whose conversion is a shift. Every tensor-parallel rank takes the same."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return kv_dtype(self.dtype).name
        if self.quantization.method == "none":
            return "fp32"
        f16c = torch.tensor([int("f16c" in cpu_flags())])
        if self.tp.size > 1:
            dist.all_reduce(f16c, dist.ReduceOp.MIN, group=self.tp.group)
        return "fp16" if int(f16c) else "bf16"

    def _graph_runner(self) -> DecodeGraphRunner | None:
        """Decode steps replayed from CUDA graphs (cuda_graph.py): on CUDA, unless --disable-cuda-graph,
        for the Triton backend with one rank and no draft model (the batch-invariant kernels plan
        on the host)."""
        if self.device.type != "cuda" or self.args.disable_cuda_graph:
            return None
        from radixlm.runtime.worker.attention.triton_backend import TritonAttention

        if self.tp.size > 1 or self.draft is not None or not isinstance(self.attn_backend, TritonAttention):
            log.info("CUDA graphs are off: they run with the triton attention backend, one rank and no draft model")
            return None
        runner = DecodeGraphRunner(self, graph_batch_limit(self.args))
        runner.capture()
        return runner

    def _pool_pages(self) -> int:
        models = [self.config] + ([self.draft_config] if self.draft_config is not None else [])
        per_token = sum(KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype) for c in models)
        if self.args.max_total_tokens:
            tokens = self.args.max_total_tokens
        else:
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
                fraction = self.args.mem_fraction or 0.85
            else:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                fraction = self.args.mem_fraction or 0.15
            tokens = int(free * fraction) // per_token
        pages = tokens // self.page_size
        if pages * self.page_size < self.context_length // 8:
            log.warning("KV pool holds only %d tokens", pages * self.page_size)
        if pages < 2:
            raise ValueError(f"KV pool of {tokens} tokens is too small for page size {self.page_size}")
        return pages

    def _linear_mode(self, model: torch.nn.Module) -> gemm.LinearMode:
        return gemm.LinearMode(self._linear_kernel(model), self.args.deterministic)

    def _linear_kernel(self, model: torch.nn.Module) -> str:
        name = self.args.linear_kernel
        if name != "auto":
            if name not in gemm.available(self.device):
                raise ValueError(f"--linear-kernel {name} is not available on {self.device}")
            return name
        return gemm.default_kernel(self.device, self.dtype)  # for dense weights (quantized ones run on their codes)

    def _attention_backend(self) -> AttentionBackend:
        name = self.args.attention_backend
        cfg = self.config
        # what triton's kernels lack
        special = cfg.sliding_window is not None or cfg.attn_softcap is not None or cfg.attention_sinks
        if name == "auto":
            native = self.quantization.kernels != "none" and self.dtype == torch.float32
            name = ("torch" if special else "triton") if self.device.type == "cuda" else ("native" if native else "torch")
        if name == "triton" and special:
            raise ValueError(f"--attention-backend triton has no sliding-window, soft-capped or sink attention, which "
                             f"{cfg.architecture} uses: choose torch (or native on a CPU)")
        if self.args.deterministic and name != "native":
            from radixlm.runtime.worker.attention.invariant_backend import InvariantAttention

            return InvariantAttention()
        if name == "native":  # batch invariant by construction under --deterministic
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise ValueError("--attention-backend native runs on CPU with float32 activations")
            from radixlm.runtime.worker.attention.native_backend import NativeAttention

            return NativeAttention(invariant=self.args.deterministic)
        if name == "torch":
            from radixlm.runtime.worker.attention.torch_backend import TorchAttention

            return TorchAttention()
        from radixlm.runtime.worker.attention.triton_backend import TritonAttention

        return TritonAttention(self.device)

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, b: WorkerBatch) -> WorkerOutput:
        """One step, launched: its sampled fields are still on their way (`WorkerOutput.settle`
        reads them), so an overlapped step thread never waits on the device."""
        with gemm.linear_mode(self.linear_mode):
            return self._forward(b)

    def _forward(self, b: WorkerBatch) -> WorkerOutput:
        if self.tp.size > 1:
            send_batch(b, self.req_to_token.table, self.tp)
        out = WorkerOutput(next_token_ids=[])
        if b.future_ids:
            b.input_ids = self._resolve_future(b.input_ids)
        if self.draft is not None:  # its proposals first (into b.input_ids), then its KV of the step
            if b.draft_rows is not None:
                out.drafts = self.draft.propose(b, self.req_to_token)
            self.draft.shadow(b, self.req_to_token)
        hidden = self._hidden(b)
        if b.prompt_rows is not None and b.prompt_rows.numel():
            self._prompt_logprobs(hidden[b.prompt_rows], b, out)
        if b.embed_rows is not None and b.embed_rows.numel():  # (the hidden states after the final norm)
            out.embed_hidden = hidden[b.embed_rows].float().cpu()
        if b.sample_rows.numel():
            logits = self.model.compute_logits(hidden[b.sample_rows])
            s = self.sampler(logits, b.sampling, return_logprob=b.return_logprob, top_logprobs_num=b.top_logprobs_num)
            self._sampled = s.next_token_ids  # what the next step's future ids stand for
            sampled = {"next_token_ids": s.next_token_ids}
            if s.logprobs is not None:
                sampled["logprobs"] = s.logprobs
            if s.top_logprobs is not None:
                sampled.update(top_logprobs=s.top_logprobs, top_logprob_ids=s.top_logprob_ids)
            out.pending = Readback(sampled)  # the scheduler settles it when it takes the step
        return out

    # ---- weights updated in place -----------------------------------------------------------

    def check_update(self, path: str) -> ModelSource:
        """The checkpoint at `path` if it can replace the served weights: this model exactly (its
        config equal: every shape, and everything the layers compute with), on one rank. Raises
        ValueError naming what differs."""
        if self.tp.size > 1:
            raise ValueError("weights cannot be updated with --tp-size above 1 yet")
        try:
            source = resolve_model(path)
            config = load_config(source)
        except (OSError, ValueError) as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - whatever an unreadable config raises: the caller's input
            raise ValueError(f"cannot read the model at {path!r}: {type(e).__name__}: {e}") from None
        if config != self.config:
            now, new = asdict(self.config), asdict(config)
            differ = [f"{k} {new[k]!r} (served: {now[k]!r})" for k in now if now[k] != new[k]]
            raise ValueError(f"the model at {path!r} is not the served model's shape: " + "; ".join(differ[:4]))
        return source

    def update_weights(self, source: ModelSource) -> None:
        """Serve the weights of `source` (`check_update`'s) from the next step on: loaded and laid
        out for the kernels as at start-up, then swapped in with everything that holds them (the
        native decoder, the linear mode, CUDA graphs). The caller runs no step meanwhile and
        flushes the prefix cache after."""
        model = self._load_model(source, self.config, self.tp)
        fit_positions(model, self.positions, exactly=True)
        quantization = self._quantization(model)
        self.model, self.quantization, self.source = model, quantization, source
        lora.sites(model)  # the adapters served apply to the new weights' projections too
        self.linear_mode = self._linear_mode(model)
        self.native_decoder = NativeDecoder.build(self)
        if self.graph_runner is not None:
            self.graph_runner = self._graph_runner()

    def _resolve_future(self, ids: torch.Tensor) -> torch.Tensor:
        """The previous step's sampled tokens in place of their placeholders (`future_id`), on the
        device. A placeholder of a step that failed reads some token: its request failed with it,
        and the scheduler drops what this step makes of it."""
        rows = (FUTURE_BASE - ids).clamp(0, self._sampled.numel() - 1)
        return torch.where(ids <= FUTURE_BASE, self._sampled[rows], ids)

    @property
    def kv_pools(self) -> list[KVPool]:
        """Every pool a token's KV lives in: the model's, then the draft model's."""
        return [self.kv_pool] + ([self.draft.kv_pool] if self.draft is not None else [])

    def kv_identity(self) -> str:
        """What a token's KV depends on besides its prefix: the weights (and the draft model's),
        how they are served, the dtype, the page size and the kernels' mode. KV saved under one
        identity is only ever read under the same one."""
        if self.args.load_format == "dummy":  # random weights: never the same twice
            return f"dummy:{os.urandom(16).hex()}"
        models = [self.source] + ([resolve_model(self.args.speculative_draft_model)] if self.draft else [])
        return json.dumps({"weights": [weights_fingerprint(m) for m in models], "config": asdict(self.config),
                           "dtype": str(self.dtype), "quantization": [self.quantization.method, self.quantization.formats],
                           "kv_cache_dtype": self.kv_dtype.name, "page_size": self.page_size,
                           "deterministic": self.args.deterministic}, sort_keys=True)

    def weights_info(self) -> dict:
        """How the weights are served and the bytes they hold now (this rank's share), kernels'
        own layouts included."""
        q = self.quantization
        return {"served_quantization": q.method, "weight_formats": q.formats, "cpu_kernels": q.kernels,
                "cpu_kernels_failure": q.kernels_failure or None, "weight_bytes": quant.weight_bytes(self.model)}

    def kv_info(self) -> dict:
        """The KV cache's element type and what a token's K and V take in this rank's pools (every
        layer and KV head, the draft model's too; int8's scales included), for /get_server_info."""
        return {"kv_cache_dtype": self.kv_dtype.name, "kv_bytes_per_token": sum(p.token_bytes for p in self.kv_pools)}

    def usable_after_fault(self) -> bool:
        """Whether this worker can serve on after an exception escaped its `forward`. Not with tensor
        parallelism (the other ranks may be inside a collective this rank never reached, so
        every later step would pair the wrong messages), nor when the device fails a probe (a
        sticky CUDA error fails every later call on the device)."""
        if self.tp.size > 1:
            return False
        try:
            probe = torch.ones(8, device=self.device)
            return float((probe @ probe).item()) == 8.0  # .item() waits for the device
        except Exception:  # noqa: BLE001 - any failure here means the device is gone
            return False

    @torch.inference_mode()
    def follow(self) -> None:
        """Tensor-parallel ranks 1..N-1: run each step rank 0 sends, with the same collectives as
        its `forward` (the logits gathers included); only rank 0 samples."""
        while True:
            b = receive_batch(self.req_to_token.table, self.tp)
            with gemm.linear_mode(self.linear_mode):
                hidden = self._hidden(b)
                if b.prompt_rows.numel():
                    self.model.compute_logits(hidden[b.prompt_rows])
                if b.sample_rows.numel():
                    self.model.compute_logits(hidden[b.sample_rows])

    def _hidden(self, b: WorkerBatch) -> torch.Tensor:
        if b.lora_rows is not None:  # rows on adapters: op by op, each projection adding theirs
            with lora.step(self._resident_loras(b.lora_names), b.lora_rows, self._lora_stacks):
                return self._model_forward(b)
        if self.graph_runner is not None and self.graph_runner.fits(b):
            return self.graph_runner.run(b)
        if self.native_decoder is not None and self.native_decoder.fits(b):
            return self.native_decoder.run(b)
        return self._model_forward(b)

    def _model_forward(self, b: WorkerBatch) -> torch.Tensor:
        fb = ForwardBatch.of(b, self.kv_pool, self.req_to_token, self.attn_backend)
        self.attn_backend.prepare(fb)
        return self.model(fb)

    # ---- LoRA adapters -----------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name`, a name not yet served (control.py checks
        it); lora.LoraError names what cannot be served. Only between steps."""
        if not isinstance(path, str) or not os.path.isdir(path):
            raise lora.LoraError(f"adapter {name!r}: {path!r} is not a folder")
        if self.tp.size > 1:
            raise lora.LoraError("LoRA adapters run with --tp-size 1 only")
        if any(cfg.sparse(i) for cfg in [self.config] for i in range(cfg.num_layers)):
            raise lora.LoraError(f"LoRA adapters on a mixture of experts ({self.config.architecture}) are not supported")
        self.loras[name] = self._read_lora(name, path)
        self._resident_loras([name])  # the most recently used; the others within --max-loaded-loras

    def _resident_loras(self, names: list[str]) -> list[lora.LoraAdapter]:
        """The step's adapters, in memory: one dropped by the LRU (--max-loaded-loras) is read
        again; then the least recently used beyond the limit, none of this step's, are dropped.
        NOTE: under overlap this runs on the step thread while the scheduler reads the table's
        names (Scheduler.lora_adapter): it replaces adapters, never adds or removes a name."""
        adapters = []
        for name in names:
            adapter = self.loras[name]
            if not adapter.pairs:
                self.loras[name] = adapter = self._read_lora(name, adapter.path)
            adapter.last_used = next(self._lora_clock)
            adapters.append(adapter)
        limit = self.args.max_loaded_loras
        if limit:
            resident = sorted((a for a in self.loras.values() if a.pairs), key=lambda a: a.last_used)
            for adapter in resident[: max(len(resident) - limit, 0)]:
                if adapter.name not in names:
                    adapter.pairs = {}
                    self._lora_stacks.clear()
        return adapters

    def _read_lora(self, name: str, path: str) -> lora.LoraAdapter:
        adapter = lora.load_adapter(name, path, self.model, self.args.max_lora_rank)
        for site, (a, b) in adapter.pairs.items():
            adapter.pairs[site] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        return adapter

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (one served, that no request runs on). Only between steps."""
        del self.loras[name]
        self._lora_stacks.clear()  # (stacks of sets with it would hold its memory)

    def _prompt_logprobs(self, hidden: torch.Tensor, b: WorkerBatch, out: WorkerOutput) -> None:
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        own = logprobs.gather(1, b.prompt_targets[:, None])
        out.prompt_logprobs = own.squeeze(1).tolist()
        out.prompt_ranks = (logprobs >= own).sum(1).tolist()  # vLLM's rank: the tokens at least as likely
        if b.top_logprobs_num > 0:
            vals, ids = logprobs.topk(b.top_logprobs_num, dim=-1)
            out.prompt_top_logprobs, out.prompt_top_logprob_ids = vals.tolist(), ids.tolist()
