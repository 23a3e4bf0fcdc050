"""GRPO / PPO-clip loss on the trained tokens: pure functions over flat (N,) tensors.

Everything here works on the N trained (loss-masked) tokens of a micro-batch, already gathered, so
there is no mask and no padding to get wrong. Per-token ``weights`` carry the normalization (token or
sequence mean over the whole step, see ``packing.assign_weights``), so the loss of a step is the sum
of its micro-batch losses and gradient accumulation is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import MicroBatch


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high
    tis_cap: float = 0.0  # > 0: truncated importance weight min(pi_old / pi_rollout, tis_cap)
    kl_coef: float = 0.0  # > 0: k3 KL penalty towards the reference policy


# Sums over tokens, so micro-batches and ranks aggregate by addition; see ``summarize``.
STAT_KEYS = ("tokens", "loss", "pg_loss", "clipped", "approx_kl", "ref_kl", "entropy", "ratio", "tis_weight")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target and the entropy of each distribution.

    logits (N, V), targets (N,) -> logp (N,) with grad, entropy (N,) without. Logits are divided by
    the sampling temperature first, so logp is comparable with the engine's rollout logprobs.
    """
    logits = logits.float() / temperature  # (N, V); float32: bf16 log-softmax loses the ratio's precision
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (N,)
    with torch.no_grad():
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (N,)
    return logp, entropy


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate with asymmetric clipping; returns (weighted loss sum, stat sums).

    All inputs (N,). ``old_logp`` is the behaviour policy of the ratio: the rollout logprobs, or the
    trainer's recomputed ones when TIS is on, in which case ``rollout_logp`` gives the truncated
    importance weight min(pi_old / pi_rollout, tis_cap) that corrects engine/trainer mismatch.
    ``ref_logp`` adds kl_coef * k3(pi_ref || pi), k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    log_ratio = logp - old_logp  # (N,)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = -torch.minimum(ratio * advantages, clipped_ratio * advantages)  # (N,) per-token surrogate loss
    tis = torch.ones_like(pg)
    if cfg.tis_cap > 0 and rollout_logp is not None:
        tis = torch.exp(old_logp - rollout_logp).clamp(max=cfg.tis_cap).detach()
        pg = pg * tis
    per_token = pg
    ref_kl = torch.zeros_like(pg)
    if cfg.kl_coef > 0 and ref_logp is not None:
        d = ref_logp - logp
        ref_kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.kl_coef * ref_kl
    loss = (weights * per_token).sum()
    with torch.no_grad():
        # A token is clipped when the clipped branch wins and so its gradient is zero.
        clipped = ((advantages > 0) & (ratio > 1 + cfg.clip_high)) | ((advantages < 0) & (ratio < 1 - cfg.clip_low))
        stats = {
            "tokens": float(logp.numel()),
            "loss": float(loss),
            "pg_loss": float((weights * pg).sum()),
            "clipped": float(clipped.sum()),
            "approx_kl": float(((ratio - 1) - log_ratio).sum()),  # k3 estimate of KL(old || current)
            "ref_kl": float(ref_kl.sum()),
            "ratio": float(ratio.sum()),
            "tis_weight": float(tis.sum()),
        }
    return loss, stats


def microbatch_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-policy logprobs and entropies of a micro-batch's trained tokens, (N,) each.

    The model computes logits only at the columns that hold a trained position (``logits_to_keep``
    as an index tensor), which skips the vocabulary projection for prompt and tool-output tokens.
    """
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=mb.keep_cols)
    logits = out.logits.flatten(0, 1)[mb.keep]  # (R, U, V) -> (N, V)
    return token_logprobs(logits, mb.targets, temperature)


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Turn stat sums (see STAT_KEYS) into per-token means for logging."""
    n = max(sums.get("tokens", 0.0), 1.0)
    return {
        "loss": sums.get("loss", 0.0),
        "pg_loss": sums.get("pg_loss", 0.0),
        "clip_frac": sums.get("clipped", 0.0) / n,
        "approx_kl": sums.get("approx_kl", 0.0) / n,
        "ref_kl": sums.get("ref_kl", 0.0) / n,
        "entropy": sums.get("entropy", 0.0) / n,
        "ratio_mean": sums.get("ratio", 0.0) / n,
        "tis_weight_mean": sums.get("tis_weight", 0.0) / n,
    }
