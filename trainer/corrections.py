"""Policy losses and off-policy corrections: pure functions over the flat (N,) trained tokens of a
micro-batch (loss.py's layout), ``seq`` (N,) giving each token's sequence (0..S-1) where a function works
per sequence.

Notation: ``logp`` = log pi_theta(y_t) with grad; ``old`` = log pi_old(y_t), the ratio's base (setting
``ratio_base``: ``behaviour``, the engine's logprobs, or ``proximal``, the trainer's own logprobs taken once
before the step's updates: AReaL's decoupled PPO; see ``step.train_step``); ``rollout`` = the engine's
logprob of the token it sampled. ``A`` is the token's advantage (one per trajectory here). Losses return
the per-token loss (weights are applied by ``loss.policy_loss``) and a bool mask of the tokens whose
gradient the clip removed or bounded. Corrections return a detached per-token weight and a bool mask of
the tokens they masked or capped; they read only ``rho_t = pi_prox / pi_rollout`` (the trainer-vs-engine
ratio at the start of the step).

``seq`` numbers each token's TRAJECTORY (the unit ``loss_norm: seq_mean`` averages over), not its trace: a
trajectory recorded as several traces (one per call) gets one GSPO ratio and one sequence-mask decision.
Sequence means go through ``seq_mean``, whose ``reduce`` sums partial sums over micro-batches and ranks
when a trajectory's tokens are spread over them (step.py).
"""

from __future__ import annotations

import torch

LOSSES = ("ppo_clip", "gspo", "cispo")
CORRECTIONS = ("none", "tis", "icepop", "token_rs", "seq_mask_geo", "seq_mask_arith")
SEQUENCE_CORRECTIONS = ("seq_mask_geo", "seq_mask_arith")


def seq_sums(x: torch.Tensor, seq: torch.Tensor, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of ``x`` and token counts, (n,) each (``n``: the number of sequences, default
    max(seq) + 1): the partial sums ``seq_mean`` adds up over micro-batches and ranks."""
    n = (int(seq.max()) + 1 if seq.numel() else 0) if n is None else n
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq, x)
    return sums, torch.bincount(seq, minlength=n).to(x.dtype)


def seq_mean(x: torch.Tensor, seq: torch.Tensor, totals: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each token's sequence mean of ``x``, broadcast back to the tokens: (N,) -> (N,); differentiable.
    ``totals``: (sums, counts) of each sequence over all its tokens (``seq_sums`` added over every
    micro-batch and rank that holds some), used instead of this call's own tokens (detached then)."""
    if x.numel() == 0:
        return x
    sums, counts = (t.to(x.device, x.dtype) for t in totals) if totals is not None else seq_sums(x, seq)
    return (sums / counts.clamp(min=1))[seq]


# -- losses --------------------------------------------------------------------------------------------

def ppo_clip(logp, old, adv, clip_low: float, clip_high: float, dual_clip: float = 0.0):
    """PPO-clip with asymmetric clipping (DAPO's clip-higher) and dual clip (Ye et al. 2020):

        r_t = pi_theta(y_t) / pi_old(y_t)
        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
        dual clip, A < 0:  l_t = min(l_t, -c A)        (c = dual_clip > 1; 0: off)
    """
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        hit = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    if dual_clip > 0:  # the constant -c A wins beyond r > c: no gradient from that token
        cap = -dual_clip * adv
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(dual, cap, pg)
        hit = hit | dual
    return pg, hit


def gspo(logp, old, adv, seq, clip_low: float, clip_high: float, totals=None):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), its token form GSPO-token with one advantage per sequence:

        s_i = (pi_theta(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp(1/|y_i| sum_t log(pi_theta(y_it) / pi_old(y_it)))
        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]      (value s_i, gradient s_i grad log pi_theta(y_it))
        l_it = -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)

    The paper's objective averages each sequence's tokens (``loss_norm: seq_mean``); its clip range is
    tiny (3e-4 / 4e-4) because s_i is a per-token geometric mean. Here ``loss_norm`` stays the trainer's
    (``token_mean`` by default): on-policy s_i is 1 and the clip never binds, so this is the policy gradient
    under that normalization, and ``seq_mean``'s length bias collapsed a seed (docs/trainer.md, GSPO).
    ``seq`` numbers trajectories; ``totals`` (``seq_sums`` of log(pi_theta / pi_old) over the whole
    trajectory, from every micro-batch holding part of it) gives s_i when a trajectory is split.
    """
    log_s = seq_mean(logp - old, seq, totals)
    ratio = torch.exp(logp - logp.detach() + log_s.detach())
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    with torch.no_grad():
        hit = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    return pg, hit


def cispo(logp, old, adv, clip_high: float):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update, so every token
    keeps a gradient:

        r_hat_t = clip(r_t, 1 - eps_low, 1 + eps_high),   r_t = pi_theta(y_t) / pi_old(y_t)
        l_t = -sg(r_hat_t) A log pi_theta(y_t)

    As in the paper, no lower bound (eps_low large: only eps_high is tuned). The loss's value is not a
    surrogate of the return (its gradient is what matters): -r_hat A log pi.
    """
    ratio = torch.exp(logp - old).detach()
    w = ratio.clamp(max=1 + clip_high)
    return -w * adv * logp, ratio > 1 + clip_high


