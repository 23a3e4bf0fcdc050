"""Weights to the engines in memory: the trainer's side of vLLM's weight-transfer protocol.

Our engines share ONE group: the trainer is rank 0, engine i is rank ``rank_offset`` = i + 1 (each is one
process, one rank; a vLLM engine's workers take ``world_size`` ranks from its offset, as vLLM's
``_worker_group_rank`` places them), ``world_size`` = 1 + the engines. Each packed buffer leaves the trainer once
however many engines listen. What a buffer costs the trainer, measured (bench/weight_sync.py, ``egress``):

- gloo (our CPU engines): gloo's ``broadcast`` is a binomial tree from the root, so the root sends ceil(log2 N)
  copies for N ranks (measured: 1, 2, 3 copies for 2, 3, 5 ranks). Our group therefore relays (init info
  ``"relay": true``, engine/transfer.py): the trainer sends each buffer to rank 1 alone, in 4 MiB slices
  (``schemas.weight_transfer.RELAY_SLICE_BYTES``), and rank r passes each slice on to r + 1 as it arrives (a
  pipeline): the trainer's egress is 1x the model for any number of engines, and a buffer reaches the last
  engine one slice per hop later. gloo connects every pair of ranks when a group forms, so (unlike one group
  per engine) the engines must reach each other, not only the trainer.
- NCCL (vLLM engines): NCCL's broadcast is a ring (pipelined chunks): the root sends ~1x per group. vLLM's
  trainer API (``trainer_init``) posts its init info to ONE client with ``rank_offset`` fixed at 1
  (``nccl_common.build_worker_init_payload``), so it puts one engine in a group. A client fanning that post out
  with each engine's offset would put several in one, but fault isolation would go: a lost engine leaves the
  others' workers blocked inside the NCCL broadcast (no deadline on it; the abort, ``ncclCommAbort`` in
  ``PyNcclCommunicator.destroy``, is reached through ``/shutdown_weight_transfer_engine``, a worker call that
  we expect to queue behind the blocked update: not verified, no GPU here). So each vLLM engine keeps a group
  of its own: the trainer sends the model once per vLLM engine (trainer/sync/vllm_api.py).

Per sync (``prepare`` -> ``send`` -> ``finish``):

1. ``prepare`` (rank 0): pick each engine's path (``broadcast``; ``storage``; ``auto`` = broadcast for every
   engine that answers ``GET /weight_info``, storage for the others; an engine marked stale always goes by
   storage once). Form the group when its members changed (``POST /init_weight_transfer_engine`` to every
   member side by side, whose init info carries the wire parameters: packed, buffer size and count), open the
   update (``POST /start_weight_update``; an engine that fails is left out and the group formed again without
   it; one that answers 409 lost its group, e.g. restarted: the group is formed again), then post ``POST
   /update_weights {"update_info": {names, dtype_names, shapes}}`` (all three empty when the group's last round
   sent the same tensors, as vLLM's trainer does) in a thread per engine (it returns once the engine holds
   every tensor).
2. ``send`` (every trainer rank iterates the tensors, one at a time: under FSDP2 each is a ``full_tensor``
   gather; rank 0 alone packs them into buffers, cut as vLLM's packed producer cuts them, and sends each
   buffer to the group once, packing the next while the last is in flight).
3. ``finish`` (rank 0): hold the gateway (``/admin/pause``), ``POST /finish_weight_update {"weight_version"}``
   on every engine whose tensors all arrived (it swaps them in between batches), load the storage engines
   from the checkpoint URL (paused, as ``sync_weights`` does), stamp the version on the gateway, resume.
   The engines keep serving while tensors arrive: the pause they see is the swap alone. Storage engines
   load only once ``url_ready`` returns: the Syncer (trainer/sync/syncer.py) writes a sync's export
   (between checkpoints) after the broadcast, from the buffers ``send(keep=True)`` kept, in a
   ``BackgroundExport`` thread.

Never a hang, and fault isolation within one group: every collective waits at most ``timeout_s`` (gloo's
timeout on each send and receive), every HTTP call has a timeout. A rank lost mid-transfer (killed, frozen)
stops the chain behind it: the ranks before it finish (a failed forward does not fail a rank's own update),
the ones behind it fail or stall. After the sends ``_settle`` waits for the members' replies (half a second;
then, when every member still waited for answers ``GET /health`` within a short deadline, up to the deadline;
not at all when the trainer's own send to rank 1 failed), probes the ones that failed or did not reply,
destroys the group, forms it again from the ones that answered (a fresh port) and sends them the buffers again
(kept for that while the group has several members: one copy of the weights in CPU memory during the send).
So a lost engine behind rank 1 costs the others half a second, the probe and a second send, within the
deadline (2.3 s after a SIGSTOP with a 3 s deadline: tests/trainer/test_broadcast_sync.py); a lost rank 1
costs the deadline (the trainer's send to it times out), the probe and the second send. The lost ones, and any that fail again, are marked stale; the others
finish; the next sync loads a stale engine from storage at that step's version (whenever it answers again),
and the one after takes it into the group again. A sync raises WeightSyncError only when no engine got the
new weights.

vLLM (``vllm=URL`` engines): vLLM's own trainer engine (``WeightTransferTrainerFactory.trainer_init``, then
``send_weights`` each round: trainer/sync/vllm_api.py), fed the tensors of the same single iteration, its finish held
until ``finish`` runs it under the gateway's pause. It needs a supported vLLM (``VLLM_SUPPORTED``) and, for NCCL,
a CUDA device; otherwise vLLM engines take the storage path, and one log line says why.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import torch

from schemas.weight_transfer import checksum_key, packed_chunks, relay_slices, tensor_sha256

from .vllm_api import VllmSyncError
from .storage import Gateway, PolarEngine, VllmEngine, WeightSyncError, drop_adapter, switch_adapter

logger = logging.getLogger(__name__)

MODES = ("storage", "broadcast", "auto")


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The exported tensors (HF names, tied head left out), one at a time; under FSDP2 each is gathered
    on every rank (a collective: every rank must iterate all of them, in this order)."""
    from ..export import exported_tensors

    for name, t in exported_tensors(model).items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield name, full.detach()


