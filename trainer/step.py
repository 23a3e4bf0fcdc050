"""One training step: a step's samples -> its optimizer updates (``minibatches`` x ``epochs``, each an
update or a skip: ``train_step``), and the gradient accumulation pass in their middle
(``accumulate_gradients``).

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
from . import corrections as C
from .packing import MicroBatch, Sample, assign_weights, pack, pad_by_length, shard, trajectory_index
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
    """The optimizer updates of one step's samples: ``cfg.minibatches`` parts (whole trajectories each) x
    ``cfg.epochs`` passes, one optimizer step each. Per part: loss weights over the part -> micro-batches of
    ``cfg``'s packing -> this rank's share -> forward/backward with accumulation -> clip, then AdamW or a
    skip (``optim.apply_update``; gradients are cleared either way). lr is ``lr_at(step)`` x the saturation
    scale of ``reward_mean``, the step's mean trajectory reward, for every update of the step.

    With more than one update, the proximal policy's logprobs (pi_prox: the weights before the step's first
    update) are taken once, in a no-grad pass, before any update: the ratio's base under ``ratio_base:
    proximal`` and the correction's rho = pi_prox / pi_rollout whatever the base (``proximal_logprobs``).
    With one update pi_prox is the update's own forward, detached (the same numbers, no extra pass).

    Every rank calls it with the same ``samples`` (the whole step's): the weights normalize over all of
    them and the skip rule reads them, so every rank takes the same decision. Gradients sum over ranks
    (parallel.py). On CUDA the forward runs under bf16 autocast, whatever the parameters' ``cfg.dtype``.
    A step without signal still runs forward and backward, so its stats are logged like any other. The stat
    sums are the mean over the updates (so ``tokens`` is the step's trained tokens).
    """
    weighted = assign_weights(samples, cfg.loss_norm, cfg.loss_norm_tokens)
    parts = [assign_weights(p, cfg.loss_norm, cfg.loss_norm_tokens) for p in minibatches(samples, cfg.minibatches)]
    micro_of = [micro_batches(p, cfg) for p in parts]
    mine_of = [shard(m, placement.world, placement.rank) for m in micro_of]
    lr_scale = saturation_scale(reward_mean, cfg.lr_saturation, cfg.lr_saturation_floor)
    lr = lr_at(step, cfg) * lr_scale
    for g in optimizer.param_groups:
        g["lr"] = lr
    autocast = torch.bfloat16 if placement.device.type == "cuda" else None
    lcfg = loss_config(cfg)
    updates = cfg.minibatches * cfg.epochs
    split = [splits_a_trajectory(m) for m in micro_of]
    seq_correction = lcfg.active_correction in C.SEQUENCE_CORRECTIONS
    prox_of = None
    if updates > 1 or (seq_correction and any(split)):  # before any update: pi_prox is the step's starting policy
        prox_of = [proximal_logprobs(model, mine, cfg.temperature, placement.device, autocast) for mine in mine_of]
    log_rho: list[torch.Tensor] = []
    if prox_of is not None:
        log_rho = [p - mb.rollout_logprobs for prox, mine in zip(prox_of, mine_of) for p, mb in zip(prox, mine)]
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    norms, reasons = [], []
    for _ in range(cfg.epochs):
        for k, part in enumerate(parts):
            totals = {}
            prox = prox_of[k] if prox_of is not None else None
            n = len(set(trajectory_index(part)))
            if seq_correction and prox is not None:
                totals["correction"] = correction_totals(prox, mine_of[k], lcfg.active_correction, n, placement)
            if cfg.loss == "gspo" and split[k]:
                totals["gspo"] = gspo_totals(model, mine_of[k], prox, cfg, n, placement, autocast)
            got = accumulate_gradients(model, mine_of[k], lcfg, cfg.temperature, ref_model, placement.device, autocast,
                                       log_rho=log_rho if prox_of is None else None, prox=prox, totals=totals)
            for key in STAT_KEYS:
                sums[key] += got[key] / updates
            # A step without signal (every advantage 0, e.g. all-zero-variance groups) leaves the weights
            # bit-identical: AdamW would still move them on its moments (see optim.skip_update_reason).
            grad_norm, why = apply_update(model, optimizer, part, cfg.grad_clip)
            norms.append(grad_norm)
            reasons.append(why)
    micro = [mb for m in micro_of for mb in m]
    sums["tokens_fed"] = float(sum(mb.num_tokens for mine in mine_of for mb in mine))  # one pass's; the step feeds
    # them once per update (and once more for pi_prox when it takes several)
    sums = _all_reduce(sums, placement)
    mismatch = ratio_quantiles(_all_gather(torch.cat(log_rho) if log_rho else torch.zeros(0), placement))
    no_update = None if any(r is None for r in reasons) else reasons[0]
    return StepOutcome(weighted, micro, lr, lr_scale, sums, float(sum(norms) / len(norms)), no_update, mismatch)


def minibatches(samples: Sequence[Sample], n: int) -> list[list[Sample]]:
    """``samples`` in ``n`` parts of whole trajectories (every trace of a trajectory in one part), dealt
    round robin in order of first appearance, so each part holds about 1/n of each group's trajectories
    when groups arrive one after another; fewer parts when there are fewer trajectories."""
    traj = trajectory_index(samples)
    count = max(traj, default=-1) + 1
    parts: list[list[Sample]] = [[] for _ in range(min(n, count))]
    for t, s in zip(traj, samples):
        parts[t % len(parts)].append(s)
    return parts or [[]]


def splits_a_trajectory(micro: Sequence[MicroBatch]) -> bool:
    """Whether some trajectory has tokens in more than one micro-batch (so maybe on more than one rank):
    its sequence-level quantities then need sums over micro-batches."""
    seen: set[int] = set()
    for mb in micro:
        mine = set(mb.seq.tolist())
        if seen & mine:
            return True
        seen |= mine
    return False


@torch.no_grad()
def proximal_logprobs(model, micro, temperature, device, autocast_dtype) -> list[torch.Tensor]:
    """pi_prox's logprobs of each micro-batch's trained tokens (float32, on CPU): one no-grad forward each."""
    out = []
    for mb in micro:
        with _amp(device, autocast_dtype):
            logp, _ = microbatch_logprobs(model, mb.to(device), temperature)
        out.append(logp.float().cpu())
    return out


def correction_totals(prox, micro, correction: str, n: int, placement: Placement):
    """Whole-trajectory sums for a sequence mask (corrections.seq_sums over every micro-batch and rank):
    of log rho for seq_mask_geo, of rho for seq_mask_arith."""
    sums, counts = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for p, mb in zip(prox, micro):
        log_rho = (p - mb.rollout_logprobs.cpu()).double()
        s, c = C.seq_sums(log_rho if correction == "seq_mask_geo" else torch.exp(log_rho), mb.seq.cpu(), n)
        sums, counts = sums + s, counts + c
    return _sum_over_ranks(sums, counts, placement)


@torch.no_grad()
def gspo_totals(model, micro, prox, cfg: TrainConfig, n: int, placement: Placement, autocast_dtype):
    """Whole-trajectory sums of log(pi_theta / pi_old) under the current weights, for GSPO's s_i when a
    trajectory is split over micro-batches: one more no-grad forward of this part (its value only: s_i
    enters the loss through a stop-gradient)."""
    sums, counts = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for i, mb in enumerate(micro):
        with _amp(placement.device, autocast_dtype):
            logp, _ = microbatch_logprobs(model, mb.to(placement.device), cfg.temperature)
        logp = logp.float().cpu()
        if cfg.ratio_base == "proximal":
            old = prox[i] if prox is not None else logp
        else:
            old = mb.rollout_logprobs.cpu()
        s, c = C.seq_sums((logp - old).double(), mb.seq.cpu(), n)
        sums, counts = sums + s, counts + c
    return _sum_over_ranks(sums, counts, placement)


def _sum_over_ranks(sums: torch.Tensor, counts: torch.Tensor, placement: Placement):
    if placement.distributed:
        t = torch.stack([sums, counts]).to(placement.device)
        dist.all_reduce(t)
        sums, counts = t.cpu()
    return sums, counts


def _amp(device, autocast_dtype):
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The loss settings of ``cfg``."""
    return LossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                      dual_clip=cfg.dual_clip, loss=cfg.loss, correction=cfg.correction, ratio_base=cfg.ratio_base,
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
    prox: Sequence[torch.Tensor] | None = None,
    totals: dict | None = None,
) -> dict[str, float]:
    """Forward + backward every micro-batch, accumulating gradients; returns stat sums (STAT_KEYS).

    Under FSDP2 each micro-batch's backward reduce-scatters its gradients into the shards (summed over
    ranks: trainer/parallel.py), which keeps unsharded gradients from piling up. ``prox`` gives each
    micro-batch's proximal logprobs (``train_step`` takes them before the step's first update); without
    it pi_prox is this very forward, detached: with one update per batch pi_prox is the policy being
    trained, so a second no-grad forward would only recompute the same numbers. The loss's ratio is against
    pi_prox (``cfg.ratio_base`` proximal: ratio 1 on the first update, its gradient that of log pi) or the
    rollout logprobs (behaviour); a correction's weight reads rho = pi_prox / pi_rollout either way.
    ``totals``: whole-trajectory sums for split trajectories (loss.policy_loss).
    ``grad_scale`` multiplies the loss before backward (1: the per-token weights already normalize
    over the whole step, across ranks). ``log_rho``, when given, gets each micro-batch's
    log pi_prox - log pi_rollout of its trained tokens (for the step's ratio quantiles).
    """
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    for i, mb in enumerate(micro):
        mb = mb.to(device)
        with _amp(device, autocast_dtype):
            ref = None
            if ref_model is not None and cfg.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = microbatch_logprobs(ref_model, mb, temperature)
            logp, entropy = microbatch_logprobs(model, mb, temperature)
            p = prox[i].to(logp.device, logp.dtype) if prox is not None else logp.detach()
            old = p if cfg.ratio_base == "proximal" else mb.rollout_logprobs
            seq = mb.seq if mb.seq.numel() == logp.numel() else None
            loss, stats = policy_loss(logp, old, mb.advantages, mb.weights, cfg, mb.rollout_logprobs, ref, seq,
                                      prox_logp=p, totals=totals)
            (loss * grad_scale).backward()
        stats["entropy"] = float(entropy.sum())
        if log_rho is not None:
            log_rho.append((p - mb.rollout_logprobs).float().cpu())
        for k in STAT_KEYS:
            sums[k] += stats.get(k, 0.0)
    return sums
