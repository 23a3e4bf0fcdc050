"""New weights into running engines: pause, load, resume, behind one small interface.

``sync_weights`` pauses the gateway (``/admin/pause`` holds new calls, drains in-flight ones) and every
engine, has each engine load the new checkpoint, stamps the new policy version on the gateway
(``/admin/policy_version``), and resumes everything, in ``finally`` so nothing is left paused by a
failed load. Calls after the resume are sampled from, and stamped with, the new version.

Two engines implement ``Engine``:
- ``PolarEngine``: our torch engine (``POST /pause?mode=wait``, ``/update_weights {"checkpoint_url",
  "version"}``, ``/resume``); it reads ``file://`` and ``s3://`` URLs itself.
- ``VllmEngine``: vLLM's RL routes (server started with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait``,
  ``/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``,
  ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``. vLLM reads a directory it can see,
  so the checkpoint must be on ``file://`` storage shared with the vLLM host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx


class WeightSyncError(RuntimeError):
    """An engine or the gateway refused a weight-sync call; the message names it and the reply."""


class Engine(Protocol):
    name: str

    def pause(self) -> None: ...
    def load(self, url: str, version: int) -> None: ...
    def resume(self) -> None: ...
    def served_version(self) -> int | None: ...
    def load_adapter(self, name: str, url: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...


def _post(client: httpx.Client, base: str, path: str, **kw) -> httpx.Response:
    try:
        r = client.post(f"{base.rstrip('/')}{path}", **kw)
    except httpx.HTTPError as e:
        raise WeightSyncError(f"{base}{path}: {type(e).__name__}: {e}") from e
    if r.status_code >= 400:
        raise WeightSyncError(f"{base}{path}: HTTP {r.status_code}: {r.text[:300]}")
    return r


@dataclass
class _HttpEngine:
    """What both engines share: ``POST /pause?mode=wait`` (finish in-flight requests, hold new ones)
    and ``POST /resume``; subclasses say how to load."""

    base_url: str
    timeout_s: float = 600.0
    name: str = ""
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=600.0))

    def _call(self, path: str, **kw) -> httpx.Response:
        return _post(self.client, self.base_url, path, timeout=self.timeout_s, **kw)

    def pause(self) -> None:
        self._call("/pause", params={"mode": "wait"})

    def resume(self) -> None:
        self._call("/resume")

    def load_adapter(self, name: str, url: str) -> None:
        """vLLM's runtime LoRA route: serve the adapter at ``url`` (PEFT layout) as model ``name``. In place:
        a sync retried after some engines loaded ``name``, or a resumed trainer's, loads it again, not a 400."""
        self._call("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": _adapter_path(url),
                                                   "load_inplace": True})

    def unload_adapter(self, name: str) -> None:
        self._call("/v1/unload_lora_adapter", json={"lora_name": name})


@dataclass
class PolarEngine(_HttpEngine):
    """Our torch engine."""

    name: str = "polar"

    def load(self, url: str, version: int) -> None:
        self._call("/update_weights", json={"checkpoint_url": url, "version": version})

    def served_version(self) -> int | None:
        """The version of the weights it serves (None when it does not answer)."""
        return _get_int(self.client, f"{self.base_url.rstrip('/')}/policy_version", "policy_version")


@dataclass
class VllmEngine(_HttpEngine):
    """A vLLM OpenAI-compatible server with its dev-mode RL routes."""

    name: str = "vllm"
    settings: Any = None  # infra Settings: where an s3:// adapter is read from (None: the environment's)

    def load(self, url: str, version: int) -> None:
        if not url.startswith("file://"):
            raise WeightSyncError(f"{self.base_url}: vLLM reloads from a local directory; {url} is not file://")
        path = url.removeprefix("file://")
        self._call("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path},
                                            "timeout": self.timeout_s})
        self._call("/reset_prefix_cache")  # the prefix cache holds KV computed by the old weights
        self._call("/update_weight_version", json={"new_version": str(version)})

    def served_version(self) -> int | None:
        return None  # not read back here: a resumed trainer always hands vLLM its weights again

    def load_adapter(self, name: str, url: str) -> None:
        """vLLM loads an adapter from a local directory only: one in object storage is copied to one first."""
        try:
            local = local_adapter_dir(url, self.settings)
        except (OSError, ValueError) as e:
            raise WeightSyncError(f"{self.base_url}: cannot bring adapter {url} to a local directory: {e}") from e
        super().load_adapter(name, local)


def _adapter_path(url: str) -> str:
    """What ``lora_path`` takes: a directory the engine can read (file:// becomes its path; vLLM reads local
    directories only, our engine also s3:// URLs)."""
    return url.removeprefix("file://")


def local_adapter_dir(url: str, settings=None, root: str | None = None) -> str:
    """A local directory holding the PEFT adapter at ``url``: its own path for file:// or a plain path; for
    s3:// a copy under ``root`` (default ``<cache>/adapters``), named after the URL (a version's adapter
    never changes once written) and made whole before it is named (a copy cut short is never handed over)."""
    import hashlib
    import os
    import shutil
    import tempfile

    from infra.settings import CACHE_DIR, Settings
    from infra.storage import filesystem

    if "://" not in url or url.startswith("file://"):
        return url.removeprefix("file://")
    base = os.path.join(root or os.path.join(CACHE_DIR, "adapters"),
                        hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + url.rstrip("/").rsplit("/", 1)[-1])
    if os.path.isfile(os.path.join(base, "adapter_config.json")):
        return base
    fs, path = filesystem(url, settings or Settings())
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        names = []
    if "adapter_config.json" not in names:
        raise FileNotFoundError(f"no adapter_config.json under {url} (PEFT's layout)")
    os.makedirs(os.path.dirname(base), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=os.path.dirname(base))
    try:
        for n in names:
            fs.get_file(f"{path.rstrip('/')}/{n}", os.path.join(tmp, n))
        if not os.path.exists(base):  # else a concurrent copy finished first: the same bytes
            os.replace(tmp, base)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return base


