"""GRPO on the groups of polar.groups. Reads top to bottom, like nanoGPT's train.py.

    polarstream train --model DIR [--groups-per-step 4] [--set key=value ...]
    torchrun --nproc_per_node 2 -m trainer --model DIR ...     # FSDP2 (gloo on CPU, nccl on GPU)

Each step: take groups from Kafka (rank 0) -> choose (dedupe, staleness, zero variance) -> broadcast
the samples -> the step (step.train_step: pack into token-budget micro-batches, forward/backward on
this rank's share, clip, AdamW) -> log (JSONL, TensorBoard, stdout) -> checkpoint with the consumed
offsets -> publish a PolicyVersion and push the weights to the engines (trainer/sync/'s Syncer). A restart
resumes from the newest complete checkpoint and seeks to its offsets, so no group is trained twice and none is skipped.
Several processes shard the model with FSDP2 (parallel.py); every rank writes its own part of each
checkpoint and export, so those steps are collectives, and rank 0 alone talks to Kafka and the engines.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.settings import Settings

from . import checkpoint, lora
from .config import TrainConfig
from .kafka_io import GroupSource, offsets_from_json
from .loss import summarize
from .metrics import RunLog, Sinks, health_warnings, mismatch_warnings
from .optim import build_optimizer
from .packing import Sample, samples_from_group
from .parallel import build_model, place
from .selection import SeenIds, StepPlan, plan_step
from .step import train_step
from .sync import Syncer
from .sync.syncer import broadcast_object as _broadcast

logger = logging.getLogger(__name__)

# Settings whose values must not be copied into checkpoints.
_SECRETS = {"s3_access_key", "s3_secret_key", "admin_token", "session_secret", "kafka_security"}


def train(cfg: TrainConfig, settings: Settings) -> dict[str, Any]:
    """Run the trainer until max_steps, idle_timeout_s or a signal; returns a summary."""
    cfg.validate()
    cfg.require_model_dir()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would interleave with ours

    # -- distributed: torchrun sets the rendezvous env; rank 0 owns Kafka, logs and the engines -----
    placement = place(cfg.strategy, cfg.dist_timeout_s)
    rank, world, master, distributed = placement.rank, placement.world, placement.master, placement.distributed
    torch.manual_seed(cfg.seed)
    root = settings.checkpoint_url
    run_dir = Path(cfg.run_dir or settings.data_dir / "trainer" / cfg.consumer_group)

    # -- resume from the newest complete checkpoint, or start from --model -------------------------
    # (the model is built from --model, config and tokenizer included, then takes the checkpoint's state:
    # saved at any world size, each rank reads the slices its sharding needs)
    info = _broadcast(checkpoint.latest(root, settings) if master else None, distributed)
    model_dir = Path(cfg.model)
    state = {"step": 0, "policy_version": 0, "offsets": {}, "seen": [], "counters": {}}
    if info is not None:
        state = _broadcast(checkpoint.read_state(info, settings) if master else None, distributed)
    dtype = getattr(torch, cfg.dtype)
    # padded micro-batches are the fallback: plain sdpa with the padding mask (the flash varlen path
    # takes one packed row per micro-batch)
    attn = "sdpa" if cfg.packing == "padded" and cfg.attn_implementation == "auto" else cfg.attn_implementation
    # resuming from a train state: --model gives the architecture only (its weights would be overwritten)
    weights = info is None or not checkpoint.has_train_state(info)
    model = build_model(model_dir, placement, dtype, attn, cfg.activation_checkpointing, weights, lora=cfg)
    # a LoRA run checkpoints and syncs its adapter (PEFT's layout; trainer/lora.py), not the weights
    adapter = lora.adapter_config(cfg, model_dir) if lora.enabled(cfg) else None
    ref_model = None
    if cfg.kl_coef > 0:  # the reference is the run's starting model, not the newest checkpoint
        ref_model = build_model(cfg.model, placement, dtype, attn).eval().requires_grad_(False)
    # weight decay on linear matrices only: not on norms, biases or embeddings (see optim.param_groups)
    optimizer = build_optimizer(model, cfg)
    if info is not None:
        checkpoint.load_train_state(info, model, optimizer, settings)
    step, version = int(state["step"]), int(state["policy_version"])
    # Versions published after that checkpoint (weight-only exports, checkpoint_every > 1) named weights
    # the crash lost: continue above them, so one version number never names two sets of weights.
    version = max(version, _broadcast(checkpoint.newest_export(root, settings) if master else None, distributed))
    counters: Counter[str] = Counter(state.get("counters", {}))
    reward_history: list[float] = []  # per-step mean reward since this (re)start, for health_warnings

    # -- rank 0: the group source, the run log; every rank: the Syncer (rank 0 alone talks to the engines) --
    stop = _StopFlag()
    source = log = sinks = teacher = None
    distill_kl = None
    if master:
        if cfg.distill_url:
            from .distill_step import StepTeacher

            teacher = StepTeacher(cfg, settings)
        seen = SeenIds(state.get("seen", []))
        source = GroupSource(settings, cfg.consumer_group, offsets_from_json(state.get("offsets", {})), cfg.start_from)
        log = RunLog(run_dir / "train.jsonl")
        log.write({"event": "start", "step": step, "policy_version": version, "world_size": world,
                   "strategy": placement.strategy,
                   "checkpoint": info.url if info else None, "time": time.time(),
                   "config": cfg.to_dict()})  # the settings in force, after every --set and default
        sinks = Sinks(run_dir, cfg.tensorboard, cfg.progress, cfg.max_steps or None, step)
        if cfg.metrics_port:  # rank 0 only: one scrape target per trainer, not one per rank
            from infra.metrics import serve

            serve(cfg.metrics_port)
        config_record = {"train": cfg.to_dict(), "settings": settings.model_dump(mode="json", exclude=_SECRETS)}
    syncer = Syncer(cfg, settings, model, model_dir, adapter, state, master, distributed, log, counters)
    last_saved, last_url, finished = step, info.url if info else None, False
    if info is not None:
        syncer.resync(info.url, int(state["policy_version"]), step)

    def save() -> str:
        """Checkpoint the weights, optimizer and the exact Kafka positions consumed so far (every rank
        calls it: each writes its own shards; rank 0 the positions and, last, the manifest)."""
        nonlocal last_saved
        if master:
            syncer.join_export()  # not pruned while written, nor written beside a checkpoint
        offsets = source.positions() if master else None
        snapshot = {"step": step, "policy_version": version, "offsets": offsets, "seen": seen.to_list(),
                    **syncer.state(),
                    "counters": dict(counters), "time": time.time()} if master else None
        url = checkpoint.save_checkpoint(root, step, model, optimizer, snapshot, config_record if master else None,
                                         model_dir, settings, adapter)
        if master:
            checkpoint.prune(root, cfg.keep_checkpoints, settings)
            source.commit(offsets)  # for lag monitoring only; the checkpoint is what a restart reads
        last_saved = step
        return url

    try:
        # -- the loop -------------------------------------------------------------------------------
        while not cfg.max_steps or step < cfg.max_steps:
            # 1. rank 0 takes this step's groups and chooses; every rank receives the same samples
            # (waiting for groups can take any time: rank 0 sends heartbeats meanwhile, so the other
            # ranks never sit in one collective for longer than heartbeat_s; see _with_heartbeats)
            batch = None
            if master and not stop.requested:
                t_wait = time.perf_counter()
                served = syncer.served(version)
                plan, consumed = _with_heartbeats(lambda: _collect(source, seen, served, cfg, stop),
                                                  distributed, cfg.heartbeat_s)
                wait_s = time.perf_counter() - t_wait
                if consumed:
                    batch = (*_samples(plan, cfg, log), _mean([t.reward for c in plan.chosen for t in c.group.trajectories]))
                    if teacher is not None and batch[0]:  # per-token advantages from the teacher (distill.py)
                        distilled, distill_kl = teacher.apply(batch[0], step + 1)
                        batch = (distilled, *batch[1:])
            batch = _broadcast_step(batch, distributed)
            if batch is None:
                break
            t0 = time.perf_counter()  # step time excludes waiting for data (reported as wait_s)
            samples, cut, reward_mean = batch
            if not samples:  # everything consumed was skipped: positions move, weights do not
                if master:
                    counters.update(s["reason"] for s in plan.skipped)
                    log.write({"event": "skip", "step": step, "skipped": plan.skipped})
                continue

            # 2. the step (step.train_step): loss weights over the whole step, micro-batches, this rank's
            # share, lr x saturation, forward/backward, clip, AdamW. A step without signal (every advantage 0,
            # e.g. all-zero-variance groups) leaves the weights bit-identical; it still counts as a step and
            # publishes a new policy version (same weights), so on-policy rollouts waiting for step+1 go on.
            # distillation alone (reward_weight 0): the task reward is off, so it does not slow the lr either
            # (optim.saturation_scale reads it)
            lr_reward = 0.0 if cfg.distill_url and cfg.reward_weight == 0 else reward_mean
            out = train_step(model, optimizer, samples, cfg, reward_mean=lr_reward, step=step, placement=placement,
                             ref_model=ref_model)
            step += 1
            version += 1
            dt = time.perf_counter() - t0

            # 3. rank 0 logs (before the checkpoint: see metrics.py); every rank writes its part of the
            # checkpoint or export; rank 0 publishes and syncs the engines
            if master:
                counters.update(groups=len(plan.chosen), tokens=int(out.sums["tokens"]))
                counters.update(s["reason"] for s in plan.skipped)
                if out.no_update is not None:
                    counters.update({f"no_update_{out.no_update}": 1})
                metrics = {**_step_metrics(out, plan, len(samples), cut, reward_mean), "policy_version": version,
                           "engine_version": syncer.synced, "step_time_s": dt, "wait_s": wait_s,
                           "tokens_per_s": out.sums["tokens_fed"] / dt}
                if distill_kl is not None:
                    metrics["distill_reverse_kl"] = distill_kl
                log.write({"event": "step", "step": step, "policy_version": version, "metrics": metrics,
                           "groups": [c.group.event_id for c in plan.chosen], "weights": [c.weight for c in plan.chosen],
                           "skipped": plan.skipped, "time": time.time()})
                sinks.step(step, metrics)
                reward_history.append(metrics["reward_mean"])
                for warning in health_warnings(reward_history, metrics["entropy"], cfg.entropy_floor, step):
                    logger.warning("%s", warning)
                    log.write({"event": "warning", "warning": "health", "step": step, "message": warning})
                for warning in mismatch_warnings(metrics, cfg.mismatch_warn_kl, step):
                    logger.warning("%s", warning)
                    log.write({"event": "warning", "warning": "mismatch", "step": step, "message": warning})
            url = save() if step % cfg.checkpoint_every == 0 else None
            last_url = url or last_url
            # 4. the new version to the engines (trainer/sync/: in memory or from storage, then the gateway's stamp)
            if syncer.due(step) and syncer.sync(step, version, url, metrics if master else None):
                # Going on would train ever further from the policy the engines sample with.
                last_url = save() if step != last_saved else last_url
                raise syncer.stop_error(step, last_url, rank)

        # -- wind down: a final checkpoint for the steps since the last one. Messages consumed after
        # the last step (all skipped) are not worth one: a restart reads and skips them again, and
        # a complete checkpoint is never rewritten in place.
        if step != last_saved:
            last_url = save()
        finished = True
    finally:  # also on an exception (no checkpoint then, but for the one a sync-failure stop writes first)
        if master:
            syncer.close()
            log.write({"event": "stop", "step": step, "policy_version": version, "counters": dict(counters),
                       "reason": "error" if not finished else "signal" if stop.requested else "done",
                       "time": time.time()})
            sinks.close()
            log.close()
            source.close()
            if teacher is not None:
                teacher.close()
        stop.restore()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return {"step": step, "policy_version": version, "checkpoint": last_url, "counters": dict(counters)}


# -- small helpers -----------------------------------------------------------------------------------


def _collect(
    source: GroupSource, seen: SeenIds, served_version: int, cfg: TrainConfig, stop: "_StopFlag"
) -> tuple[StepPlan, int]:
    """Take messages until the step has ``groups_per_step`` trainable groups (duplicates, stale and
    undecodable ones do not count) or the source goes idle; returns (plan, messages consumed)."""
    plan, consumed = StepPlan(), 0
    while len(plan.chosen) < cfg.groups_per_step and not stop.requested:
        want = cfg.groups_per_step - len(plan.chosen)
        polled = source.take(want, cfg.poll_timeout_s, cfg.idle_timeout_s, lambda: stop.requested)
        consumed += len(polled)
        more = plan_step(polled, seen, served_version, cfg)
        plan.chosen += more.chosen
        plan.skipped += more.skipped
        if sum(p.group is not None for p in polled) < want:  # idle: train on what there is
            break
    return plan, consumed



def _step_metrics(out: Any, plan: StepPlan, sequences: int, cut: int, reward_mean: float) -> dict[str, float]:
    """A step's logged figures that its result and its groups give (train() adds the version and the times)."""
    rewards = [t.reward for c in plan.chosen for t in c.group.trajectories]
    advs = [a for c in plan.chosen for a in c.group.advantages]
    sums, micro = out.sums, out.micro
    return {
        **summarize(sums), **out.mismatch, "grad_norm": float(out.grad_norm), "lr": out.lr, "lr_scale": out.lr_scale,
        "reward_mean": reward_mean, "reward_std": _std(rewards),
        "adv_mean": _mean(advs), "adv_std": _std(advs), "adv_min": min(advs), "adv_max": max(advs),
        "groups": len(plan.chosen), "skipped": len(plan.skipped), "trajectories": len(rewards),
        "sequences": sequences, "microbatches": len(micro), "trained_tokens": sums["tokens"],
        "tokens": sums["tokens_fed"], "truncated_tokens": cut,
        "padding_frac": 1 - sum(mb.num_real_tokens for mb in micro) / sum(mb.num_tokens for mb in micro),
        "staleness_mean": _mean(plan.staleness), "staleness_max": max(plan.staleness),
        "updated": float(out.no_update is None),
    }


