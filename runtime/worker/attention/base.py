"""The contract every attention backend keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixlm.runtime.worker.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-step metadata (indices, masks) once, before the first layer runs; store it in fb.attn_meta."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                fb: ForwardBatch) -> torch.Tensor:
        """Write k, v ([T, kv_heads, d]) to fb.out_slots of the layer's pool, then attend.

        Each token attends to its request's cached prefix and, causally, to the new
        tokens up to itself. Returns [T, heads, d].
        """