def engine_from_spec(spec: str, settings: Any = None) -> Engine:
    """``polar=http://host:port`` or ``vllm=http://host:port``."""
    kind, _, url = spec.partition("=")
    if kind == "polar":
        return PolarEngine(url)
    if kind == "vllm":
        return VllmEngine(url, settings=settings)
    raise ValueError(f"engine spec {spec!r}: expected polar=URL or vllm=URL")


@dataclass
class Gateway:
    """The gateway's admin routes: hold calls during a swap, then stamp the new version on later ones."""

    base_url: str
    admin_token: str
    drain_timeout_s: float = 600.0
    swap_budget_s: float = 600.0  # after draining: if no resume comes by then (we died), the gateway resumes itself
    run: str = ""  # the run's topic prefix, named in a LoRA stamp ('' : the gateway's own run)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=600.0))

    def _post(self, path: str, **kw) -> httpx.Response:
        return _post(self.client, self.base_url, path, headers={"authorization": f"Bearer {self.admin_token}"}, **kw)

    def pause(self) -> None:
        self._post("/admin/pause", params={"timeout_s": self.drain_timeout_s,
                                           "deadline_s": self.drain_timeout_s + self.swap_budget_s})

    def stamp(self, version: int, lora_name: str | None = None) -> None:
        """Stamp ``version`` on later calls (``schemas.PolicyStamp``); ``lora_name``: and send this run's calls
        (``run``, its topic prefix: a gateway may serve several) to that adapter."""
        extra = {"lora_name": lora_name, "run": self.run} if lora_name else {}
        self._post("/admin/policy_version", json={"version": version, **extra})

    def resume(self) -> None:
        self._post("/admin/resume")

    def stamped_version(self) -> int | None:
        return _get_int(self.client, f"{self.base_url.rstrip('/')}/admin/policy_version", "version",
                        headers={"authorization": f"Bearer {self.admin_token}"})


def _get_int(client: httpx.Client, url: str, key: str, **kw) -> int | None:
    try:
        r = client.get(url, timeout=10, **kw)
        return int(r.json()[key]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def already_served(engines: list[Engine], version: int, gateway: Gateway | None = None) -> bool:
    """Every engine serves ``version`` and the gateway stamps it: a resumed trainer has nothing to hand them
    (an engine restarted since, or one that cannot say, serves something else and is synced again)."""
    return all(e.served_version() == version for e in engines) and (gateway is None or gateway.stamped_version() == version)


def sync_weights(engines: list[Engine], url: str, version: int, gateway: Gateway | None = None) -> dict[str, float]:
    """Pause the gateway and all engines, load ``url`` into each engine, stamp ``version``, resume all.

    Returns each engine's pause, seconds from its pause to its resume (what its rollouts lost), by base URL.
    Raises WeightSyncError naming the first failure; whatever was paused before it is resumed anyway.
    """
    paused: list[tuple[Engine | Gateway, float]] = []
    pauses: dict[str, float] = {}
    try:
        for part in ([gateway] if gateway else []) + list(engines):
            part.pause()
            paused.append((part, time.monotonic()))
        for e in engines:
            e.load(url, version)
        if gateway is not None:
            gateway.stamp(version)
    finally:
        errors = []
        for part, t in reversed(paused):  # engines first, the gateway last: calls resume on new weights
            try:
                part.resume()
            except WeightSyncError as err:
                errors.append(str(err))
            if part is not gateway:
                pauses[getattr(part, "base_url", part.name)] = round(time.monotonic() - t, 4)
        if errors:
            raise WeightSyncError("; ".join(errors))
    return pauses


def drop_adapter(engines: list, name: str) -> list[str]:
    """Unload ``name`` from ``engines``, best effort: the errors. After a sync that failed before its stamp,
    the new name (the next sync loads another version's, so a half-loaded one would stay for good, holding a
    LoRA slot, ``--max-loras``); after a stamp, the previous version's."""
    errors = []
    for e in engines:
        try:
            e.unload_adapter(name)
        except WeightSyncError as err:
            errors.append(str(err))
    return errors


def switch_adapter(engines: list, version: int, name: str, gateway: Gateway | None, previous: str | None) -> list[str]:
    """Once every engine serves ``name``: hold the gateway, stamp ``version`` and ``name``, resume it, then
    unload ``previous`` from ``engines`` (after the drain no call uses it). Returns the unloads' errors."""
    if gateway is not None:
        gateway.pause()
        try:
            gateway.stamp(version, lora_name=name)
        finally:
            gateway.resume()
    return drop_adapter(engines, previous) if previous and previous != name else []


def sync_adapter(engines: list[Engine], url: str, version: int, name: str, gateway: Gateway | None = None,
                 previous: str | None = None) -> list[str]:
    """A LoRA run's sync: every engine loads the adapter at ``url`` as ``name`` beside the one it serves
    (no engine pauses), then ``switch_adapter``: the gateway drains its calls, is stamped with ``version``
    and ``name`` and resumes, and only then does every engine unload ``previous``.

    Raises WeightSyncError when a load or the gateway fails (the old adapter then stays, and is still
    what the gateway routes to; the engines that loaded ``name`` unload it again, ``drop_adapter``). An
    unload that fails does not fail the sync: its errors are returned.
    """
    loaded: list[Engine] = []
    try:
        for e in engines:
            e.load_adapter(name, url)
            loaded.append(e)
    except WeightSyncError:
        drop_adapter(loaded, name)
        raise
    return switch_adapter(engines, version, name, gateway, previous)
