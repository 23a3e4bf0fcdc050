"""GRPO / PPO-clip loss on the trained tokens: pure functions over flat (N,) tensors.

Everything here works on the N trained (loss-masked) tokens of a micro-batch, already gathered, so
there is no mask and no padding to get wrong. Per-token ``weights`` carry the normalization (token or
sequence mean over the whole step, see ``packing.assign_weights``), so the loss of a step is the sum
of its micro-batch losses and gradient accumulation is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from . import corrections as C
from .packing import MicroBatch


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high
    tis_cap: float = 0.0  # > 0: truncated importance weight min(pi_old / pi_rollout, tis_cap)
    kl_coef: float = 0.0  # > 0: k3 KL penalty towards the reference policy
    dual_clip: float = 3.0  # > 1: for A<0 cap the per-token loss at -dual_clip * A (dual-clip PPO); 0: off
    loss: str = "ppo_clip"  # ppo_clip | gspo | cispo (corrections.py)
    correction: str = "none"  # none | tis | icepop | token_rs | seq_mask_geo | seq_mask_arith; none with tis_cap > 0 is tis
    ratio_base: str = "behaviour"  # the loss ratio's pi_old: behaviour (the engine's logprobs) | proximal (the
    # trainer's own, taken once before the step's updates: decoupled PPO); see step.train_step
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_clip_high: float = 0.28
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_low: float = 0.5
    seq_mask_high: float = 2.0

    @property
    def active_correction(self) -> str:
        """The correction in force: ``tis_cap > 0`` alone turns TIS on, as before ``correction`` existed."""
        return "tis" if self.correction == "none" and self.tis_cap > 0 else self.correction


# Sums over tokens, so micro-batches and ranks aggregate by addition; see ``summarize``. The mismatch_* and
# would_* sums describe the rollout-vs-trainer divergence on the trained tokens whatever the loss.
STAT_KEYS = ("tokens", "loss", "pg_loss", "clipped", "approx_kl", "ref_kl", "entropy", "ratio", "tis_weight",
             "corrected", "mismatch_k3", "would_tis", "would_icepop", "would_seq_mask_geo", "would_seq_mask_arith")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target and the entropy of each distribution.

    logits (N, V), targets (N,) -> logp (N,) with grad, entropy (N,) without. Logits are divided by
    the sampling temperature first, so logp is comparable with the engine's rollout logprobs.
    """
    logits = logits.float()  # (N, V); float32: bf16 log-softmax loses the ratio's precision
    if temperature != 1.0:
        logits = logits / temperature
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
    seq: torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    totals: dict | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``cfg.loss`` (corrections.py: ppo_clip, gspo or cispo) times ``cfg.correction``'s per-token weight,
    plus the KL penalty; returns (weighted loss sum, stat sums).

    All inputs (N,); ``seq`` (N,) is each token's trajectory (None: one), which gspo and the sequence
    masks read. ``old_logp`` is the ratio's base pi_old: the rollout logprobs (``ratio_base: behaviour``) or
    the proximal policy's (``proximal``: the trainer's own before the step's updates; with one update,
    this very forward detached, so the ratio is 1 and its gradient the plain policy gradient).
    ``prox_logp`` (default ``old_logp``) and ``rollout_logp`` give the correction's ratio
    rho = pi_prox / pi_rollout, the engine/trainer mismatch (tis: weight min(rho, tis_cap); icepop: rho
    inside [icepop_low, icepop_high], else 0; token_rs: 1 inside that band, else 0; seq_mask_*: drop
    trajectories whose mean ratio leaves [seq_mask_low, seq_mask_high]). ``totals`` holds whole-trajectory
    sums (corrections.seq_sums) where a trajectory is split over micro-batches or ranks: ``"gspo"`` of
    log(pi_theta / pi_old), ``"correction"`` of the sequence mask's log rho (geo) or rho (arith).
    ``cfg.dual_clip`` = c > 1 (ppo_clip) caps a negative-advantage token's loss at -c * A (Ye et al. 2020):
    min(max(-r A, -clip(r) A), -c A). Without it, for A < 0 the pessimistic min keeps the unclipped
    -r A, unbounded in r, so one token the engine sampled but the trainer finds very likely dominates.
    ``ref_logp`` adds kl_coef * k3(pi_ref || pi), k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    if seq is None:
        seq = torch.zeros_like(logp, dtype=torch.long)
    if prox_logp is None:
        prox_logp = old_logp
    totals = totals or {}
    log_ratio = logp - old_logp  # (N,)
    if cfg.loss == "ppo_clip":
        pg, clipped = C.ppo_clip(logp, old_logp, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    elif cfg.loss == "gspo":
        pg, clipped = C.gspo(logp, old_logp, advantages, seq, cfg.gspo_clip_low, cfg.gspo_clip_high,
                             totals.get("gspo"))
    elif cfg.loss == "cispo":
        pg, clipped = C.cispo(logp, old_logp, advantages, cfg.cispo_clip_high)
    else:
        raise ValueError(f"loss: {cfg.loss!r} is not one of {', '.join(C.LOSSES)}")
    weight, corrected = torch.ones_like(pg), torch.zeros_like(pg, dtype=torch.bool)
    correction = cfg.active_correction
    if correction != "none" and rollout_logp is not None:
        log_rho = (prox_logp - rollout_logp).detach()
        if correction == "tis":
            weight, corrected = C.tis(log_rho, cfg.tis_cap)
        elif correction == "icepop":
            weight, corrected = C.icepop(log_rho, cfg.icepop_low, cfg.icepop_high)
        elif correction == "token_rs":
            weight, corrected = C.token_rs(log_rho, cfg.icepop_low, cfg.icepop_high)
        elif correction == "seq_mask_geo":
            weight, corrected = C.seq_mask_geo(log_rho, seq, cfg.seq_mask_low, cfg.seq_mask_high, totals.get("correction"))
        elif correction == "seq_mask_arith":
            weight, corrected = C.seq_mask_arith(log_rho, seq, cfg.seq_mask_low, cfg.seq_mask_high, totals.get("correction"))
        else:
            raise ValueError(f"correction: {correction!r} is not one of {', '.join(C.CORRECTIONS)}")
        pg = pg * weight
    per_token = pg
    ref_kl = torch.zeros_like(pg)
    if cfg.kl_coef > 0 and ref_logp is not None:
        d = ref_logp - logp
        ref_kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.kl_coef * ref_kl
    loss = (weights * per_token).sum()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        stats = {
            "tokens": float(logp.numel()),
            "loss": float(loss),
            "pg_loss": float((weights * pg).sum()),
            "clipped": float(clipped.sum()),  # the clipped branch won: the token's gradient is zero or bounded
            "approx_kl": float(((ratio - 1) - log_ratio).sum()),  # k3 estimate of KL(old || current)
            "ref_kl": float(ref_kl.sum()),
            "ratio": float(ratio.sum()),
            "tis_weight": float(weight.sum()),  # the correction's weight (1 where none)
            "corrected": float(corrected.sum()),
        }
        if rollout_logp is not None:
            stats.update(mismatch_stats(prox_logp.detach() - rollout_logp, seq, cfg))
    return loss, stats


def mismatch_stats(log_rho: torch.Tensor, seq: torch.Tensor, cfg: LossConfig) -> dict[str, float]:
    """Sums over tokens of the trainer-vs-engine divergence, log_rho = log pi_prox - log pi_rollout: the
    k3 KL(rollout || trainer) and the tokens each correction would mask or cap at ``cfg``'s thresholds,
    whichever is on (so a run shows what turning one on would do). TIS counts only with tis_cap > 0. The
    sequence masks' counts here see only this micro-batch's part of a split trajectory (a diagnostic)."""
    with torch.no_grad():
        return {
            "mismatch_k3": float(C.k3(log_rho).sum()),
            "would_tis": float(C.tis(log_rho, cfg.tis_cap)[1].sum()) if cfg.tis_cap > 0 else 0.0,
            "would_icepop": float(C.icepop(log_rho, cfg.icepop_low, cfg.icepop_high)[1].sum()),
            "would_seq_mask_geo": float(C.seq_mask_geo(log_rho, seq, cfg.seq_mask_low, cfg.seq_mask_high)[1].sum()),
            "would_seq_mask_arith": float(C.seq_mask_arith(log_rho, seq, cfg.seq_mask_low, cfg.seq_mask_high)[1].sum()),
        }


def microbatch_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-policy logprobs and entropies of a micro-batch's trained tokens, (N,) each.

    The model runs with ``logits_to_keep`` empty, so its own lm_head projects nothing; a forward hook
    on the base model takes the final (normed) hidden states, and only the N trained positions go
    through ``head_logprobs`` (fp32, chunked). The call still goes through ``model`` itself, so FSDP2's
    hooks gather the weights (the root's, the head's among them, stay gathered until backward). The micro-batch's ``layout`` reaches the
    ``polar_varlen`` attention as a forward kwarg (other implementations ignore it).
    """
    if mb.layout.shares_prefix and model.config._attn_implementation != "polar_varlen":
        raise ValueError("shared-prefix micro-batches need attn_implementation 'polar_varlen' (trainer.attention)")
    hidden: list[torch.Tensor] = []
    hook = model.base_model.register_forward_hook(lambda _m, _a, out: hidden.append(out.last_hidden_state))
    try:
        model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
              use_cache=False, logits_to_keep=mb.positions[:0], polar_layout=mb.layout)
    finally:
        hook.remove()
    h = hidden[-1].flatten(0, 1)[mb.positions]  # (R, W, H) -> (N, H)
    return head_logprobs(h, model.get_output_embeddings(), mb.targets, temperature)


def head_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
    chunk_elements: int = 1 << 25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_head + ``token_logprobs`` of (N, H) final hidden states, in fp32 whatever the autocast, in chunks
    of about ``chunk_elements`` logits (128 MiB).

    fp32: bf16 logits lose the importance ratio's precision (issue 18). Chunks: when there are several,
    each chunk's logits are recomputed in backward (checkpoint) instead of kept, so memory is one
    chunk's, not N x V; a single chunk is simply kept (no recompute).
    """
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.float(), head.weight.float()
        b = head.bias.float() if head.bias is not None else None
        step = max(1, chunk_elements // w.shape[0])
        recompute = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad) and len(h) > step
        outs = []
        for i in range(0, max(len(h), 1), step):  # at least one (maybe empty) chunk: keeps the graph connected
            args = (h[i:i + step], w, b, targets[i:i + step], temperature)
            outs.append(checkpoint(_head_chunk, *args, use_reentrant=False) if recompute else _head_chunk(*args))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _head_chunk(h, w, b, targets, temperature):
    return token_logprobs(torch.nn.functional.linear(h, w, b), targets, temperature)


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
        "corrected_frac": sums.get("corrected", 0.0) / n,  # tokens the active correction masked or capped
        "mismatch_k3": sums.get("mismatch_k3", 0.0) / n,
        **{f"{k}_frac": sums.get(k, 0.0) / n for k in WOULD},
    }


WOULD = ("would_tis", "would_icepop", "would_seq_mask_geo", "would_seq_mask_arith")
