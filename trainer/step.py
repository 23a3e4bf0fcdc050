"""One training step: a step's samples -> an optimizer update or a skip (``train_step``), and the
gradient accumulation pass in its middle (``accumulate_gradients``).

Every step taken anywhere goes through ``train_step``: the trainer's loop (train.py), the in-process demo
loop (polarstream/demo/learning.py) and the benchmarks that time the trainer's step (bench/gpu_check.py,
bench/trainer.py, bench/_fsdp_worker.py). Kept apart from train.py so the correctness tests drive exactly
the code the trainer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig
from .loss import STAT_KEYS, LossConfig, microbatch_logprobs, policy_loss
from .optim import apply_update, lr_at, saturation_scale
from .packing import MicroBatch, Sample, assign_weights, pack, pad_by_length, shard
from .parallel import Placement


@dataclass(frozen=True)
class StepOutcome:
    """What one ``train_step`` did."""

    samples: list[Sample]  # the step's samples with their loss weights (packing.assign_weights)
    micro: list[MicroBatch]  # every micro-batch of the step; this rank trained its share (packing.shard)
    lr: float  # the rate the step trained with: lr_at(step) * lr_scale
    lr_scale: float  # optim.saturation_scale of the step's mean reward
    sums: dict[str, float]  # stat sums over every rank: STAT_KEYS, and tokens_fed (padding included)
    grad_norm: float  # before clipping, over the whole model (every rank's shard)
    no_update: str | None  # why optimizer.step() was not called (optim.skip_update_reason), or None


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    *,
    reward_mean: float,
    step: int = 0,
    placement: Placement = Placement(),
    ref_model: torch.nn.Module | None = None,
) -> StepOutcome:
    """One optimizer step on a step's samples: loss weights over the whole step -> micro-batches of
    ``cfg``'s packing -> this rank's share -> lr (``lr_at(step)`` x the saturation scale of
    ``reward_mean``, the step's mean trajectory reward) -> forward/backward with accumulation -> stat sums
    over ranks -> clip, then AdamW or a skip (``optim.apply_update``; gradients are cleared either way).

    Every rank calls it with the same ``samples`` (the whole step's): the weights normalize over all of
    them and the skip rule reads them, so every rank takes the same decision. Gradients sum over ranks
    (parallel.py). On CUDA the forward runs under bf16 autocast, whatever the parameters' ``cfg.dtype``.
    A step without signal still runs forward and backward, so its stats are logged like any other.
    """
    samples = assign_weights(samples, cfg.loss_norm)
    micro = micro_batches(samples, cfg)
    mine = shard(micro, placement.world, placement.rank)
    lr_scale = saturation_scale(reward_mean, cfg.lr_saturation, cfg.lr_saturation_floor)
    lr = lr_at(step, cfg) * lr_scale
    for g in optimizer.param_groups:
        g["lr"] = lr
    autocast = torch.bfloat16 if placement.device.type == "cuda" else None
    sums = accumulate_gradients(model, mine, loss_config(cfg), cfg.temperature, ref_model, placement.device, autocast)
    sums["tokens_fed"] = float(sum(mb.num_tokens for mb in mine))
    sums = _all_reduce(sums, placement)
    # A step without signal (every advantage 0, e.g. all-zero-variance groups) leaves the weights
    # bit-identical: AdamW would still move them on its moments (see optim.skip_update_reason).
    grad_norm, no_update = apply_update(model, optimizer, samples, cfg.grad_clip)
    return StepOutcome(samples, micro, lr, lr_scale, sums, grad_norm, no_update)


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The loss settings of ``cfg``."""
    return LossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                      dual_clip=cfg.dual_clip)


def micro_batches(samples: Sequence[Sample], cfg: TrainConfig) -> list[MicroBatch]:
    """Packed rows of ``row_len`` (automatic: one row per micro-batch for polar_varlen and flash varlen,
    whose cost does not depend on rows; the longest sequence for sdpa/eager's dense masks; see
    packing.py), or padded rows."""
    if cfg.packing == "padded":
        return pad_by_length(samples, cfg.token_budget)
    dense = cfg.attn_implementation in ("sdpa", "eager")
    row_len = cfg.row_len or (min(max(s.length for s in samples), cfg.token_budget) if dense else 0)
    return pack(samples, cfg.token_budget, row_len, share_prefix=cfg.share_prefix)


def _all_reduce(sums: dict[str, float], placement: Placement) -> dict[str, float]:
    """Sum stat sums over ranks (fixed key order so every rank packs the same tensor)."""
    if not placement.distributed:
        return sums
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=placement.device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def accumulate_gradients(
    model: torch.nn.Module,
    micro: Sequence[MicroBatch],
    cfg: LossConfig,
    temperature: float = 1.0,
    ref_model: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    grad_scale: float = 1.0,
) -> dict[str, float]:
    """Forward + backward every micro-batch, accumulating gradients; returns stat sums (STAT_KEYS).

    Under FSDP2 each micro-batch's backward reduce-scatters its gradients into the shards (summed over
    ranks: trainer/parallel.py), which keeps unsharded gradients from piling up. With ``cfg.tis_cap`` the ratio's behaviour
    policy is the trainer's own current logprobs, detached: one update per batch means pi_old is the
    policy being trained, so a second no-grad forward would only recompute the same numbers (ratio 1,
    gradient that of log pi). The TIS weight min(pi_old / pi_rollout, cap) then corrects for the
    engine/trainer mismatch.
    ``grad_scale`` multiplies the loss before backward (1: the per-token weights already normalize
    over the whole step, across ranks).
    """
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    amp = (
        torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    for i, mb in enumerate(micro):
        mb = mb.to(device)
        with amp:
            ref = None
            if ref_model is not None and cfg.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = microbatch_logprobs(ref_model, mb, temperature)
            logp, entropy = microbatch_logprobs(model, mb, temperature)
            old, rollout = mb.rollout_logprobs, None
            if cfg.tis_cap > 0:  # pi_old = this very forward, detached (see the docstring)
                old, rollout = logp.detach(), mb.rollout_logprobs
            loss, stats = policy_loss(logp, old, mb.advantages, mb.weights, cfg, rollout, ref)
            (loss * grad_scale).backward()
        stats["entropy"] = float(entropy.sum())
        for k in STAT_KEYS:
            sums[k] += stats[k]
    return sums
