"""In-memory weight transfer: the engine's side of vLLM's RL weight-transfer protocol, on gloo.

vLLM 0.33's routes (vllm/entrypoints/rl/online/api_router.py) with the NCCL backend's bodies
(vllm/distributed/weight_transfer/nccl_common.py, nccl_engine.py, packed_tensor.py), spoken over a CPU ``gloo``
group; vLLM's own trainer side (``HTTPVLLMWeightSyncClient`` and its trainer engine, with a gloo endpoint)
drives it in tests/engine/test_vllm_oracle.py:

- ``POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
  packed, packed_buffer_size_bytes, packed_num_buffers}}``: join the trainer's group (a torch TCPStore served by
  the trainer, rank 0; this engine is rank ``rank_offset``; several engines share one group, each at its own
  ``rank_offset``, as vLLM's workers do) and keep the wire parameters for every round of it. A group formed again
  replaces the old one (a receive still blocked in the old group no longer touches the new one).
  ``/shutdown_weight_transfer_engine`` leaves it.
- Ours: ``"relay": true`` in the init info (our trainer sends it to our engines; vLLM's trainer does not): each
  buffer goes down a chain instead of gloo's broadcast, whose binomial tree costs the root ceil(log2 N) copies.
  Rank r receives each slice from r - 1 and forwards it to r + 1 as it arrives (a pipeline), so the trainer
  sends every buffer once however many engines listen. A failed forward (the next rank dead or frozen) does not
  fail this engine's own update: its reply names it (``forward_error``), and the trainer re-forms the group
  without the lost rank for those behind it.
- ``POST /start_weight_update``: open an empty staging state dict.
- ``POST /update_weights {"update_info": {names, dtype_names, shapes}}``: receive the listed tensors by broadcast
  from rank 0 into the staging dict (never into the served model); all three empty: the previous round's
  tensors again. Packed: tensors are concatenated in order and cut into buffers exactly as vLLM's
  ``pack_tensors`` cuts them (a buffer closes once it holds more than the buffer size); not packed: one
  broadcast per tensor. May be called several times between start and finish.
- ``POST /finish_weight_update {"weight_version": "..."}``: copy the staged tensors into the model between
  two batches (``Batcher.swap_weights``) and serve them under that version.
- Ours, for LoRA (vLLM loads adapters from a path only): an update whose names are all PEFT LoRA keys
  (``base_model.model.<module>.lora_A.weight``) stages an adapter; ``/finish_weight_update`` with
  ``"lora_name"`` and ``"lora_config"`` (the ``adapter_config.json`` object) serves it as that adapter.

Never a hang: the group's gloo timeout is the deadline of every collective (``POLAR_WEIGHT_TRANSFER_TIMEOUT_S``,
default 60 s), and the routes wrap the blocking work in asyncio deadlines derived from it. On a deadline, a
dead peer or any error the staging dict is dropped, the group is destroyed (a peer still sending sees its
connection close) and the engine goes on serving the weights and version it had.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from schemas.weight_transfer import checksum_key, packed_chunks, relay_slices, tensor_sha256

from .lora import is_lora_key

log = logging.getLogger("polarstream.engine.transfer")

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # vLLM's defaults (packed_tensor.py)
DEFAULT_PACKED_NUM_BUFFERS = 2


def default_timeout_s() -> float:
    """The deadline of every collective and of the group's rendezvous, seconds."""
    return float(os.environ.get("POLAR_WEIGHT_TRANSFER_TIMEOUT_S", "60"))