def tensor_meta(model: torch.nn.Module) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, global shape) of every exported tensor, without gathering anything."""
    from ..export import exported_tensors

    return [(n, t.dtype, list(t.shape)) for n, t in exported_tensors(model).items()]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reach_address(url: str) -> str:
    """The address of this host as the engine at ``url`` reaches it."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


@dataclass
class _Group:
    """rank 0's end of the one gloo group of our engines: engine ``keys[i]`` is rank ``i + 1``, and the group
    relays (each buffer goes to rank 1 alone, which passes it down the chain). A vLLM engine's is a
    vllm_api.VllmLink."""

    keys: list[str]  # the members' URLs, in rank order
    pg: Any = None
    store: Any = None
    formed: float = field(default_factory=time.time)
    sent_meta: list | None = None  # the tensors the members last received in this group: sent again, named by []

    def send(self, buf: torch.Tensor) -> list:
        """``buf`` to rank 1, in the slices the chain relays (asynchronous: the works to wait for)."""
        return [self.pg.send([piece], 1, 0) for piece in relay_slices(buf.reshape(-1).view(torch.uint8))]

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # noqa: BLE001
                pass
        self.pg = self.store = None


class _Unformed(Exception):
    """The group did not form; ``failed``: the engines that refused or never joined (URL -> why)."""

    def __init__(self, failed: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in failed.items()))
        self.failed = failed


@dataclass
class _Pending:
    """One engine's transfer in flight: its ``/update_weights`` call runs in ``thread``."""

    engine: Any
    thread: threading.Thread | None = None
    error: str | None = None
    reply: dict | None = None
    dead: bool = False


@dataclass
class Packed:
    """One packed buffer as broadcast: the bytes of ``meta``'s tensors (name, dtype, shape), back to back."""

    buf: torch.Tensor  # uint8, CPU
    meta: list[tuple[str, torch.dtype, list[int]]]


class BackgroundExport:
    """One sync's export, written in a thread (rank 0 alone: no collective) while training goes on.
    ``wait()`` returns once it is written and raises WeightSyncError if it failed."""

    def __init__(self, url: str | None, write: Callable[[], Any], after: Callable[[], Any] | None = None):
        self.url, self.error, self.seconds = url, None, None
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(write, after), daemon=True, name="polar-export")
        self._thread.start()

    def _run(self, write: Callable[[], Any], after: Callable[[], Any] | None) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - reported by wait()
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
            logger.warning("export to %s failed: %s", self.url, self.error)
        finally:
            self.seconds = round(time.monotonic() - self._t0, 4)
            if after is not None:
                after()  # written or failed, the buffers are no longer read (WeightTransfer.release)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WeightSyncError(f"export to {self.url} not written within {timeout} s")
        if self.error:
            raise WeightSyncError(f"export to {self.url} failed: {self.error}")


