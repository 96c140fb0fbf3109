"""The contract every attention backend keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixlm.runtime.worker.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    # True where the backend rotates q and k itself (`forward_qkv`): the model then hands it the
    # qkv projection as it is, and the rotary tables.
    fuses_rotary = False

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-step metadata (indices, masks) once, before the first layer runs; store it in fb.attn_meta."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v ([T, kv_heads, d]) to fb.out_slots of the layer's pool, then attend.

        Each token attends to its request's cached prefix and, causally, to the new
        tokens up to itself; in a sliding layer (`window`) only to the last `window` of
        those, its own included. `softcap`: scores become softcap * tanh(score / softcap)
        before the softmax (Gemma 2). `sinks` [heads]: one more logit in each head's softmax,
        with no value (gpt-oss). Returns [T, heads, d].
        """

    def forward_qkv(self, qkv: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, heads: int, kv_heads: int,
                    layer: int, scale: float, fb: ForwardBatch, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """As `forward`, from the qkv projection [T, (heads + 2 kv_heads) d] before rotary (cos2,
        sin2: the full-width tables by position): rotates q and k (in place), writes k and v to
        the pool, attends. Returns [T, heads * d]. Only where `fuses_rotary`."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse rotary")