class TransferError(Exception):
    """A refused or failed transfer call; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True)
class InitInfo:
    """vLLM's ``NCCLWeightTransferInitInfo`` (nccl_common.py): the rendezvous and, since 0.28, the wire
    parameters, which the trainer sends once here so both sides cut buffers alike."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False  # vLLM's worker-side default (its trainer side defaults to packed and always sends it)
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    relay: bool = False  # ours: a chain (receive from rank - 1, forward to rank + 1) instead of gloo's broadcast

    def __post_init__(self) -> None:
        if self.nccl_unique_id_b64:
            raise ValueError("nccl_unique_id_b64 is an NCCL rendezvous; this engine joins the trainer's group over a "
                             "TCPStore (master_address and master_port) with gloo")
        if self.master_address is None or self.master_port is None:
            raise ValueError(f"need both master_address and master_port (got master_address={self.master_address!r}, "
                             f"master_port={self.master_port!r})")
        if self.packed_buffer_size_bytes <= 0 or self.packed_num_buffers <= 0:
            raise ValueError("packed_buffer_size_bytes and packed_num_buffers must be > 0")


@dataclass
class UpdateInfo:
    """vLLM's ``NCCLWeightTransferUpdateInfo``: one round's tensors. All three lists empty: the same tensors as
    the previous round in this group (a trainer sends their metadata once)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.dtype_names) != len(self.names) or len(self.shapes) != len(self.names):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        for d in self.dtype_names:
            if not isinstance(getattr(torch, str(d), None), torch.dtype):
                raise ValueError(f"unknown dtype name {d!r}")

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, d) for d in self.dtype_names]

    def nbytes(self) -> list[int]:
        return [math.prod(s) * dt.itemsize for s, dt in zip(self.shapes, self.dtypes)]


def parse_info(cls, raw: Any):
    """``cls(**raw)`` as vLLM builds it (unknown keys refused); TransferError 400 naming the problem."""
    if not isinstance(raw, dict):
        raise TransferError(400, f"{cls.__name__}: expected an object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TransferError(400, f"{cls.__name__}: unknown fields {unknown}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as e:
        raise TransferError(400, f"{cls.__name__}: {e}") from None


def is_broadcast_update(body: Any) -> bool:
    """A ``/update_weights`` body of the transfer protocol (as against our storage body with a URL): an
    ``update_info`` without ``checkpoint_url``, or a list of them (one per worker rank: we have one)."""
    info = body.get("update_info") if isinstance(body, dict) else None
    return isinstance(info, list) or (isinstance(info, dict) and "checkpoint_url" not in info)


def unpack(buf: torch.Tensor, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype],
           sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """vLLM's ``unpack_tensor``: views of ``buf`` (copied only where a view would be misaligned)."""
    out = []
    for name, shape, dtype, piece in zip(names, shapes, dtypes, buf.split(sizes)):
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()
        out.append((name, piece.view(dtype).view(*shape)))
    return out


def model_checksums(model: torch.nn.Module) -> dict[str, str]:
    """vLLM's ``compute_weight_checksums`` for one worker: the sha256 of each parameter (``named_parameters``: a
    tied one once, under its first name), keyed ``dp0:pp0:pcp0:tp0:<name>``."""
    return {checksum_key(name): tensor_sha256(p) for name, p in model.named_parameters()}