# -- corrections (weights from rho_t = pi_old / pi_rollout) -------------------------------------------

def tis(log_rho: torch.Tensor, cap: float):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): w_t = min(rho_t, C)."""
    rho = torch.exp(log_rho).detach()
    return rho.clamp(max=cap), rho > cap


def icepop(log_rho: torch.Tensor, low: float, high: float):
    """IcePop (Ling team, "Every Step Evolves", Ring-1T, 2025; slime's implementation): the token's gradient
    is weighted by M(k), the ratio itself inside the band and 0 outside,

        k_t = pi_train(y_t) / pi_infer(y_t);   M(k) = k if alpha <= k <= beta else 0     (alpha 0.5, beta 5)

    so an in-band token is importance-corrected (as TIS does) and an out-of-band one dropped."""
    rho = torch.exp(log_rho).detach()
    keep = (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho)), ~keep


def token_rs(log_rho: torch.Tensor, low: float, high: float):
    """Token-level rejection sampling (verl's rollout correction ``rollout_rs: token``): drop tokens whose
    ratio leaves the band, keep the rest with weight 1 (no importance weight),

        w_t = 1[low <= rho_t <= high]

    IcePop's band without its M(k) = k: the indicator alone."""
    rho = torch.exp(log_rho).detach()
    keep = (rho >= low) & (rho <= high)
    return keep.to(rho.dtype), ~keep


def seq_mask_geo(log_rho: torch.Tensor, seq: torch.Tensor, low: float, high: float, totals=None):
    """Sequence-level masked IS, geometric (verl's rollout rejection sampling "geometric", TRL, SkyRL):
    drop a whole sequence when the geometric mean of its token ratios leaves the band,

        g_i = exp(1/|y_i| sum_t log rho_it);   w_it = 1[low <= g_i <= high]

    Length-invariant: a long sequence is not masked for being long. ``totals``: ``seq_sums`` of log rho
    over whole trajectories (see ``seq_mean``)."""
    g = torch.exp(seq_mean(log_rho.detach(), seq, totals))
    keep = (g >= low) & (g <= high)
    return keep.to(g.dtype), ~keep


def seq_mask_arith(log_rho: torch.Tensor, seq: torch.Tensor, low: float, high: float, totals=None):
    """Sequence-level masked IS, arithmetic: as ``seq_mask_geo`` with the sequence's arithmetic mean ratio

        a_i = 1/|y_i| sum_t rho_it;   w_it = 1[low <= a_i <= high]

    (one token with a large ratio moves a_i more than g_i: stricter against outliers). ``totals``:
    ``seq_sums`` of rho (not log rho) over whole trajectories."""
    a = seq_mean(torch.exp(log_rho.detach()), seq, totals)
    keep = (a >= low) & (a <= high)
    return keep.to(a.dtype), ~keep


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate (Schulman 2020) of KL(q || p) from samples of q, log_ratio = log p - log q:
    exp(log_ratio) - 1 - log_ratio >= 0, unbiased, 0 exactly when p = q on the sample."""
    return torch.expm1(log_ratio) - log_ratio
