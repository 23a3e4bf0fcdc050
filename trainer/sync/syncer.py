"""``Syncer``: the one object through which train() hands new weights to the engines.

train() calls ``resync`` once (at a resume: the engines get the checkpoint's weights), ``sync`` after each
``sync_every``-th step (the new version to every engine, a storage fallback for any that cannot take it in
memory, then the gateway's stamp) and ``close``. It alone reads the ``weight_transfer*`` settings and picks
the path: storage (engines load an export's URL: trainer/sync/storage.py), in memory (``WeightTransfer``:
trainer/sync/broadcast.py, vLLM engines through trainer/sync/vllm_api.py), both taking the same ``Payload``
(full weights or a LoRA adapter: trainer/sync/payload.py).

Every rank makes one and calls ``sync`` (exports and FSDP2 gathers are collectives); rank 0 alone talks to
Kafka (the PolicyVersion), the engines and the gateway, and decides; the other ranks follow its decisions.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from producers.publisher import Publisher, PublishError
from schemas import PolicyVersion, new_event_id

from .. import checkpoint, lora
from ..metrics import RunLog, record_sync
from .broadcast import BackgroundExport, WeightTransfer
from .payload import Payload
from .storage import Gateway, WeightSyncError, already_served, engine_from_spec, sync_adapter, sync_weights

# A sync report's figures that its log line carries, where the path measured them.
_REPORTED = ("broadcast", "storage", "stale", "errors", "bytes_sent", "engine_pause_s", "export_wait_s",
             "verify_s", "unload_errors")


def broadcast_object(obj: Any, distributed: bool = True) -> Any:
    """rank 0's ``obj`` on every rank."""
    if not (distributed and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Syncer:
    """The engines' side of a run: which version they serve (``synced``), the failed syncs since
    (``failures``), and the paths that bring them a new one. See the module docstring."""

    def __init__(self, cfg: Any, settings: Any, model: Any, model_dir: str | Path, adapter: dict | None,
                 state: dict[str, Any], master: bool, distributed: bool, log: RunLog | None = None,
                 counters: Any = None):
        self.cfg, self.settings, self.model, self.model_dir, self.adapter = cfg, settings, model, model_dir, adapter
        self.root, self.master, self.distributed, self.log, self.counters = (settings.checkpoint_url, master,
                                                                             distributed, log, counters)
        # The version the engines last loaded (a sync that succeeded) and the failed syncs since: staleness
        # counts from the former, so failed syncs do not make the groups the engines still sample stale.
        # (rank 0's business; the marker also covers the syncs that followed the checkpoint)
        self.synced = int(state.get("synced_version", state["policy_version"]))
        if master:
            self.synced = max(self.synced, checkpoint.read_engine_version(self.root, settings))
        self.failures = int(state.get("sync_failures", 0))
        self.error: Exception | None = None  # rank 0: the last failed sync's error
        self.published: PolicyVersion | None = None  # rank 0: this sync's record, published again once it serves
        # In memory to the engines that can take it (a LoRA run sends its adapter's tensors only; an engine that
        # cannot take them loads the adapter's directory through vLLM's /v1/load_lora_adapter), else storage.
        self.in_memory = cfg.weight_transfer != "storage" and bool(cfg.engines) and bool(cfg.sync_every)
        self.engines, self.transfer = [], None
        self.gateway = self.publisher = None
        self._export: BackgroundExport | None = None  # rank 0: the last sync's export, written in a thread
        if not master:
            return
        self.publisher = Publisher(settings, client_id="polar-trainer") if cfg.sync_every else None
        self.engines = [engine_from_spec(s, settings) for s in cfg.engines]
        if self.in_memory:
            self.transfer = WeightTransfer(self.engines, cfg.weight_transfer, cfg.weight_transfer_timeout_s,
                                           cfg.weight_transfer_buffer_mb << 20,
                                           # where the engines reach this trainer: the machine's advertised
                                           # host, unless the trainer names one of its own
                                           master_address=cfg.weight_transfer_address or settings.advertised_host,
                                           verify=cfg.weight_transfer_verify,
                                           throttle_s=cfg.weight_transfer_throttle_s, lora=adapter is not None)
        if cfg.gateway:
            self.gateway = Gateway(cfg.gateway, settings.admin_token, run=settings.topic_prefix)

    # ------------------------------------------------------------------ what train() reads
    def state(self) -> dict[str, int]:
        """What a checkpoint keeps of the sync (a restart counts staleness and failures on from it)."""
        return {"synced_version": self.synced, "sync_failures": self.failures}

    def served(self, version: int) -> int:
        """The version the engines sample with (without syncs, nothing to go by but the trainer's own)."""
        return self.synced if self.cfg.sync_every else version

    def due(self, step: int) -> bool:
        return bool(self.cfg.sync_every) and step % self.cfg.sync_every == 0

    def payload(self, version: int, url: str | None = None) -> Payload:
        return Payload.of(self.model, version, self.cfg.model_name, self.adapter, url)

    def _previous(self, p: Payload) -> str | None:
        """The adapter the engines serve now, unloaded once ``p``'s is stamped."""
        return lora.adapter_name(self.cfg.model_name, self.synced) if p.adapter and self.synced else None

    # ------------------------------------------------------------------ resync / sync / close
    def resync(self, url: str, version: int, step: int) -> None:
        """rank 0, at a resume from the checkpoint at ``url``: an engine started after the crash serves the model
        it was started with, so every engine gets the weights this run resumes from, under the version that names
        them (one still up reloads them, unless it and the gateway already serve that version). A failure is
        logged: the first step's sync tries again."""
        if not (self.master and self.cfg.sync_every and self.engines):
            return
        p = self.payload(version, url)  # the checkpoint directory holds the adapter in PEFT's layout
        try:
            if not p.adapter and already_served(self.engines, version, self.gateway):  # reloading: a pause for nothing
                self.log.write({"event": "resync", "step": step, "policy_version": version,
                                "skipped": "already served"})
            else:
                self._from_storage(p)
                self.log.write({"event": "resync", "step": step, "policy_version": version, **p.log_fields()})
            self.synced = version
        except WeightSyncError as e:
            self.log.write({"event": "sync_error", "step": step, "policy_version": version, "error": str(e)})

    def sync(self, step: int, version: int, url: str | None, metrics: dict[str, float] | None) -> bool:
        """Every rank, after step ``step`` made ``version`` (``url``: this step's checkpoint, if one was written):
        export (unless the checkpoint serves), publish the PolicyVersion, bring the engines the new version,
        stamp it. Returns, on every rank, whether ``max_sync_failures`` syncs in a row have now failed."""
        export_meta = {"policy_version": version, "step": step}
        p = self.payload(version)
        # Between checkpoints engines get a weights-only export. In memory, rank 0 writes it after the transfer
        # from the very buffers it sent, in a thread (no collective), while training goes on: the step waits for
        # the engines, not for storage. Its URL is known now: its directory and index are written first (a
        # restart counts the version), the PolicyVersion names it, and an engine that loads from storage at this
        # sync (stale, or not in memory) waits for it in finish(). An adapter is small: written at once.
        background = self.in_memory and url is None and not p.adapter
        t0 = time.perf_counter()
        if background:
            url = p.export_dir(self.root)
            if self.master:
                self.join_export()  # the previous sync's (long written, normally)
                checkpoint.begin_export(url, p.meta(), self.settings)
        elif p.adapter or url is None:  # every version's adapter in a directory of its own
            url = p.export(self.root, self.model, self.model_dir, self.settings, export_meta)
        p.url = url
        failed, transferring = None, False
        if self.master:
            try:  # a failure here leaves training and its checkpoint intact; the next sync catches up
                self.published = PolicyVersion(model=self.cfg.model_name, version=version, checkpoint_url=url,
                                               step=step, metrics={k: float(v) for k, v in metrics.items()})
                self.publisher.publish_sync(self.published)
                if self.transfer is not None:
                    transferring = self.transfer.prepare(p.meta())
            except (PublishError, WeightSyncError) as e:
                failed = e
        sending = self.in_memory and broadcast_object(transferring, self.distributed)
        packed, failed = self._send(p, background, sending, failed)
        if background:
            if sending and broadcast_object(packed is not None if self.master else None, self.distributed):
                if self.master:  # the thread holds the buffers until they are written, then gives them back
                    write = partial(checkpoint.write_packed_export, url, packed, self.model, self.model_dir,
                                    self.settings, export_meta)
                    self._export = BackgroundExport(url, write, after=partial(self.transfer.release, packed))
            else:  # nothing was gathered (no engine took the transfer, or it failed): as without one
                checkpoint.export_weights(url, self.model, self.model_dir, self.settings, export_meta)
        stop = self._finish(p, step, failed, t0) if self.master else False
        return broadcast_object(stop, self.distributed)

    def _send(self, p: Payload, keep: bool, sending: bool, failed: Exception | None):
        """Every rank, when rank 0 opened a transfer: iterate ``p``'s tensors (under FSDP2 each is gathered on
        every rank), rank 0 sending them. Returns the packed buffers (``keep``) and the first failure."""
        packed = None
        if not sending:
            return packed, failed
        tensors = p.tensors()
        if not self.master:
            for _ in tensors:
                pass
            return packed, failed
        try:
            packed = self.transfer.send(tensors, keep=keep)
        except WeightSyncError as e:
            failed = failed or e
        return packed, failed

    def _finish(self, p: Payload, step: int, failed: Exception | None, t0: float) -> bool:
        """rank 0: the engines serve ``p`` (or the failure is counted); whether to stop."""
        try:
            if failed is not None:
                raise failed
            report = self._deliver(p)
            event = {"event": "sync", "step": step, "policy_version": p.version, "mode": report.pop("mode"),
                     **p.log_fields(), "sync_s": round(time.perf_counter() - t0, 4), **report}
            self.log.write(event)
            self._publish_synced(event)
            self.synced, self.failures = p.version, 0
            checkpoint.write_engine_version(self.root, p.version, self.settings)
            record_sync(True, 0)
            return False
        except (PublishError, WeightSyncError) as e:
            self.counters.update(sync_errors=1)
            self.failures += 1
            record_sync(False, self.failures)
            self.log.write({"event": "sync_error", "step": step, "policy_version": p.version, "error": str(e),
                            "failures_in_a_row": self.failures})
            self.error = e
            return bool(self.cfg.max_sync_failures and self.failures >= self.cfg.max_sync_failures)

    def _publish_synced(self, event: dict[str, Any]) -> None:
        """rank 0: the version just delivered, published again with its sync (PolicyVersion.sync), for a
        driver that cannot read train.jsonl. Its loss costs the report a figure, not the run: logged, not
        counted as a failed sync."""
        fields = {k: v for k, v in event.items() if k not in ("event", "step", "policy_version")}
        try:
            self.publisher.publish_sync(self.published.model_copy(update={"sync": fields, "event_id": new_event_id()}))
        except PublishError as e:
            self.log.write({"event": "sync_unpublished", "policy_version": event["policy_version"], "error": str(e)})

    def _deliver(self, p: Payload) -> dict[str, Any]:
        """rank 0: finish an in-memory transfer (its engines' storage fallback included), or load every engine
        from storage; the gateway stamped either way. Returns what the log line says of it."""
        if self.transfer is None:
            return {"mode": "storage", **self._from_storage(p)}
        if p.adapter:
            report = self.transfer.finish_adapter(p.url, p.version, p.name, p.config, self.gateway, self._previous(p))
        else:
            report = self.transfer.finish(p.url, p.version, self.gateway,
                                          url_ready=self._export.wait if self._export else None)
        export = {} if p.adapter else {"export": "background" if self._export else "written"}
        return {"mode": self.cfg.weight_transfer, **export, **{k: report[k] for k in _REPORTED if report.get(k)}}

    def _from_storage(self, p: Payload) -> dict[str, Any]:
        """Every engine loads ``p.url``: weights paused (``sync_weights``), an adapter beside the one it serves
        (``sync_adapter``); then the gateway's stamp."""
        if p.adapter:
            errors = sync_adapter(self.engines, p.url, p.version, p.name, self.gateway, previous=self._previous(p))
            return {"storage": [e.base_url for e in self.engines], **({"unload_errors": errors} if errors else {})}
        pauses = sync_weights(self.engines, p.url, p.version, self.gateway)
        return {"storage": sorted(pauses), "engine_pause_s": pauses} if pauses else {}

    def stop_error(self, step: int, checkpoint_url: str | None, rank: int) -> WeightSyncError:
        """The error a run stops with after ``max_sync_failures`` failed syncs in a row (one line): going on
        would train ever further from the policy the engines sample with."""
        if not self.master:
            return WeightSyncError(f"rank {rank}: stopped with rank 0 at step {step} (weight syncs failed)")
        error = WeightSyncError(" ".join(
            f"{self.failures} weight syncs in a row failed (max_sync_failures={self.cfg.max_sync_failures}); "
            f"stopped at step {step}, checkpoint {checkpoint_url}; engines still serve policy version "
            f"{self.synced}; last error: {self.error}".split()))
        error.__cause__ = self.error
        return error

    def join_export(self) -> None:
        """rank 0: wait for the export being written in the background (if any) and log how it went."""
        if self._export is None:
            return
        done, self._export = self._export, None
        try:
            done.wait()
            self.log.write({"event": "export", "url": done.url, "seconds": done.seconds})
        except WeightSyncError as e:  # the engines have those weights in memory; a stale one waits for the next
            self.counters.update(export_errors=1)
            self.log.write({"event": "export_error", "url": done.url, "error": str(e)})

    def close(self) -> None:
        """rank 0: the export in flight written, the publisher and the transfer's groups closed."""
        self.join_export()
        if self.publisher is not None:
            self.publisher.close()
        if self.transfer is not None:
            self.transfer.close()
