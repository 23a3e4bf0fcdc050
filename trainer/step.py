"""One gradient accumulation pass over a rank's micro-batches (the middle of a training step).

Kept apart from train.py so the correctness tests drive exactly the code the trainer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .loss import STAT_KEYS, LossConfig, microbatch_logprobs, policy_loss
from .packing import MicroBatch


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
