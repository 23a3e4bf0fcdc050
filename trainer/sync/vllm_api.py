"""vLLM engines' in-memory weight sync, through vLLM's own trainer API (0.28 and later).

vLLM 0.28 removed the static ``NCCLWeightTransferEngine.trainer_init`` (vllm#50902). The trainer side is now a
stateful engine: ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` forms the
group (the wire parameters ride ``init_info`` and reach the engine at init), and each ``send_weights()`` runs
start -> update (concurrently with the broadcast) -> finish through the client, naming no tensors when the
source's metadata is unchanged since the last round.

``VllmLink`` fits that into our sync's three steps (trainer/sync/broadcast.py): ``open`` starts ``send_weights`` in a
thread whose ``WeightSource`` is fed the tensors our single iteration reads (``feed``: under FSDP2 each is a
gather every rank runs once, so vLLM may not iterate the model itself), and whose client holds back the finish
(``HeldFinish``) until ``finish(version)`` runs it under the gateway's pause, as our engines' finish is. Every
call that can block has a deadline (a thread joined with a timeout; vLLM's HTTP client its own timeout): an
engine that misses one is dropped from the sync and loads from storage at the next.

Supported vLLM versions: ``VLLM_SUPPORTED``. Outside them (or without vLLM) ``unsupported()`` says why in one
line, and vLLM engines take the storage path. tests/trainer/test_vllm_api.py checks every symbol in ``USED``
against the pinned wheel and drives this module, in the wheel's venv, against our engine.
"""

from __future__ import annotations

import importlib.metadata
import queue
import re
import socket
import threading
from functools import cached_property
from typing import Any

import httpx
import torch

SUPPORTED_FROM, SUPPORTED_BELOW = (0, 28), (0, 34)  # the trainer API of vllm#50902, as the 0.33 wheel has it
VLLM_SUPPORTED = ">={}.{},<{}.{}".format(*SUPPORTED_FROM, *SUPPORTED_BELOW)
# Every vLLM symbol the trainer touches, module -> attribute paths, the methods it calls on vLLM's objects included
# (tests/trainer/test_vllm_api.py resolves each in the pinned wheel, and fails on an import not listed here).
USED = {
    "vllm.distributed.weight_transfer.factory": ["WeightTransferTrainerFactory.trainer_init"],
    "vllm.distributed.weight_transfer.nccl_engine": ["NCCLTrainerInitInfo"],
    "vllm.distributed.weight_transfer.clients": ["HTTPVLLMWeightSyncClient",
                                                 "HTTPVLLMWeightSyncClient.finish_weight_update",
                                                 "HTTPVLLMWeightSyncClient.shutdown_weight_transfer_engine"],
    "vllm.distributed.weight_transfer.base": ["WeightSource", "ParamMeta", "TrainerWeightTransferEngine.send_weights",
                                              "TrainerWeightTransferEngine.shutdown"],
}
_END = object()


class VllmSyncError(RuntimeError):
    """A vLLM engine's in-memory transfer failed or missed its deadline; the message says which step."""


