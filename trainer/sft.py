"""Supervised fine-tuning on recorded trajectories: ``polarstream sft``.

    polarstream sft --model DIR [--topic-prefix RUN.] [--min-reward 1] [--best-of-group] [--task-set S]

Reads polar.trajectories (any run's, from any offsets, up to the end it found when it first started:
sft_source.py), keeps the rows a rule admits (sft_select.py) and trains the model on their sampled tokens
with the trainer's own machinery: the same Samples (the loss mask: only sampled tokens, the context
masked), packing, step (FSDP2 under torchrun, LoRA with lora_rank > 0), optimizer and checkpoints. A
checkpoint holds the source's positions and the rows still undecided, so a restart after a SIGKILL
trains every row exactly once.

The loss is the negative log-likelihood of the sampled tokens, expressed as the trainer's CISPO loss with
every advantage 1 and the ratio against the model's own detached logprobs (ratio_base proximal): the ratio
is then 1, CISPO's per-token loss -sg(r) A log pi is exactly -log pi, and the logged ``loss`` is the step's
token-mean NLL. No second loss path to keep in step with the first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.settings import Settings

from . import checkpoint, lora
from .config import ConfigError, TrainConfig
from .loss import summarize
from .metrics import RunLog
from .optim import build_optimizer
from .packing import Sample, sample_from_trace
from .parallel import build_model, place
from .sft_select import Decision, Row, Rule, Selector
from .sft_source import RowSource
from .step import train_step
from .sync.syncer import broadcast_object as _broadcast
from .train import _SECRETS, _StopFlag, _broadcast_step, _with_heartbeats

logger = logging.getLogger(__name__)

# The trainer settings that make its step an SFT step (see the module docstring); anything else --set may change.
SFT_SETTINGS: dict[str, Any] = {"loss": "cispo", "ratio_base": "proximal", "minibatches": 1, "epochs": 1,
                                "correction": "none", "tis_cap": 0.0, "kl_coef": 0.0, "temperature": 1.0,
                                "consumer_group": "polar-sft"}


def sft_config(overrides: dict[str, Any]) -> TrainConfig:
    """A TrainConfig for SFT: ``overrides`` plus SFT_SETTINGS; ConfigError if they contradict."""
    for key, value in SFT_SETTINGS.items():
        if key in overrides and str(overrides[key]) != str(value) and key != "consumer_group":
            raise ConfigError(f"{key}={overrides[key]!r}: sft trains with {key}={value!r} (its loss is the NLL)")
    return TrainConfig.from_overrides({**SFT_SETTINGS, **overrides})


@dataclass
class SftSpec:
    """What to read and keep, where to write (the CLI's options beyond TrainConfig's)."""

    rule: Rule = field(default_factory=Rule)
    rows_per_step: int = 8
    read: Settings | None = None  # the settings to read with (another run's topic prefix); None: the run's
    start: dict[int, int] | None = None  # {partition: offset} to start at (a run without a checkpoint)
    start_from: str = "earliest"
    follow: bool = False  # keep reading past today's end (stop after idle_timeout_s instead)
    checkpoint_url: str = ""  # '' : <settings.checkpoint_url>/sft


def sft(cfg: TrainConfig, settings: Settings, spec: SftSpec) -> dict[str, Any]:
    """Train until the source ends (or max_steps, or a signal); returns a summary."""
    cfg.validate()
    cfg.require_model_dir()
    if spec.rows_per_step < 1:
        raise ConfigError(f"rows_per_step={spec.rows_per_step}: must be >= 1")
    placement = place(cfg.strategy, cfg.dist_timeout_s)
    master, distributed = placement.master, placement.distributed
    torch.manual_seed(cfg.seed)
    root = spec.checkpoint_url or f"{settings.checkpoint_url.rstrip('/')}/sft"
    run_dir = Path(cfg.run_dir or settings.data_dir / "sft")

    info = _broadcast(checkpoint.latest(root, settings) if master else None, distributed)
    state: dict[str, Any] = {"step": 0, "source": None, "counters": {}}
    if info is not None:
        state = _broadcast(checkpoint.read_state(info, settings) if master else None, distributed)
    model_dir = Path(cfg.model)
    weights = info is None or not checkpoint.has_train_state(info)
    attn = "sdpa" if cfg.packing == "padded" and cfg.attn_implementation == "auto" else cfg.attn_implementation
    model = build_model(model_dir, placement, getattr(torch, cfg.dtype), attn,
                        cfg.activation_checkpointing, weights, lora=cfg)
    adapter = lora.adapter_config(cfg, model_dir) if lora.enabled(cfg) else None
    optimizer = build_optimizer(model, cfg)
    if info is not None:
        checkpoint.load_train_state(info, model, optimizer, settings)
    step = int(state["step"])
    counters: Counter[str] = Counter(state.get("counters", {}))

    stop = _StopFlag()
    source = log = None
    selector = Selector(spec.rule)
    queue: list[Row] = []  # rows kept but not trained yet (a closed group can keep more than a step takes)
    dropped: list[Decision] = []  # rows dropped since the last step's record
    if master:
        source = RowSource(spec.read or settings, cfg.consumer_group, state.get("source"), spec.start,
                           spec.start_from, spec.follow)
        log = RunLog(run_dir / "sft.jsonl")
        log.write({"event": "start", "step": step, "checkpoint": info.url if info else None, "time": time.time(),
                   "world_size": placement.world, "strategy": placement.strategy,
                   "topic": source.topic, "rule": vars(spec.rule), "config": cfg.to_dict(),
                   "pending": len((state.get("source") or {}).get("pending", []))})
        config_record = {"sft": cfg.to_dict(), "rule": vars(spec.rule),
                         "settings": settings.model_dump(mode="json", exclude=_SECRETS)}
    last_saved, last_url, finished = step, info.url if info else None, False

    def save() -> str:
        nonlocal last_saved
        snapshot = {"step": step, "policy_version": step, "source": source.state(selector.pending + queue),
                    "counters": dict(counters), "time": time.time()} if master else None
        url = checkpoint.save_checkpoint(root, step, model, optimizer, snapshot, config_record if master else None,
                                         model_dir, settings, adapter)
        if master:
            checkpoint.prune(root, cfg.keep_checkpoints, settings)
        last_saved = step
        return url

    def collect() -> list[Row]:
        """rank 0: the next step's rows (fewer at the end of the input; none when it is over)."""
        while len(queue) < spec.rows_per_step and not stop.requested:
            rows = source.take(spec.rows_per_step - len(queue), cfg.poll_timeout_s, cfg.idle_timeout_s,
                               lambda: stop.requested)
            for d in [d for r in rows for d in selector.add(r)]:
                (queue if d.keep else dropped).append(d.row if d.keep else d)
            if source.exhausted or (not rows and not stop.requested):  # the end, or idle while following
                for d in selector.flush():
                    (queue if d.keep else dropped).append(d.row if d.keep else d)
                break
        taken, queue[:] = queue[:spec.rows_per_step], queue[spec.rows_per_step:]
        return taken

    try:
        while not cfg.max_steps or step < cfg.max_steps:
            payload = None
            if master and not stop.requested:
                rows = _with_heartbeats(collect, distributed, cfg.heartbeat_s)
                payload = _samples(rows, cfg.max_trace_tokens) if rows else None
            samples = _broadcast_step(payload, distributed)
            if samples is None:
                break
            if not samples:  # rows without a sampled token: decided, nothing to train
                if master:
                    dropped.extend(Decision(r, False, "no_trainable_tokens") for r in rows)
                continue
            t0 = time.perf_counter()
            out = train_step(model, optimizer, samples, cfg, reward_mean=0.0, step=step, placement=placement)
            step += 1
            if master:
                counters.update(rows=len(rows), tokens=int(out.sums["tokens"]), dropped=len(dropped))
                counters.update(f"dropped_{d.reason}" for d in dropped)
                metrics = {**summarize(out.sums), "nll": out.sums["loss"], "grad_norm": out.grad_norm, "lr": out.lr,
                           "rows": len(rows), "samples": len(samples), "step_time_s": time.perf_counter() - t0}
                log.write({"event": "step", "step": step, "metrics": metrics, "rows": [r.digest for r in rows],
                           "dropped": [[d.row.digest, d.reason] for d in dropped], "time": time.time()})
                logger.info("sft step %d: nll %.4f, %d rows", step, metrics["nll"], len(rows))
                dropped.clear()
            url = save() if step % cfg.checkpoint_every == 0 else None
            last_url = url or last_url
        if step != last_saved:
            last_url = save()
        finished = True
    finally:
        if master:
            if dropped:  # decided after the last step: recorded, though no step follows
                log.write({"event": "skip", "step": step, "dropped": [[d.row.digest, d.reason] for d in dropped]})
                counters.update(dropped=len(dropped))
            log.write({"event": "stop", "step": step, "counters": dict(counters), "time": time.time(),
                       "reason": "error" if not finished else "signal" if stop.requested else "done"})
            log.close()
            source.close()
        stop.restore()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return {"step": step, "checkpoint": last_url, "counters": dict(counters)}


def _samples(rows: list[Row], max_len: int) -> list[Sample]:
    """Every trace of the rows, each sampled token a target with advantage 1 (the NLL: module docstring)."""
    out = []
    for r in rows:
        t = r.traj
        for trace in t.traces:
            s = sample_from_trace(trace.token_ids, trace.loss_mask, trace.logprobs, 1.0, max_len,
                                  group_id=t.group_id, trajectory_id=r.whole_id)
            if s is not None:
                out.append(s)
    return out
