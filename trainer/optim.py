"""The optimizer, its rate and the decision whether a step may move the weights. Pure helpers used by
``step.train_step``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .config import TrainConfig
from .parallel import clip_grad_norm_
from .packing import Sample


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay only the matrices of linear layers.

    Norm scales and biases (1-D) set a scale or an offset, not a feature mix, so shrinking them towards
    0 only distorts the model; embeddings (and an lm_head tied to them) hold one row per token, and
    decay would pull every rarely-seen token's row towards 0 on each step whatever the data says.
    Each parameter appears once, tied ones included.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # deduplicated: a tied weight is listed once
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embeddings else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` with ``cfg``'s rate, betas and weight decay."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then constant or cosine decay from lr to min_lr (nanoGPT's get_lr)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    horizon = cfg.max_steps or cfg.lr_decay_steps
    if step >= horizon:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def has_signal(samples: Sequence[Sample]) -> bool:
    """Whether any trained token of the step carries a non-zero advantage with a non-zero weight.

    Without one the policy-gradient term is exactly zero. A KL-to-reference term alone does not count
    as signal: a step with nothing to learn should not move the policy at all.
    """
    return any(s.weight != 0 and any(a != 0 for a in s.advantages) for s in samples)


def saturation_scale(reward_mean: float, knee: float, floor: float) -> float:
    """The learning rate's factor for a step whose trajectories' mean reward is ``reward_mean`` (in [0, 1]).

    1 up to ``knee``; above it, falling linearly to ``floor`` at reward 1 (``knee`` 1: always 1). Once
    most samples pass, a group's only signal is a lone failure, and GRPO divides it by a tiny group std
    (one failure in 8 gets advantage -2.65); AdamW then turns that gradient, whatever its size, into a
    full-size step, momentum and output rows the gradient barely touched included. On seed 2 of the
    demo, one such step at reward 0.94 took the next step to 0.47 (issue 48's note): rerunning it at
    a fifth of the rate kept 0.96. A policy that mostly passes has little left to learn per step and
    much to lose, so it takes smaller steps.
    """
    if knee >= 1:
        return 1.0
    r = min(max(reward_mean, 0.0), 1.0)
    return max(floor, min(1.0, (1.0 - r) / (1.0 - knee)))


def skip_update_reason(samples: Sequence[Sample], grad_norm: float) -> str | None:
    """Why this step must not call ``optimizer.step()``, or None to step.

    AdamW moves the weights even on a zero gradient (its moments from earlier steps, and weight decay),
    and it rescales a gradient of pure float noise into a full-size step; a step with no signal must
    leave the weights bit-identical. ``grad_norm`` is the clipped-over, all-reduced norm, so every rank
    decides the same. A non-finite norm would write NaN into every weight.
    """
    if not has_signal(samples):
        return "no_signal"
    if not math.isfinite(grad_norm):
        return "nonfinite_grad"
    if grad_norm == 0:  # e.g. every token with an advantage is clipped
        return "zero_grad"
    return None


def apply_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample], grad_clip: float
) -> tuple[float, str | None]:
    """Clip the accumulated gradients, step the optimizer unless ``skip_update_reason`` says not to,
    and clear the gradients. Returns (gradient norm before clipping, skip reason or None)."""
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    reason = skip_update_reason(samples, grad_norm)
    if reason is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, reason
