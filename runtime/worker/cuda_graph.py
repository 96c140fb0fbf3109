"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket, replayed.

A decode step launches hundreds of small kernels; replaying a captured graph launches them in
one call. A graph replays fixed addresses and shapes, so the runner owns static per-step
buffers (ids, positions, KV slots, rows and lengths) of the largest bucket, and a step of B
requests runs the smallest bucket of at least B: its fields are copied in, the rows past B are
padding (token 0 at position 0 of row 0, its K/V written to the pool's spare page,
`ModelWorker.pad_slot`), and the first B rows of the bucket's output are the step's hidden
states. Everything a step allocates is outside the captured region: the scheduler took the
KV slots, the attention backend's decode buffers are reserved once (`reserve`), and sampling
runs after the replay on the real rows.

Captured on CUDA (`capture`); without it (a CPU, in tests) the runner runs the same static,
padded batches eagerly, so the buffers, the padding and the bucket choice are checked where no
GPU is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.worker import gemm
from radixlm.runtime.worker.forward_batch import ForwardBatch, ForwardMode, StepTokens

if TYPE_CHECKING:
    from radixlm.runtime.args import ServerArgs
    from radixlm.runtime.worker.model_worker import ModelWorker

log = logging.getLogger(__name__)

# batch sizes with a graph of their own (up to --cuda-graph-max-bs, which is always one)
_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets(max_bs: int) -> list[int]:
    return [b for b in _BUCKETS if b < max_bs] + [max_bs]


def graph_batch_limit(args: ServerArgs) -> int:
    """The largest decode step a graph is captured for: --cuda-graph-max-bs, by default the largest
    running batch (--max-running-requests), so that no decode step runs eagerly; never above it."""
    wanted = args.cuda_graph_max_bs if args.cuda_graph_max_bs is not None else args.max_running_requests
    return min(wanted, args.max_running_requests)


class DecodeGraphRunner:
    def __init__(self, worker: ModelWorker, max_bs: int) -> None:
        self.worker = worker
        self.sizes = buckets(max_bs)
        self.max_bs = max_bs
        device = worker.device

        (self.input_ids, self.positions, self.req_rows, self.prefix_lens, self.out_slots,
         self.seq_lens) = torch.empty(6, max_bs, dtype=torch.int64, device=device).unbind()
        self._pad(0, max_bs)  # every row padding until a step fills it
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=device)  # decode: one token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states
        self.replays = 0  # steps run through the runner
        reserve = getattr(worker.attn_backend, "reserve", None)
        if reserve is not None:
            cfg = worker.config
            reserve(max_bs, cfg.num_heads // worker.tp.size, cfg.head_dim, device)

    def fits(self, b: StepTokens) -> bool:
        """Whether a step runs here: a decode step of at most max_bs requests."""
        return b.mode is ForwardMode.DECODE and b.batch_size <= self.max_bs

    def bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def run(self, b: StepTokens) -> torch.Tensor:
        """The step's hidden states [B, hidden], through the bucket's graph (or eagerly)."""
        n, size = b.batch_size, self.bucket(b.batch_size)
        for static, value in ((self.input_ids, b.input_ids), (self.positions, b.positions),
                              (self.req_rows, b.req_rows), (self.prefix_lens, b.prefix_lens),
                              (self.out_slots, b.out_slots), (self.seq_lens, b.seq_lens)):
            static[:n].copy_(value, non_blocking=True)
        if size > n:  # the padding rows of the last step of this size may have been real ones
            self._pad(n, size)
        self.replays += 1
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.outputs[size][:n]
        return self._forward(size, max(b.max_seq_len, 1))[:n]

    def _pad(self, start: int, end: int) -> None:
        for static, fill in ((self.input_ids, 0), (self.positions, 0), (self.req_rows, 0), (self.prefix_lens, 0),
                             (self.out_slots, self.worker.pad_slot), (self.seq_lens, 1)):
            static[start:end].fill_(fill)

    def _forward(self, size: int, max_seq_len: int) -> torch.Tensor:
        w = self.worker
        step = StepTokens(mode=ForwardMode.DECODE, input_ids=self.input_ids[:size], positions=self.positions[:size],
                          out_slots=self.out_slots[:size], req_rows=self.req_rows[:size],
                          prefix_lens=self.prefix_lens[:size], extend_lens=self.extend_lens[:size],
                          seq_lens=self.seq_lens[:size], max_extend_len=1, max_seq_len=max_seq_len, num_decode=size)
        fb = ForwardBatch.of(step, w.kv_pool, w.req_to_token, w.attn_backend)
        w.attn_backend.prepare(fb)
        return w.model(fb)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward pass (CUDA), the largest first so that the smaller ones
        reuse its memory pool. Each is run twice first: Triton compiles its kernels then."""
        w = self.worker
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=w.device)
        with gemm.linear_mode(w.linear_mode):
            for size in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream(w.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._forward(size, w.context_length)
                torch.cuda.current_stream(w.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size, w.context_length)
                self.graphs[size] = graph
        torch.cuda.synchronize(w.device)
        log.info("CUDA graphs captured for decode batches of %s", ", ".join(map(str, self.sizes)))
