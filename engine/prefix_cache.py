"""Prefix caching: reuse the KV of earlier sequences for a new prompt's longest common prefix.

Agent sessions send a growing conversation every turn, and the samples of one task share their first
prompt; without this every call would prefill the whole conversation again (10 s for 20k tokens on
two busy CPU cores with the tiny model). The KV of position j depends only on tokens 0..j (causal
attention), so any common prefix of a stored sequence is reusable as is, even where the conversation
diverges later. Entries are evicted least-recently-used within a byte budget, and dropped on every
weight update (the KV belongs to the weights that computed it). Each entry belongs to a namespace, the
LoRA adapter that computed it (None: the base model); a lookup only reuses its own namespace's KV.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .kv import Layers

MIN_REUSE = 16  # shorter matches are cheaper to recompute than to look up and copy


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """Token sequences and their per-layer (K, V) of shape (1, H, T, D), within ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[torch.Tensor, Layers]] = OrderedDict()
        self._ns: dict[int, object] = {}  # entry key -> namespace (an adapter object, or None)
        self._bytes = 0
        self._next = 0

    @staticmethod
    def _size(layers: Layers) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._ns.clear()
        self._bytes = 0

    def drop_namespace(self, ns: object) -> None:
        """Forget every entry of namespace ``ns`` (an unloaded adapter's KV)."""
        for key in [k for k, n in self._ns.items() if n is ns]:
            self._drop(key)

    def put(self, tokens: list[int], layers: Layers, ns: object = None) -> None:
        """Remember the KV of ``tokens`` (one row, unpadded; the tensors are copied) under ``ns``."""
        size = self._size(layers)
        if size > self.max_bytes or len(tokens) < MIN_REUSE:
            return
        t = torch.tensor(tokens, dtype=torch.long)
        for key, (other, _) in list(self._entries.items()):  # an entry this one extends is redundant
            if self._ns[key] is ns and len(other) <= len(t) and common_prefix(other, t) == len(other):
                self._drop(key)
        self._entries[self._next] = (t, [(k.clone(), v.clone()) for k, v in layers])
        self._ns[self._next] = ns
        self._next += 1
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def lookup(self, prompt: list[int], ns: object = None) -> tuple[int, Layers | None]:
        """(m, KV of the first m tokens) for the longest stored prefix of ``prompt`` in namespace ``ns``;
        (0, None) if none.

        At least one prompt token is always left to compute, since its logits give the first output.
        """
        if not self._entries:
            return 0, None
        p = torch.tensor(prompt, dtype=torch.long)
        best, best_key = 0, None
        for key, (tokens, _) in self._entries.items():
            if self._ns[key] is not ns:
                continue
            m = min(common_prefix(tokens, p), len(prompt) - 1)
            if m > best:
                best, best_key = m, key
        if best < MIN_REUSE:
            return 0, None
        self._entries.move_to_end(best_key)
        layers = self._entries[best_key][1]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def _drop(self, key: int) -> None:
        _, layers = self._entries.pop(key)
        self._ns.pop(key, None)
        self._bytes -= self._size(layers)