def zero_weights(model: torch.nn.Module) -> None:
    """vLLM's ``/weight_checker`` reset: every parameter zeroed (a transfer that skips one then shows)."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def compare_checksums(baseline: dict[str, str], current: dict[str, str]) -> tuple[bool, list[str]]:
    """(all match, mismatched names) as vLLM's ``/weight_checker`` compares: over the names of both sides, so a
    name on one side only is a mismatch (a baseline of part of the model does not match)."""
    mismatches = sorted(n for n in baseline.keys() | current.keys() if current.get(n) != baseline.get(n))
    return not mismatches, mismatches


@dataclass
class _Group:
    pg: Any
    store: Any
    rank: int
    world_size: int
    timeout_s: float
    wire: InitInfo  # packed or not, and the buffer size: what the trainer announced at init
    last: UpdateInfo | None = None  # the previous round's tensors (an empty update_info means these again)
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    created: float = field(default_factory=time.time)


class Receiver:
    """The engine's transfer state: at most one group, at most one staging dict. Thread-safe; every
    blocking call runs in a worker thread (the routes put deadlines around them)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._lock = threading.RLock()
        self._group: _Group | None = None
        self._staging: dict[str, torch.Tensor] | None = None
        self._receiving: _Group | None = None  # the group a receive is blocked in (a replaced one's ends on its own)
        self._gen = 0  # bumped by every abort and init: a rendezvous that ends after an abort is discarded
        # Receive buffers are recycled: the tensors of a packed buffer become the model's parameters (no copy at
        # the swap), so the buffers the previous update installed are free once the next one replaces all their
        # tensors, and the update after it receives into them instead of page-faulting fresh memory as the bytes
        # arrive (which cost as much as the transfer). The price: one spare copy of the weights between updates.
        self._staged_bufs: list[tuple[torch.Tensor, frozenset[str]]] = []  # (buffer, its tensors' names)
        self._serving: list[tuple[torch.Tensor, frozenset[str]]] = []  # installed: the model holds views of them
        self._spare: list[torch.Tensor] = []
        self.stats = {"groups_formed": 0, "updates": 0, "aborted": 0, "buffers": 0, "bytes": 0, "last_error": None,
                      "last_update_s": None, "last_pause_s": None, "buffers_reused": 0}

    # ------------------------------------------------------------------ state
    def describe(self) -> dict[str, Any]:
        g = self._group
        return {"backend": "gloo", "session": g.session if g else None, "rank": g.rank if g else None,
                "world_size": g.world_size if g else None, "updating": self._staging is not None,
                "receiving": self._receiving is not None, "staged": len(self._staging or {}), **self.stats}

    def leave(self) -> bool:
        """Leave the group, as asked (``/shutdown_weight_transfer_engine``); whether there was one."""
        with self._lock:
            g, self._group, self._staging = self._group, None, None
            self._gen += 1
        if g is not None:
            log.info("left weight-transfer group %s", g.session)
            _destroy(g)
        return g is not None

    @property
    def has_group(self) -> bool:
        return self._group is not None

    def abort(self, reason: str, group: "_Group | None" = None) -> None:
        """Drop the staging dict and destroy the group (the served weights are untouched). ``group``: only if
        it is still the current one (a receive that failed in a group since replaced leaves the new one be)."""
        with self._lock:
            if group is not None and group is not self._group:
                g = group  # replaced already: only its own collectives end
            else:
                g, self._group, self._staging = self._group, None, None
                self._gen += 1
            self.stats["aborted"] += 1
            self.stats["last_error"] = reason
        if g is not None:
            log.warning("weight transfer aborted (%s): staged weights dropped, group %s destroyed", reason, g.session)
            _destroy(g)

    # ------------------------------------------------------------------ protocol steps
    def init(self, info: InitInfo, timeout_s: float | None = None) -> dict[str, Any]:
        """Join the trainer's group as rank ``rank_offset`` (blocking: the rendezvous waits for every rank,
        at most ``timeout_s``)."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if not 0 < info.rank_offset < info.world_size:
            raise TransferError(400, f"rank_offset {info.rank_offset} must be in [1, world_size={info.world_size})"
                                     " (the trainer is rank 0)")
        timeout_s = timeout_s or default_timeout_s()
        with self._lock:
            old, self._group, self._staging = self._group, None, None
            self._gen += 1
            gen = self._gen
        if old is not None:
            _destroy(old)
        td = datetime.timedelta(seconds=timeout_s)
        try:
            store = TCPStore(info.master_address, int(info.master_port), info.world_size, False, timeout=td)
            pg = ProcessGroupGloo(PrefixStore("polar-weight-transfer", store), info.rank_offset, info.world_size, td)
        except Exception as e:  # noqa: BLE001 - gloo/TCPStore raise RuntimeError, DistStoreError, ...
            self.stats["last_error"] = f"init: {e}"
            raise TransferError(504 if "imeout" in str(e) else 502, f"cannot join the weight-transfer group at "
                                f"{info.master_address}:{info.master_port}: {str(e)[:300]}") from None
        group = _Group(pg, store, info.rank_offset, info.world_size, timeout_s, info)
        with self._lock:
            if gen != self._gen:  # aborted (a route deadline) or replaced while the rendezvous ran
                _destroy(group)
                raise TransferError(504, "the weight-transfer group was aborted while it formed")
            self._group = group
            self.stats["groups_formed"] += 1
        log.info("joined weight-transfer group %s as rank %d of %d", group.session, group.rank, group.world_size)
        return {"session": group.session, "rank": group.rank}

    def start(self) -> None:
        with self._lock:
            if self._group is None:
                raise TransferError(409, "no weight-transfer group: call /init_weight_transfer_engine first")
            self._staging, self._staged_bufs = {}, []

    def receive(self, info: UpdateInfo) -> dict[str, Any]:
        """Receive ``info``'s tensors into the staging dict (blocking; each collective has the group's
        deadline). On any failure: abort (staging dropped, group destroyed) and raise TransferError."""
        with self._lock:
            g, staging = self._group, self._staging
            if g is None:
                raise TransferError(409, "no weight-transfer group: call /init_weight_transfer_engine first")
            if staging is None:
                raise TransferError(409, "no weight update open: call /start_weight_update first")
            if self._receiving is g:
                raise TransferError(409, "a transfer is already being received")
            self._receiving = g
        t0, nbytes, buffers = time.monotonic(), 0, 0
        info = info if info.names else (g.last or info)  # empty: the previous round's tensors (none yet: nothing)
        try:
            self._check(info)
            dtypes, sizes = info.dtypes, info.nbytes()
            timeout = datetime.timedelta(seconds=g.timeout_s)
            got: list[tuple[str, torch.Tensor]] = []
            bufs: list[tuple[torch.Tensor, frozenset[str]]] = []
            fwd = _Forward(g)
            if g.wire.packed:
                for idx in packed_chunks(sizes, g.wire.packed_buffer_size_bytes):
                    buf = self._take(sum(sizes[i] for i in idx))
                    bufs.append((buf, frozenset(info.names[i] for i in idx)))
                    _receive_one(g, buf, timeout, fwd)
                    got += unpack(buf, [info.names[i] for i in idx], [info.shapes[i] for i in idx],
                                  [dtypes[i] for i in idx], [sizes[i] for i in idx])
                    buffers += 1
                    nbytes += buf.numel()
                    self.stats["buffers"] += 1
            else:
                for name, shape, dtype in zip(info.names, info.shapes, dtypes):
                    t = torch.empty(shape, dtype=dtype)
                    _receive_one(g, t, timeout, fwd)
                    got.append((name, t))
                    buffers += 1
                    nbytes += t.numel() * t.element_size()
                    self.stats["buffers"] += 1
            fwd.wait(timeout)  # every slice passed on (or the next rank is lost: named in the reply)
        except TransferError as e:
            self.abort(str(e), g)
            raise
        except Exception as e:  # noqa: BLE001 - a gloo timeout or a closed connection
            self.abort(f"receive: {e}", g)
            raise TransferError(504 if "imed out" in str(e) else 502,
                                f"weight transfer failed after {buffers} buffers: {str(e)[:300]}") from None
        finally:
            with self._lock:
                if self._receiving is g:
                    self._receiving = None
        with self._lock:
            if self._group is not g or self._staging is not staging:  # aborted meanwhile (a route's deadline)
                raise TransferError(504, "weight transfer aborted while receiving")
            staging.update(got)
            self._staged_bufs += bufs
            g.last = info
            self.stats["bytes"] += nbytes
        out = {"tensors": len(got), "bytes": nbytes, "buffers": buffers, "seconds": round(time.monotonic() - t0, 4)}
        if fwd.error:
            log.warning("weight transfer: %s (this engine has every tensor; the ranks behind it do not)", fwd.error)
            out["forward_error"] = fwd.error
        return out

    def take_staged(self) -> tuple[dict[str, torch.Tensor], list]:
        """The staged tensors and the buffers they are views of, closing the update (a finish without an open
        update is refused); once installed, hand the buffers to ``installed``."""
        with self._lock:
            if self._staging is None:
                raise TransferError(409, "no weight update open (never started, or aborted: see /weight_info)")
            if self._receiving is not None and self._receiving is self._group:
                raise TransferError(409, "tensors are still being received")
            staged, self._staging = self._staging, None
            bufs, self._staged_bufs = self._staged_bufs, []
            self.stats["updates"] += 1
        return staged, bufs

    def installed(self, names: set[str], bufs: list) -> None:
        """``names`` were swapped in from ``bufs``: a buffer installed before whose every tensor was replaced
        is no longer read by the model and becomes spare."""
        with self._lock:
            keep = []
            for buf, held in self._serving:
                (self._spare.append(buf) if held <= names else keep.append((buf, held)))
            self._serving = keep + list(bufs)
            self._spare = self._spare[-len(self._serving) - 1:]  # never more than one copy of the weights

    def _take(self, nbytes: int) -> torch.Tensor:
        """A receive buffer of ``nbytes``: a spare one of that size, or a new one."""
        with self._lock:
            for i, b in enumerate(self._spare):
                if b.numel() == nbytes:
                    self.stats["buffers_reused"] += 1
                    return self._spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _check(self, info: UpdateInfo) -> None:
        if info.names and all(is_lora_key(n) for n in info.names):
            return  # an adapter's tensors (PEFT keys): checked against the model as the adapter is built, at finish
        own = self.model.state_dict()
        for name, shape in zip(info.names, info.shapes):
            if name not in own:
                raise TransferError(400, f"update_info names a tensor the model lacks: {name!r}")
            if tuple(own[name].shape) != tuple(shape):
                raise TransferError(400, f"{name}: shape {tuple(shape)} != model shape {tuple(own[name].shape)}")


class _Forward:
    """Relay: each slice this rank receives goes on to the next rank without waiting (a pipeline); a failed
    forward stops the forwarding only, never this rank's own receive."""

    def __init__(self, g: _Group):
        self.g, self.works, self.error = g, [], None
        self.to = g.rank + 1 if g.wire.relay and g.rank + 1 < g.world_size else None

    def send(self, piece: torch.Tensor) -> None:
        if self.to is None or self.error:
            return
        try:
            self.works.append(self.g.pg.send([piece], self.to, 0))
        except Exception as e:  # noqa: BLE001 - the connection to the next rank is gone
            self.error = f"forward to rank {self.to}: {str(e)[:200]}"

    def wait(self, timeout: datetime.timedelta) -> None:
        for w in self.works:
            if self.error:
                break
            try:
                w.wait(timeout)
            except Exception as e:  # noqa: BLE001 - a gloo timeout or a closed connection
                self.error = f"forward to rank {self.to}: {str(e)[:200]}"
        self.works = []


