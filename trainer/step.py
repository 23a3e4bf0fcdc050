"""One training step: a step's samples -> an optimizer update or a skip (``train_step``), and the
gradient accumulation pass in its middle (``accumulate_gradients``).

Every step taken anywhere goes through ``train_step``: the trainer's loop (train.py), the in-process demo
loop (polarstream/demo/learning.py) and the benchmarks that time the trainer's step (bench/gpu_check.py,
bench/trainer.py, bench/_fsdp_worker.py). Kept apart from train.py so the correctness tests drive exactly
the code the trainer runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    mismatch: dict[str, float] = field(default_factory=dict)  # mismatch_ratio_max / _p99 over every rank's
    # trained tokens: pi_trainer / pi_rollout (quantiles do not add up, so not in ``sums``)


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
    samples = assign_weights(samples, cfg.loss_norm, cfg.loss_norm_tokens)
    micro = micro_batches(samples, cfg)
    mine = shard(micro, placement.world, placement.rank)
    lr_scale = saturation_scale(reward_mean, cfg.lr_saturation, cfg.lr_saturation_floor)
    lr = lr_at(step, cfg) * lr_scale
    for g in optimizer.param_groups:
        g["lr"] = lr
    autocast = torch.bfloat16 if placement.device.type == "cuda" else None
    log_rho: list[torch.Tensor] = []
    sums = accumulate_gradients(model, mine, loss_config(cfg), cfg.temperature, ref_model, placement.device, autocast,
                                log_rho=log_rho)
    sums["tokens_fed"] = float(sum(mb.num_tokens for mb in mine))
    sums = _all_reduce(sums, placement)
    mismatch = ratio_quantiles(_all_gather(torch.cat(log_rho) if log_rho else torch.zeros(0), placement))
    # A step without signal (every advantage 0, e.g. all-zero-variance groups) leaves the weights
    # bit-identical: AdamW would still move them on its moments (see optim.skip_update_reason).
    grad_norm, no_update = apply_update(model, optimizer, samples, cfg.grad_clip)
    return StepOutcome(samples, micro, lr, lr_scale, sums, grad_norm, no_update, mismatch)


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The loss settings of ``cfg``."""
    return LossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                      dual_clip=cfg.dual_clip, loss=cfg.loss, correction=cfg.correction,
                      gspo_clip_low=cfg.gspo_clip_low, gspo_clip_high=cfg.gspo_clip_high,
                      cispo_clip_high=cfg.cispo_clip_high, icepop_low=cfg.icepop_low, icepop_high=cfg.icepop_high,
                      seq_mask_low=cfg.seq_mask_low, seq_mask_high=cfg.seq_mask_high)


def ratio_quantiles(log_rho: torch.Tensor) -> dict[str, float]:
    """Max and 99th percentile of the token ratio pi_trainer / pi_rollout (1 and 1 without tokens)."""
    if log_rho.numel() == 0:
        return {"mismatch_ratio_max": 1.0, "mismatch_ratio_p99": 1.0}
    r = torch.exp(log_rho.double())
    k = max(1, math.ceil(0.99 * r.numel()))  # nearest rank; torch.quantile refuses more than 2^24 values
    return {"mismatch_ratio_max": float(r.max()), "mismatch_ratio_p99": float(r.kthvalue(k).values)}


def _all_gather(t: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Every rank's 1-D ``t``, concatenated (ranks hold different token counts: padded to the longest)."""
    if not placement.distributed:
        return t
    t = t.to(placement.device, torch.float32)
    n = torch.tensor([t.numel()], device=placement.device)
    counts = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, n)
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, device=placement.device)
    padded[:t.numel()] = t
    out = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(out, padded)
    return torch.cat([o[:int(c.item())] for o, c in zip(out, counts)]).cpu()


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
    log_rho: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Forward + backward every micro-batch, accumulating gradients; returns stat sums (STAT_KEYS).

    Under FSDP2 each micro-batch's backward reduce-scatters its gradients into the shards (summed over
    ranks: trainer/parallel.py), which keeps unsharded gradients from piling up. With ``cfg.tis_cap`` the ratio's behaviour
    policy is the trainer's own current logprobs, detached: one update per batch means pi_old is the
    policy being trained, so a second no-grad forward would only recompute the same numbers (ratio 1,
    gradient that of log pi). The TIS weight min(pi_old / pi_rollout, cap) then corrects for the
    engine/trainer mismatch.
    Any other ``cfg.correction`` works the same way, on the same ratio.
    ``grad_scale`` multiplies the loss before backward (1: the per-token weights already normalize
    over the whole step, across ranks). ``log_rho``, when given, gets each micro-batch's
    log pi_trainer - log pi_rollout of its trained tokens (for the step's ratio quantiles).
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
            old = mb.rollout_logprobs
            if cfg.active_correction != "none":  # pi_old = this very forward, detached (see the docstring)
                old = logp.detach()
            seq = mb.seq if mb.seq.numel() == logp.numel() else None
            loss, stats = policy_loss(logp, old, mb.advantages, mb.weights, cfg, mb.rollout_logprobs, ref, seq)
            (loss * grad_scale).backward()
        stats["entropy"] = float(entropy.sum())
        if log_rho is not None:
            log_rho.append((logp.detach() - mb.rollout_logprobs).float().cpu())
        for k in STAT_KEYS:
            sums[k] += stats.get(k, 0.0)
    return sums
