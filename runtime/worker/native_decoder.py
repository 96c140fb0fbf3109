"""Decode steps in one native call: the CPU's counterpart of the CUDA graph runner.

A decode step on the native kernels is ~270 op calls from Python (30 layers x 9 for SmolLM2),
each paying Python's and torch's dispatch, which at one stream was a third of the step. The
library's `Decoder` (kernels/cpu/csrc/decoder.cpp) holds the model's quantized weights and the
KV pool, and runs every layer of a decode step in one call: embedding in, final norm out.

It calls the same kernels in the same order as the model's own forward on those kernels, so a
step is bitwise the same either way (tested): whether a step fits the decoder never changes a
token, under --deterministic too (the decoder's attention is exact there, as the backend's is:
each row bitwise itself alone). A step fits when every row decodes one token on the codes
through the native attention backend; anything else (prefill chunks, verify rows) runs op by op.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.worker.forward_batch import StepTokens
from radixlm.runtime.worker.quant import QuantizedMatrix

if TYPE_CHECKING:
    from radixlm.runtime.worker.model_worker import ModelWorker

log = logging.getLogger(__name__)

_NONE = torch.empty(0)  # "this model has none" in the decoder's weight list


class NativeDecoder:
    def __init__(self, worker: ModelWorker) -> None:
        model, cfg = worker.model, worker.config
        weights: list[torch.Tensor] = []
        rows: list[int] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = (p.weight.tiled for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            weights += [layer.input_layernorm.weight.data, qkv.tiles, qkv.segments,
                        _NONE if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data, o.tiles, o.segments,
                        layer.post_attention_layernorm.weight.data, gate_up.tiles, gate_up.segments, down.tiles,
                        down.segments]
            rows += [qkv.rows, o.rows, gate_up.rows, down.rows]
        weights.append(model.norm.weight.data)
        first = model.layers[0].self_attn
        pool = worker.kv_pool
        self._decoder = torch.classes.radixlm.Decoder(
            weights, rows, pool.k_heads, pool.v_heads, model.rotary.cos2, model.rotary.sin2, first.num_heads,
            first.num_kv_heads, first.head_dim, float(cfg.rms_norm_eps), float(first.scale), first.window or 0,
            worker.attn_backend.invariant)
        self.window = first.window
        self.worker = worker
        self.steps = 0  # decode steps run here

    @staticmethod
    def build(worker: ModelWorker) -> NativeDecoder | None:
        """The decoder for `worker`'s model, or None where its steps must run op by op: layers
        the decoder does not run (q/k norms, post-norms, multipliers, layers without rotary),
        tensor parallelism, weights not all on the codes, or another attention backend."""
        from radixlm.runtime.worker.attention.native_backend import NativeAttention
        from radixlm.runtime.worker.models.llama import LlamaForCausalLM

        model = worker.model
        if (type(model) is not LlamaForCausalLM or not model.cfg.plain or worker.tp.size > 1
                or type(worker.attn_backend) is not NativeAttention or worker.dtype != torch.float32
                or not getattr(model.norm, "native", False)):
            return None
        projections = [m.weight for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(w, QuantizedMatrix) for w in projections):
            return None
        return NativeDecoder(worker)

    def fits(self, b: StepTokens) -> bool:
        rows = b.batch_size
        return b.num_decode == rows and b.input_ids.shape[0] == rows

    def run(self, b: StepTokens) -> torch.Tensor:
        """The final hidden states of a decode step's rows, [rows, hidden]."""
        self.steps += 1
        h = self.worker.model.embed_tokens(b.input_ids)
        table, slots = self.worker.req_to_token.table, b.out_slots
        if self.window and b.window_slots is not None:  # every layer slides: all in the window space
            table, slots = self.worker.req_to_token.window_table, b.window_slots
        return self._decoder.forward(h, b.positions, slots, table, b.req_rows, b.seq_lens, -1)

