"""The batch's KV cache: per-layer (K, V) tensors of shape (B, H, T, D) plus a (B, T) padding mask.

Sequences of different lengths share one batch by left-padding: row i's real tokens occupy the last
``mask[i].sum()`` columns. RoPE is applied before keys are cached and every row gets explicit
position ids, so padding changes no row's attention result; the mask hides the padded columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def layers_of(cache: DynamicCache) -> Layers:
    """The (K, V) tensors of a transformers cache, one pair per layer."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_of(layers: Layers) -> DynamicCache:
    """A transformers cache holding ``layers`` (the tensors are copied once)."""
    return DynamicCache(ddp_cache_data=layers)


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    # (B, H, T, D) -> (B, H, n + T, D), zeros in front
    return F.pad(t, (0, 0, n, 0)) if n else t


@dataclass
class BatchKV:
    """KV tensors and padding mask of the rows currently decoding."""

    layers: Layers
    mask: torch.Tensor  # (B, T) long, 1 = real token

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @classmethod
    def single(cls, layers: Layers, copies: int) -> "BatchKV":
        """``copies`` rows sharing one unpadded prefill (the n choices of one prompt)."""
        rep = [(k.expand(copies, -1, -1, -1).contiguous(), v.expand(copies, -1, -1, -1).contiguous()) for k, v in layers]
        T = layers[0][0].shape[-2]
        return cls(rep, torch.ones(copies, T, dtype=torch.long, device=layers[0][0].device))

    def join(self, other: "BatchKV") -> "BatchKV":
        """Rows of ``self`` followed by rows of ``other``, left-padded to a common length."""
        T = max(self.length, other.length)
        a, b = T - self.length, T - other.length
        layers = [
            (torch.cat([_pad_left(ka, a), _pad_left(kb, b)]), torch.cat([_pad_left(va, a), _pad_left(vb, b)]))
            for (ka, va), (kb, vb) in zip(self.layers, other.layers)
        ]
        return BatchKV(layers, torch.cat([F.pad(self.mask, (a, 0)), F.pad(other.mask, (b, 0))]))

    def select(self, rows: list[int]) -> "BatchKV":
        """Keep ``rows`` (in that order) and drop leading columns that are padding in every kept row."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        real = mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else mask.shape[1]
        layers = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self.layers]
        return BatchKV(layers, mask[:, start:])