class WeightTransfer:
    """Broadcast (or storage, per engine) weight sync with deadlines; see the module docstring."""

    def __init__(self, engines: list, mode: str = "broadcast", timeout_s: float = 60.0,
                 buffer_bytes: int = 64 << 20, num_buffers: int = 2, master_address: str = "",
                 verify: bool = False, throttle_s: float = 0.0, lora: bool = False):
        if mode not in MODES:
            raise ValueError(f"weight transfer mode must be one of {MODES}, got {mode!r}")
        self.engines, self.mode, self.timeout_s = list(engines), mode, float(timeout_s)
        self.buffer_bytes, self.num_buffers = int(buffer_bytes), int(num_buffers)
        self.master_address, self.verify, self.throttle_s = master_address, verify, throttle_s
        self.lora = lora  # the tensors are a LoRA adapter's (finish_adapter); vLLM engines then load from storage
        self.stale: set[str] = set()  # engine URLs to load from storage at the next sync
        self.group: _Group | None = None  # our engines' one group (rank 0 here), formed again when its members change
        self._broken: str | None = None  # why this sync's sends to the group stopped (rank 1 lost)
        self.vllm_links: dict[str, Any] = {}  # vllm_api.VllmLink per vLLM engine
        self.vllm_init_info_cls = None  # None: vLLM's NCCL backend; tests name a gloo one registered with vLLM
        self._vllm_live: dict[str, Any] = {}  # this sync's vLLM links still receiving
        self._vllm_opened: list = []  # this sync's vLLM engines paused for a transfer (resumed by finish)
        self._vllm_why: str | None = None  # why vLLM engines cannot take the in-memory path (once computed)
        self.client = httpx.Client(timeout=self.timeout_s)
        self._pending: dict[str, _Pending] = {}
        self._storage: list = []
        self._meta: list[tuple[str, torch.dtype, list[int]]] = []
        self.checksums: dict[str, str] = {}  # the sent tensors' sha256 (verify=True)
        self.last: dict[str, Any] = {}  # the last sync's report
        # Send buffers live across syncs: a fresh 64 MiB buffer is page-faulted in as it is first written,
        # which cost more than the packing copy itself (bench/weight_sync.py). Two for double buffering, or,
        # when the buffers are kept for the background export, one per buffer of the sync, lent to that
        # export and taken back by ``release`` once it is written (one copy of the weights in CPU memory).
        self._ring: list[torch.Tensor] = []
        self._kept: list[torch.Tensor] = []
        self._kept_lent = False
        self._pool_lock = threading.Lock()

    @property
    def wire(self) -> dict[str, Any]:
        """The wire parameters, announced once per group in its init info (vLLM 0.28+), not per update."""
        return {"packed": True, "packed_buffer_size_bytes": self.buffer_bytes, "packed_num_buffers": self.num_buffers}

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _key(e) -> str:
        return e.base_url.rstrip("/")

    def _post(self, e, path: str, timeout: float | None = None, **kw) -> dict:
        url = f"{self._key(e)}{path}"
        try:
            r = self.client.post(url, timeout=timeout or self.timeout_s, **kw)
        except httpx.HTTPError as err:
            raise WeightSyncError(f"{url}: {type(err).__name__}: {err}") from err
        if r.status_code >= 400:
            raise WeightSyncError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            return {}

    def _answers_weight_info(self, e) -> bool:
        try:
            return self.client.get(f"{self._key(e)}/weight_info", timeout=min(self.timeout_s, 10)).status_code == 200
        except httpx.HTTPError:
            return False

    def _can_broadcast(self, e) -> bool:
        if isinstance(e, VllmEngine):  # vLLM takes an adapter from a path only: a LoRA run's goes by storage
            return not self.lora and self._vllm_unavailable() is None
        return isinstance(e, PolarEngine)

    def _vllm_unavailable(self) -> str | None:
        """Why vLLM engines go by storage (one line, logged once), or None."""
        if self._vllm_why is None:
            from .vllm_api import unsupported

            why = unsupported()
            if why is None and self.vllm_init_info_cls is None and not torch.cuda.is_available():
                why = "vLLM's NCCL backend needs a CUDA device"
            self._vllm_why = why or ""
            if why:
                logger.warning("vLLM engines load weights from storage: %s", why)
        return self._vllm_why or None

    def mark_stale(self, e, why: str) -> None:
        key = self._key(e)
        self.stale.add(key)
        if self.group is not None and key in self.group.keys:  # a lost rank breaks the chain: formed again without it
            self._close_group()
        self._vllm_live.pop(key, None)
        vlink = self.vllm_links.pop(key, None)
        if vlink is not None:
            vlink.close()
        logger.warning("engine %s is stale (%s): it loads from storage at the next sync", key, why)

    # ------------------------------------------------------------------ group
    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    def _alive(self, engines: list) -> set[str]:
        """The engines among ``engines`` that answer ``GET /health`` within the probe deadline (asked side by
        side: a frozen engine costs the probe once, not once per engine)."""
        probe = min(5.0, max(1.0, self.timeout_s / 2))
        alive: set[str] = set()

        def ask(e):
            try:
                if self.client.get(f"{self._key(e)}/health", timeout=probe).status_code == 200:
                    alive.add(self._key(e))
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=ask, args=(e,), daemon=True) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(probe + 1)
        return alive

    def _form(self, engines: list) -> _Group:
        """Form our engines' one group: the trainer rank 0, ``engines[i]`` rank ``i + 1`` (one process, one
        rank, each), relaying. Every engine's init call runs beside the trainer's rendezvous; _Unformed
        (naming who refused or never joined) within the deadline."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        keys = [self._key(e) for e in engines]
        address = self.master_address or _reach_address(keys[0])
        world = 1 + len(engines)
        td = datetime.timedelta(seconds=self.timeout_s)
        store = TCPStore(address, 0, world, True, timeout=td, wait_for_workers=False)
        failed: dict[str, str] = {}

        def call(rank: int, e) -> None:
            body = {"init_info": {"master_address": address, "master_port": store.port, "rank_offset": rank,
                                  "world_size": world, **self.wire, "relay": True}}
            try:
                self._post(e, "/init_weight_transfer_engine", timeout=self.timeout_s + 10, json=body)
            except WeightSyncError as err:
                failed[self._key(e)] = str(err)

        threads = [threading.Thread(target=call, args=(i + 1, e), daemon=True, name="polar-transfer-init")
                   for i, e in enumerate(engines)]
        for t in threads:
            t.start()
        try:
            pg = ProcessGroupGloo(PrefixStore("polar-weight-transfer", store), 0, world, td)
        except Exception as err:  # noqa: BLE001 - some engine never joined within the deadline
            for t in threads:
                t.join(timeout=2)
            why = f"the weight-transfer group did not form within {self.timeout_s:.0f} s: {str(err)[:200]}"
            raise _Unformed(failed or dict.fromkeys(keys, why)) from None
        for t in threads:
            t.join(timeout=self.timeout_s + 10)
        failed.update({k: "/init_weight_transfer_engine did not answer" for k, t in zip(keys, threads) if t.is_alive()})
        if failed:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001
                pass
            raise _Unformed(failed)
        return _Group(keys, pg, store)

    def _open_group(self, engines: list) -> list:
        """The group of ``engines`` (reused when its members are the same), every member's update opened
        (``/start_weight_update``). A member that fails is left out and the group formed again without it
        (once; an engine that answers 409 lost its group, e.g. restarted: formed again with it). Returns the
        members; the ones left out are stale and in this sync's storage list."""
        for attempt in range(3):
            if not engines:
                return []
            keys = [self._key(e) for e in engines]
            try:
                if self.group is None or self.group.keys != keys:
                    self._close_group()
                    self.group = self._form(engines)
                failed = {}
                for e in engines:
                    try:
                        self._post(e, "/start_weight_update")
                    except WeightSyncError as err:
                        failed[self._key(e)] = str(err)
            except _Unformed as err:
                failed = err.failed
            if not failed:
                return engines
            self._close_group()
            lost = {k: v for k, v in failed.items() if "HTTP 409" not in v} if attempt == 0 else failed
            if len(lost) == len(engines) or attempt == 2:
                lost = dict.fromkeys(keys, "; ".join(failed.values())) | failed
            for e in [e for e in engines if self._key(e) in lost]:
                self.last["errors"][self._key(e)] = lost[self._key(e)]
                self.mark_stale(e, f"prepare: {lost[self._key(e)]}")
                self._storage.append(e)  # still gets this version, from storage
            engines = [e for e in engines if self._key(e) not in lost]
        return engines

    def _open_vllm(self, e) -> None:
        """A vLLM engine's round: its group (formed again when the tensors changed), then ``send_weights`` started,
        waiting for the tensors ``send`` feeds it."""
        from .vllm_api import VllmLink

        key = self._key(e)
        vlink = self.vllm_links.get(key)
        if vlink is None or vlink.meta != self._meta:
            if vlink is not None:
                vlink.close()
            vlink = VllmLink(key, self._meta, self.master_address or _reach_address(key), self.timeout_s,
                             self.buffer_bytes, self.num_buffers, self.vllm_init_info_cls)
            self.vllm_links.pop(key, None)
            vlink.form()
            self.vllm_links[key] = vlink
        vlink.open()
        self._vllm_live[key] = vlink
        self._vllm_opened.append(e)

    # ------------------------------------------------------------------ the three steps
    def prepare(self, meta: list[tuple[str, torch.dtype, list[int]]]) -> bool:
        """rank 0: choose each engine's path, form groups, open the updates, post ``update_info``. Returns
        whether tensors are to be sent (every trainer rank must then iterate them: ``send``)."""
        t0 = time.monotonic()
        self._meta, self._pending, self._storage, self.checksums = list(meta), {}, [], {}
        self._vllm_live, self._vllm_opened = {}, []
        self.last = {"broadcast": [], "storage": [], "stale": [], "errors": {}}
        sizes = [math_prod(s) * d.itemsize for _, d, s in meta]
        nbuf = len(packed_chunks(sizes, self.buffer_bytes))
        update_info = {"names": [n for n, _, _ in meta], "dtype_names": [_dtype_name(d) for _, d, _ in meta],
                       "shapes": [list(s) for _, _, s in meta]}
        ours: list = []  # our engines taking the broadcast: one group
        self._broken = None
        for e in self.engines:
            key = self._key(e)
            broadcast = (self.mode != "storage" and key not in self.stale and self._can_broadcast(e)
                         and (self.mode == "broadcast" or self._answers_weight_info(e)))
            if not broadcast:
                self._storage.append(e)
                continue
            if isinstance(e, VllmEngine):
                try:
                    e.pause()  # vLLM loads layer by layer, in place: no generation meanwhile
                    self._open_vllm(e)
                except Exception as err:  # noqa: BLE001 - VllmSyncError, WeightSyncError, or vLLM's own
                    self.last["errors"][key] = str(err)[:400]
                    self.mark_stale(e, f"prepare: {err}")
                    self._storage.append(e)
                continue
            ours.append(e)
        self._start_updates(self._open_group(ours), update_info, nbuf)
        self.last["bytes_per_engine"] = sum(sizes)
        self.last["buffers"] = nbuf
        self.last["prepare_s"] = round(time.monotonic() - t0, 4)
        return bool(self._pending) or bool(self._vllm_live) or self.verify

    def _start_updates(self, members: list, update_info: dict, nbuf: int) -> None:
        """Post every member's ``/update_weights`` in a thread of its own (it returns once the engine holds
        every tensor); vLLM 0.28+: a round with the same tensors as the group's last names none."""
        group = self.group
        if not members or group is None:
            return
        info = {"names": [], "dtype_names": [], "shapes": []} if group.sent_meta == self._meta else update_info
        for e in members:
            key = self._key(e)
            p = self._pending[key] = _Pending(e)
            p.thread = threading.Thread(target=self._update_call, args=(p, group, info, nbuf), daemon=True,
                                        name=f"polar-transfer-{key}")
            p.thread.start()

    def _update_call(self, p: _Pending, group: _Group, update_info: dict, nbuf: int) -> None:
        try:
            p.reply = self._post(p.engine, "/update_weights", timeout=self.timeout_s * (nbuf + 1) + 10,
                                 json={"update_info": update_info})
            group.sent_meta = self._meta  # a member that failed closes the group: the next one names them again
        except WeightSyncError as err:
            p.error = str(err)

    def live(self) -> bool:
        """Some engine of this sync is still receiving."""
        return (not self._broken and any(not p.dead for p in self._pending.values())) or bool(self._vllm_live)

    def _feed_vllm(self, name: str, t: torch.Tensor) -> None:
        for key, vlink in list(self._vllm_live.items()):
            try:
                vlink.feed(name, t)
            except Exception as err:  # noqa: BLE001 - VllmSyncError: this engine is dropped, the others go on
                self._vllm_live.pop(key, None)
                self.last["errors"][key] = str(err)[:400]

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], keep: bool = False) -> list[Packed] | None:
        """rank 0: pack ``tensors`` (in ``prepare``'s order) and broadcast each buffer to every live group.
        The iterator is always drained (under FSDP2 the other ranks gather every tensor too).

        ``keep``: return the packed buffers (copies: training may change the weights meanwhile), from which
        rank 0 writes the sync's export in the background (``checkpoint.write_packed_export``); they hold
        one copy of the weights in CPU memory until then. Without ``keep``, once no engine is left
        receiving the rest is only drained (no packing, no throttle)."""
        t0 = time.monotonic()
        td = datetime.timedelta(seconds=self.timeout_s)
        sizes = [math_prod(s) * d.itemsize for _, d, s in self._meta]
        chunks = packed_chunks(sizes, self.buffer_bytes)
        # With several engines in the group the buffers are kept until every member holds them: those behind
        # a lost rank are sent them again, in a group formed without it (_settle).
        hold = keep or len(self._pending) > 1
        out = self._buffers([sum(sizes[i] for i in idx) for idx in chunks], hold)
        it = iter(tensors)
        in_flight: list = []
        kept: list[Packed] = []
        sent = 0

        def wait_all():
            for work in in_flight:
                if self._broken:
                    break
                try:
                    work.wait(td)
                except Exception as err:  # noqa: BLE001 - a gloo timeout or a closed connection: rank 1 is lost
                    self._broken = f"send to {self.group.keys[0] if self.group else 'rank 1'}: {str(err)[:200]}"
            in_flight.clear()

        try:
            for j, idx in enumerate(chunks):
                if not hold and not self.verify and not self.live():
                    break  # every engine dropped out: only the draining below is left
                parts = []
                for i in idx:
                    name, t = next(it)
                    want = self._meta[i]
                    if name != want[0] or list(t.shape) != list(want[2]) or t.dtype != want[1]:
                        raise WeightSyncError(f"tensor {i} is {name} {tuple(t.shape)} {t.dtype}, update_info said {want}")
                    self._feed_vllm(name, t)
                    flat = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                    if self.verify:
                        self.checksums[checksum_key(name)] = tensor_sha256(t)
                    parts.append(flat)
                # A buffer of one tensor (an embedding, say) is that tensor's bytes already: it goes from its
                # own memory, and its copy for the export (keep) is made while it is in flight.
                single = len(parts) == 1
                buf = parts[0] if single else torch.cat(parts, out=out(j))  # out(j) is not in flight: see _buffers
                if hold:
                    kept.append(Packed(out(j) if single else buf, [self._meta[i] for i in idx]))
                wait_all()  # the previous buffer is out before this one goes (double buffering: packed meanwhile)
                to_group = self.group is not None and self._pending and not self._broken
                if to_group:
                    try:
                        in_flight.extend(self.group.send(buf))  # once, however many engines listen: they relay
                    except Exception as err:  # noqa: BLE001
                        self._broken = f"send: {str(err)[:200]}"
                if hold and single:
                    kept[-1].buf.copy_(buf)
                if not to_group:
                    continue
                sent += buf.numel()
                if self.throttle_s:
                    time.sleep(self.throttle_s)  # tests and benchmarks: a transfer slow enough to interrupt
            wait_all()
            sent += self._settle(kept if hold else None)
            for key, vlink in list(self._vllm_live.items()):
                try:
                    vlink.close_round()
                except Exception as err:  # noqa: BLE001 - VllmSyncError
                    self._vllm_live.pop(key, None)
                    self.last["errors"][key] = str(err)[:400]
        finally:
            for _ in it:  # nothing left normally; drained so FSDP2's gathers stay matched (an error too)
                pass
        self.last["bytes_sent"] = sent
        self.last["send_s"] = round(time.monotonic() - t0, 4)
        if hold and not keep:
            self.release(kept)
        return kept if keep else None

    def _settle(self, packed: list[Packed] | None) -> int:
        """After the sends: who in the group holds every tensor. The members' replies are awaited (half a second,
        then, unless a member still waited for does not answer ``/health``, up to the deadline; not at all when
        the trainer's own send failed: then no member can have them all); an engine that failed or did not reply
        is probed (``/health``, once); the ones that answer are put in a group formed without the lost ones (a
        fresh port) and sent the kept buffers again, once. The lost ones, and any that
        fail again, are stale at ``finish``. Returns the bytes sent again."""
        if not self._pending:
            return 0
        probed: dict[str, bool] = {}
        if not self._broken:
            deadline = time.monotonic() + self.timeout_s
            self._join(time.monotonic() + min(0.5, self.timeout_s))  # the last rank's reply trails by a few hops
            waiting = [p.engine for p in self._pending.values() if p.thread.is_alive()]
            if waiting:  # a member that does not answer /health is lost: the others need not wait for the deadline
                alive = self._alive(waiting)
                probed = {self._key(e): self._key(e) in alive for e in waiting}
                if all(probed.values()):
                    self._join(deadline)
        failed = [p for p in self._pending.values() if self._broken or p.error or p.thread.is_alive()]
        if not failed:
            return 0
        alive = self._alive([p.engine for p in failed if self._key(p.engine) not in probed])
        alive |= {k for k, up in probed.items() if up}
        for p in failed:
            p.dead = True
            p.error = p.error or self._broken or f"/update_weights did not return within {self.timeout_s:.0f} s"
            if self._key(p.engine) not in alive:
                p.error += f" (and {self._key(p.engine)} did not answer /health: left out of the group)"
        self._close_group()
        retry = [p.engine for p in failed if self._key(p.engine) in alive]
        if not retry or not packed:
            return 0
        logger.warning("weight transfer: %d engine(s) lost, sending again to %s in a group without them",
                       len(failed) - len(retry), [self._key(e) for e in retry])
        self._broken = None
        members = self._open_group(retry)
        names = {"names": [n for n, _, _ in self._meta], "dtype_names": [_dtype_name(d) for _, d, _ in self._meta],
                 "shapes": [list(s) for _, _, s in self._meta]}
        self._start_updates(members, names, len(packed))
        if not members or self.group is None:
            return 0
        td, sent = datetime.timedelta(seconds=self.timeout_s), 0
        for pk in packed:
            try:
                for work in self.group.send(pk.buf):
                    work.wait(td)
            except Exception as err:  # noqa: BLE001 - lost again: these stay failed (stale at finish)
                for e in members:
                    self._drop(self._pending[self._key(e)], f"sent again: {str(err)[:200]}")
                break
            sent += pk.buf.numel()
        return sent

    def _buffers(self, nbytes: list[int], keep: bool) -> Callable[[int], torch.Tensor]:
        """The send buffer of each packed buffer ``j`` (``nbytes[j]`` bytes), reused across syncs."""
        if keep:
            with self._pool_lock:
                lend = not self._kept_lent  # else the last export still reads them: fresh ones this once
                if lend:
                    self._kept_lent = True
                    if [b.numel() for b in self._kept] != nbytes:
                        self._kept = [torch.empty(n, dtype=torch.uint8) for n in nbytes]
            bufs = self._kept if lend else [torch.empty(n, dtype=torch.uint8) for n in nbytes]
            return bufs.__getitem__
        most = max(nbytes, default=0)
        if len(self._ring) != 2 or self._ring[0].numel() < most:
            self._ring = [torch.empty(most, dtype=torch.uint8) for _ in range(2)]
        return lambda j: self._ring[j % 2][:nbytes[j]]

    def release(self, packed: list[Packed] | None) -> None:
        """``send(keep=True)``'s buffers are no longer read (their export is written): the next sync reuses them."""
        with self._pool_lock:
            if packed and self._kept and packed[0].buf is self._kept[0]:
                self._kept_lent = False

    def _join(self, until: float) -> None:
        """Wait for the members' ``/update_weights`` replies until ``until`` (monotonic)."""
        for p in self._pending.values():
            p.thread.join(max(0.0, until - time.monotonic()))

    def _drop(self, p: _Pending, why: str) -> None:
        p.dead = True
        p.error = p.error or why
        self._close_group()  # the members' receives fail at once (connection closed), or at their own deadline

    def finish(self, url: str | None, version: int, gateway: Gateway | None = None,
               url_ready: Callable[[], None] | None = None) -> dict[str, Any]:
        """rank 0: finish the updates that arrived, load storage engines from ``url``, stamp, resume.
        ``url_ready``: blocks until ``url`` is written (a background export) and raises if it never will
        be; called only when some engine loads from storage. Returns the report; WeightSyncError when no
        engine got ``version``."""
        t0 = time.monotonic()
        ok = self._arrived()
        export: dict[str, Any] = {}

        def export_error() -> str | None:
            """None once ``url`` is written (waited for once: a stale or storage engine must load an export that
            exists); else why these engines stay stale."""
            if url is None:
                return "no checkpoint URL for the storage path"
            if url_ready is not None and "waited" not in export:
                t_wait = time.monotonic()
                try:
                    url_ready()
                except Exception as err:  # noqa: BLE001 - the export failed
                    export["error"] = f"export {url}: {err}"
                export["waited"] = True
                self.last["export_wait_s"] = round(time.monotonic() - t_wait, 4)
            return export.get("error")

        if self._storage:
            export_error()  # before the gateway is held: rollouts go on meanwhile
        paused: list = []
        done: list = []
        try:
            if gateway is not None:
                gateway.pause()
                paused.append(gateway)
            def finish(e) -> None:
                if isinstance(e, VllmEngine):
                    self._vllm_live[self._key(e)].finish(version)
                else:
                    reply = self._post(e, "/finish_weight_update", json={"weight_version": str(version)})
                    self.last.setdefault("engine_pause_s", {})[self._key(e)] = reply.get("pause_s")

            def load(e) -> None:
                if why := export_error():
                    raise WeightSyncError(why)
                t_pause = time.monotonic()
                e.pause()
                paused.append(e)
                e.load(url, version)
                e.resume()
                paused.remove(e)
                self.last.setdefault("engine_pause_s", {})[self._key(e)] = round(time.monotonic() - t_pause, 4)

            done = self._finish_each(ok, finish)
            for e in self._unverified(done):  # before the stamp: an engine that got other bytes reloads
                done.remove(e)
                self._storage.append(e)
            done += self._by_storage(load)
            if done and gateway is not None:
                gateway.stamp(version)
        finally:
            errors = []
            for part in reversed(paused):
                try:
                    part.resume()
                except WeightSyncError as err:
                    errors.append(str(err))
            for e in self._vllm_opened:  # paused for the transfer in prepare, whatever became of it
                try:
                    e.resume()
                except WeightSyncError as err:
                    errors.append(str(err))
            self._vllm_opened = []
        self.last["stale"] = sorted(self.stale)
        self.last["finish_s"] = round(time.monotonic() - t0, 4)
        self._pending = {}
        if errors:
            raise WeightSyncError("; ".join(errors))
        if not done and self.engines:
            raise WeightSyncError("no engine took policy version %d: %s" % (version, self.last["errors"]))
        return self.last

    def _arrived(self) -> list:
        """The engines whose ``/update_weights`` call returned, every tensor received; the others are stale."""
        ok = []
        for key, p in self._pending.items():
            if p.thread is not None and not p.dead:  # a dropped engine is stale already: its call may hang
                p.thread.join(timeout=self.timeout_s + 10)
                if p.thread.is_alive():
                    p.error = p.error or f"/update_weights did not answer within {self.timeout_s + 10:.0f} s"
            if p.error or p.dead:
                self.last["errors"][key] = p.error
                self.mark_stale(p.engine, p.error or "transfer failed")
            else:
                ok.append(p.engine)
        for e in self._vllm_opened:
            key = self._key(e)
            if key in self._vllm_live:
                ok.append(e)
            elif key not in self.stale:
                self.mark_stale(e, self.last["errors"].get(key) or "transfer failed")
        return ok

    def finish_adapter(self, url: str | None, version: int, name: str, config: dict, gateway: Gateway | None = None,
                       previous: str | None = None) -> dict[str, Any]:
        """rank 0, a LoRA run's sync (``sync_adapter``'s sequence): every engine whose tensors arrived serves
        them as adapter ``name`` (``/finish_weight_update`` with ``lora_name`` and ``lora_config``: ours; vLLM
        loads adapters from a path only), the others load it from ``url`` (``/v1/load_lora_adapter``); no
        engine pauses. Then the gateway is held, stamped with ``version`` and ``name``, resumed, and every
        engine unloads ``previous`` (``report["unload_errors"]`` if that fails).

        Raises WeightSyncError, before the stamp, when an engine did not get the adapter: the gateway then
        still routes to ``previous``, which every engine still serves, and the engines that took ``name``
        unload it again (a stale engine loads the next one from storage)."""
        t0 = time.monotonic()
        ok = self._arrived()
        body = {"weight_version": str(version), "lora_name": name, "lora_config": config}

        def load(e) -> None:
            if url is None:
                raise WeightSyncError(f"{self._key(e)}: no adapter directory for the storage path")
            e.load_adapter(name, url)

        done = self._finish_each(ok, lambda e: self._post(e, "/finish_weight_update", json=body))
        done += self._by_storage(load)
        self._pending = {}
        self.last["stale"] = sorted(self.stale)
        if len(done) < len(self.engines):
            self.last["finish_s"] = round(time.monotonic() - t0, 4)
            if drop_errors := drop_adapter(done, name):
                self.last["unload_errors"] = drop_errors
            raise WeightSyncError(f"adapter {name} (policy version {version}) not on every engine, the gateway "
                                  f"still routes to {previous}: {self.last['errors']}")
        if unload_errors := switch_adapter(done, version, name, gateway, previous):
            self.last["unload_errors"] = unload_errors
        self.last["finish_s"] = round(time.monotonic() - t0, 4)
        return self.last

    def _finish_each(self, engines: list, finish: Callable[[Any], Any]) -> list:
        """``finish(e)`` (the round's last call: the engine serves what it received) for each of ``engines``;
        the ones that took it. Full weights and adapter differ only in ``finish``."""
        done = []
        for e in engines:
            try:
                finish(e)
            except (WeightSyncError, VllmSyncError) as err:
                self.last["errors"][self._key(e)] = str(err)
                self.mark_stale(e, f"finish: {err}")
                continue
            self.last["broadcast"].append(self._key(e))
            done.append(e)
        return done

    def _by_storage(self, load: Callable[[Any], None]) -> list:
        """Each engine the in-memory path could not serve this round, brought up by ``load(e)`` from storage
        (full weights or adapter: only ``load`` differs); the ones that took it, the others stale."""
        done = []
        for e in self._storage:
            key = self._key(e)
            try:
                load(e)
            except WeightSyncError as err:
                self.last["errors"][key] = str(err)
                self.stale.add(key)
                continue
            self.last["storage"].append(key)
            self.stale.discard(key)
            done.append(e)
        return done

    def _unverified(self, engines: list) -> list:
        """``verify``: the engines among ``engines`` whose weights are not the sent tensors, compared as vLLM's
        ``/weight_checker`` compares (both sides' names); each is marked stale. vLLM's own digests name its fused
        parameters (qkv_proj...), which no trainer-side tensor matches, so vLLM engines are not compared."""
        if not self.verify or not self.checksums:
            return []
        t0, bad = time.monotonic(), []
        for e in [e for e in engines if isinstance(e, PolarEngine)]:
            key = self._key(e)
            try:
                r = self._post(e, "/weight_checker", json={"action": "compare", "baseline": self.checksums})
                if not r.get("match"):
                    raise WeightSyncError(f"{key}: weight_checker: {len(r.get('mismatches') or [])} tensors differ "
                                          f"from the sent ones, e.g. {(r.get('mismatches') or ['?'])[:3]}")
            except WeightSyncError as err:
                self.last["errors"][key] = str(err)
                self.last["broadcast"].remove(key)
                self.mark_stale(e, f"verify: {err}")
                bad.append(e)
        self.last["verify_s"] = round(time.monotonic() - t0, 4)
        return bad

    def verify_engines(self) -> dict[str, bool]:
        """``/weight_checker`` compare of each broadcast engine against the sent tensors' checksums."""
        out = {}
        for key in self.last.get("broadcast", []):
            r = self.client.post(f"{key}/weight_checker", json={"action": "compare", "baseline": self.checksums},
                                 timeout=self.timeout_s)
            out[key] = r.status_code == 200 and bool(r.json().get("match"))
        return out

    def sync(self, model_or_tensors, url: str | None, version: int, gateway: Gateway | None = None,
             write_export: Callable[[list[Packed] | None], None] | None = None) -> dict[str, Any]:
        """One process: prepare, send, finish. ``model_or_tensors``: a model, or a callable returning
        (meta, iterator of (name, tensor)). ``write_export(packed)``: writes ``url`` from the sent buffers
        (None when nothing was sent: then from the model) in a background thread, as the Syncer does; the
        storage engines wait for it; ``report["export"]`` is its BackgroundExport."""
        if isinstance(model_or_tensors, torch.nn.Module):
            meta, tensors = tensor_meta(model_or_tensors), named_tensors(model_or_tensors)
        else:
            meta, tensors = model_or_tensors()
        t0 = time.monotonic()
        packed = self.send(tensors, keep=write_export is not None) if self.prepare(meta) else None
        export = (BackgroundExport(url, lambda: write_export(packed), after=lambda: self.release(packed))
                  if write_export is not None else None)
        report = self.finish(url, version, gateway, url_ready=export.wait if export else None)
        report["sync_s"] = round(time.monotonic() - t0, 4)
        if export is not None:
            report["export"] = export
        return report

    def close(self) -> None:
        self._close_group()
        for link in self.vllm_links.values():
            link.close()
        self.vllm_links.clear()
        self.client.close()


def math_prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