def _receive_one(g: _Group, t: torch.Tensor, timeout: datetime.timedelta, fwd: _Forward) -> None:
    """``t``'s bytes from the trainer: gloo's broadcast (vLLM's wire), or, relayed, slice by slice from the rank
    before this one, each passed on to the rank after it as it arrives."""
    if not g.wire.relay:
        g.pg.broadcast(t, 0, timeout).wait()
        return
    for piece in relay_slices(t.reshape(-1).view(torch.uint8)):
        g.pg.recv([piece], g.rank - 1, 0).wait(timeout)
        fwd.send(piece)


def install(model: torch.nn.Module, staged: dict[str, torch.Tensor]) -> None:
    """Put the staged tensors into the model: a parameter of the same dtype, device and shape takes the
    received tensor as its storage (no copy: the swap is a pointer change), anything else is copied in."""
    params = dict(model.named_parameters(remove_duplicate=False))
    own = model.state_dict()
    with torch.no_grad():
        for name, t in staged.items():
            p = params.get(name)
            if p is not None and p.dtype == t.dtype and p.device == t.device and p.shape == t.shape:
                p.data = t
            else:
                own[name].copy_(t)


def _destroy(g: _Group) -> None:
    """Abort the group's pending work and let it go (a peer still in a collective sees the connection close)."""
    try:
        g.pg.abort()
    except Exception:  # noqa: BLE001 - older torch without abort, or already broken
        pass
    g.pg = None
    g.store = None
