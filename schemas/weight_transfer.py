"""The weight-transfer wire format both ends share (vLLM's packed broadcast): how tensors are cut into
buffers and how a tensor's checksum is taken. The engine (engine/transfer.py) and the trainer
(trainer/sync/broadcast.py) import it from here, as they import every other part of the contract."""

from __future__ import annotations

import hashlib


def packed_chunks(sizes: list[int], buffer_size_bytes: int) -> list[list[int]]:
    """Tensor indexes per packed buffer, cut as vLLM cuts them: a buffer takes tensors until it holds more
    than ``buffer_size_bytes`` (so a buffer may exceed it by its last tensor)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        current.append(i)
        total += n
        if total > buffer_size_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


# Ours, where the group relays (our engines: init info ``"relay": true``): each packed buffer goes down the chain
# trainer -> rank 1 -> rank 2 ... in slices of this many bytes (the last one shorter), so a rank forwards a slice
# while the next arrives. Both ends cut alike: a gloo recv must name the size its send has.
RELAY_SLICE_BYTES = 4 << 20


def relay_slices(flat_bytes):
    """The slices a relayed buffer (a flat uint8 tensor) travels in."""
    return flat_bytes.split(RELAY_SLICE_BYTES)


# vLLM's ``/weight_checker`` keys each digest by the worker that holds it (v1/worker/gpu_worker.py
# ``_weight_checksum_prefix``): one worker serving the whole model is data-parallel index 0, pipeline, context
# and tensor rank 0. A baseline is compared over the names of both sides, so it carries the same prefix.
CHECKSUM_PREFIX = "dp0:pp0:pcp0:tp0:"


def checksum_key(name: str) -> str:
    """The ``/weight_checker`` key of tensor ``name`` on a single-worker engine."""
    return CHECKSUM_PREFIX + name


def tensor_sha256(t) -> str:
    """SHA-256 of a torch tensor's bytes, as vLLM's weight checker computes it."""
    import torch  # only the two ends that hold tensors pay for it

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).hexdigest()