def _samples(plan: StepPlan, cfg: TrainConfig, log: RunLog | None = None) -> tuple[list[Sample], int]:
    """The step's training samples and the sampled tokens cut by ``max_trace_tokens`` (0: none; a trace
    longer than the micro-batch budget is trained whole in a micro-batch of its own). A cut is never
    silent: it is logged as a warning naming the group.

    A chosen group none of whose traces has a trainable token moves to ``plan.skipped``.
    """
    samples, cut = [], 0
    for c in list(plan.chosen):
        s, n = samples_from_group(c.group, cfg.max_trace_tokens, c.weight)
        samples += s
        cut += n
        if n:
            logger.warning("group %s (event %s): %d sampled tokens cut by max_trace_tokens=%d",
                           c.group.group_id, c.group.event_id, n, cfg.max_trace_tokens)
            if log is not None:
                log.write({"event": "warning", "warning": "trace_cut", "group_id": c.group.group_id,
                           "event_id": c.group.event_id, "cut_tokens": n, "max_trace_tokens": cfg.max_trace_tokens})
        if not s:
            plan.chosen.remove(c)
            plan.skipped.append({"event_id": c.group.event_id, "group_id": c.group.group_id,
                                 "reason": "no_trainable_tokens"})
    return samples, cut


_HEARTBEAT = "polar-trainer:heartbeat"


def _with_heartbeats(fn: Callable[[], Any], distributed: bool, every_s: float) -> Any:
    """rank 0: ``fn()``, run in a helper thread when distributed while this thread broadcasts a
    heartbeat every ``every_s`` (matched by ``_broadcast_step`` on the other ranks). Without them the
    other ranks would wait in one broadcast for as long as Kafka has no groups, and a collective that
    waits past the process group's timeout fails the run (gloo: 30 min, nccl: 10 min by default)."""
    if not (distributed and dist.is_initialized()):
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="polar-collect") as pool:
        future = pool.submit(fn)
        while True:
            try:
                return future.result(timeout=every_s)
            except FutureTimeout:
                _broadcast(_HEARTBEAT)


def _broadcast_step(payload: Any, distributed: bool) -> Any:
    """rank 0's step payload on every rank, the heartbeats sent while it was collected skipped."""
    while True:
        got = _broadcast(payload, distributed)
        if not (isinstance(got, str) and got == _HEARTBEAT):
            return got


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) if xs else 0.0


class _StopFlag:
    """SIGTERM / first Ctrl-C: finish the current step, checkpoint, exit. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
