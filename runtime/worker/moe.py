"""Mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss): a router picks each token's
top-k experts, and the step's tokens are grouped by expert so that each expert's weights are read
once per step, whatever the number of tokens that chose it.

Routing is HF's: softmax over the router's logits (in float32), the top k, those k weights
renormalized to sum to 1 where the model says so; gpt-oss's router has a bias and takes the
softmax over its top k logits instead. Each expert is an ordinary gated MLP whose matrices are
`linear` layers like the dense model's (with biases for gpt-oss's, and its clamped SwiGLU), so
quantized serving (the GGUF file's codes, or `--quantization int4|int8`) runs the experts on the
same native kernels. Qwen2-MoE adds a shared expert that every token goes through, its output
scaled by the sigmoid of a learned projection of the token.

A token's outputs are summed over its experts in expert order (as HF's loop adds them), each
expert's rows computed by the batch-invariant matmuls: a token's result does not depend on
which other tokens share its step.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.worker.gemm import linear
from radixlm.runtime.worker.layers import MergedColumnLinear, RowParallelLinear, _copy_loader, _param, activation
from radixlm.runtime.worker.parallel import SINGLE, TPContext


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [(inner, 0), (inner, 0)], bias)
        self.down_proj = RowParallelLinear(inner, cfg.hidden_size, SINGLE, bias)
        self.act = activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture} is a mixture of experts, which radixlm does not split across "
                             "ranks yet (no expert parallelism): serve it with --tp-size 1")
        self.top_k, self.norm_topk, self.router = cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_router
        self.gate = nn.Module()  # the router, [experts, hidden]: small, kept float32
        self.gate.weight = _param((cfg.num_experts, cfg.hidden_size), _copy_loader)
        self.gate.bias = _param((cfg.num_experts,), _copy_loader) if cfg.moe_bias else None
        self.experts = nn.ModuleList(Expert(cfg, cfg.moe_intermediate_size, cfg.moe_bias)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = Expert(cfg, cfg.shared_expert_size) if cfg.shared_expert_size else None
        if self.shared_expert is not None:
            self.shared_expert_gate = nn.Module()  # [1, hidden]
            self.shared_expert_gate.weight = _param((1, cfg.hidden_size), _copy_loader)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token, as HF's router picks them."""
        logits = linear(x, self.gate.weight, self.gate.bias)  # (batch invariant under --deterministic)
        if self.router == "topk_softmax":  # gpt-oss: the top k logits, then their softmax
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        flat = chosen.flatten()
        # the (token, choice) pairs sorted by expert, stably: each expert's rows lie together,
        # its tokens in order, and the pairs of one token in the order of its experts' ids
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        rows = x.index_select(0, tokens)
        scale = weights.flatten().index_select(0, order)[:, None]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):  # one matmul per expert that some token chose
            if n:
                out[start : start + n] = self.experts[e](rows[start : start + n])
                start += n
        routed = torch.zeros_like(x).index_add_(0, tokens, out * scale)
        if self.shared_expert is None:
            return routed
        return routed + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