def unsupported() -> str | None:
    """None when an installed vLLM is in ``VLLM_SUPPORTED``; else the one-line reason."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM is not installed here"
    release = tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])  # 0.34.0rc1 -> (0, 34, 0)
    if not SUPPORTED_FROM <= release < SUPPORTED_BELOW:
        return f"vLLM {version} is installed; the in-memory sync supports vllm{VLLM_SUPPORTED}"
    return None


class HeldFinish:
    """vLLM's ``VLLMWeightSyncClient`` (structural: four methods) around another, which holds back the finish:
    ``send_weights`` ends with it, but the new weights must not serve before the gateway is paused to stamp them."""

    def __init__(self, client: Any):
        self.client = client
        self.finish_asked = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.finish_asked = False
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finish_asked = True

    def finish(self, weight_version: str) -> None:
        self.client.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.client.shutdown_weight_transfer_engine()


def _fed_source(meta: list[tuple[str, torch.dtype, list[int]]]):
    """A vLLM ``WeightSource`` whose ``iter_full`` yields what ``put`` is given (until ``_END``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class FedSource(WeightSource):
        def __init__(self) -> None:
            self.q: queue.Queue = queue.Queue(maxsize=2)  # two tensors ahead at most: no copy of the model

        @cached_property
        def metadata(self) -> list:
            return [ParamMeta(n, d, tuple(s)) for n, d, s in meta]

        def iter_full(self):
            while (item := self.q.get()) is not _END:
                yield item

    return FedSource()


class VllmLink:
    """rank 0's end of one vLLM engine's transfer: vLLM's trainer engine, its client and its source."""

    def __init__(self, base_url: str, meta: list[tuple[str, torch.dtype, list[int]]], address: str,
                 timeout_s: float, buffer_bytes: int, num_buffers: int, init_info_cls: Any = None):
        self.base_url, self.meta, self.timeout_s = base_url.rstrip("/"), list(meta), float(timeout_s)
        self.address, self.buffer_bytes, self.num_buffers = address, int(buffer_bytes), int(num_buffers)
        self.init_info_cls = init_info_cls  # None: vLLM's NCCL one; tests register a gloo backend
        self.engine = self.client = self.source = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def _bounded(self, what: str, fn, timeout: float) -> Any:
        """``fn()`` in a thread, joined within ``timeout``: VllmSyncError naming ``what`` otherwise."""
        box: dict[str, Any] = {}

        def run():
            try:
                box["out"] = fn()
            except Exception as e:  # noqa: BLE001 - reported below, with the step's name
                box["error"] = f"{type(e).__name__}: {str(e)[:300]}"

        t = threading.Thread(target=run, daemon=True, name=f"polar-vllm-{what}")
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise VllmSyncError(f"{self.base_url}: {what} did not return within {timeout:.0f} s")
        if "error" in box:
            raise VllmSyncError(f"{self.base_url}: {what}: {box['error']}")
        return box.get("out")

    def form(self) -> None:
        """Form the group: the engine's world size, then vLLM's ``trainer_init`` (the rendezvous, and the init
        info with the wire parameters posted to the engine)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        try:
            r = httpx.get(f"{self.base_url}/get_world_size", timeout=min(self.timeout_s, 30))
            r.raise_for_status()
            workers = int(r.json()["world_size"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise VllmSyncError(f"{self.base_url}: /get_world_size: {str(e)[:200]}") from None
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        cls = self.init_info_cls or NCCLTrainerInitInfo
        info = cls(master_address=self.address, master_port=port, world_size=1 + workers, packed=True,
                   packed_buffer_size_bytes=self.buffer_bytes, packed_num_buffers=self.num_buffers, rank=0)
        self.client = HeldFinish(HTTPVLLMWeightSyncClient(self.base_url, timeout=self.timeout_s + 10))
        self.source = _fed_source(self.meta)
        self.engine = self._bounded("trainer_init", lambda: WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=self.source), self.timeout_s + 20)

    def open(self) -> None:
        """Start this round's ``send_weights`` (start, then update beside the broadcast of what ``feed`` gets)."""
        self._error = None
        self.source.q = queue.Queue(maxsize=2)

        def run():
            try:
                self.engine.send_weights()
            except Exception as e:  # noqa: BLE001 - read by close_round
                self._error = f"send_weights: {type(e).__name__}: {str(e)[:300]}"

        self._thread = threading.Thread(target=run, daemon=True, name=f"polar-vllm-send-{self.base_url}")
        self._thread.start()

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        try:
            self.source.q.put((name, tensor), timeout=self.timeout_s)
        except queue.Full:
            raise VllmSyncError(f"{self.base_url}: took no tensor within {self.timeout_s:.0f} s "
                                f"({self._error or 'send_weights stalled'})") from None

    def close_round(self) -> None:
        """Every tensor fed: wait (within the deadline) for the engine to hold them all."""
        try:
            self.source.q.put(_END, timeout=self.timeout_s)
        except queue.Full:
            raise VllmSyncError(f"{self.base_url}: send_weights stalled ({self._error or 'no error yet'})") from None
        self._thread.join(self.timeout_s * 2 + 10)
        if self._thread.is_alive():
            raise VllmSyncError(f"{self.base_url}: /update_weights did not return within {self.timeout_s * 2 + 10:.0f} s")
        if self._error or not self.client.finish_asked:
            raise VllmSyncError(f"{self.base_url}: {self._error or 'send_weights ended before its finish'}")

    def finish(self, version: int) -> None:
        """Serve the received weights as ``version`` (the finish ``send_weights`` asked for, held until now)."""
        self._bounded("finish_weight_update", lambda: self.client.finish(str(version)), self.timeout_s + 20)

    def close(self) -> None:
        """Leave the group, best effort (the engine answers /shutdown_weight_transfer_engine)."""
        for step in (lambda: self.engine and self.engine.shutdown(),
                     lambda: self.client and self.client.shutdown_weight_transfer_engine()):
            try:
                self._bounded("shutdown", step, 10)
            except VllmSyncError:
                pass
        self.engine = None
