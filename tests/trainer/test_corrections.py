"""Losses and off-policy corrections (trainer/corrections.py): small hand-computed cases, and each loss's
gradient against finite differences of the objective it stands for."""

from __future__ import annotations

import math

import pytest
import torch

from streams.advantages import overlong_penalty
from trainer import corrections as C
from trainer.loss import LossConfig, policy_loss, summarize
from trainer.packing import assign_weights, sample_from_trace

T = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
LOG = lambda *x: torch.tensor([math.log(v) for v in x], dtype=torch.float64)  # noqa: E731


def test_ppo_clip_by_hand():
    # r = 1.5 with A = 1: clipped at 1.28; r = 0.5 with A = -1: clipped at 0.8; r = 5 with A = -1: the dual clip's 3
    pg, hit = C.ppo_clip(LOG(1.5, 0.5, 5.0), T(0, 0, 0), T(1, -1, -1), 0.2, 0.28, 3.0)
    assert torch.allclose(pg, T(-1.28, 0.8, 3.0))
    assert hit.tolist() == [True, True, True]
    pg, hit = C.ppo_clip(LOG(1.1, 0.9), T(0, 0), T(2, -2), 0.2, 0.28, 3.0)
    assert torch.allclose(pg, T(-2.2, 1.8)) and hit.tolist() == [False, False]


def test_gspo_by_hand():
    # sequence 0: log ratios 0.2, 0 -> s = e^0.1; sequence 1: -0.1 -> s = e^-0.1; A = 1, 1, -1
    logp = T(0.2, 0.0, -0.1).requires_grad_()
    pg, hit = C.gspo(logp, T(0, 0, 0), T(1, 1, -1), torch.tensor([0, 0, 1]), 0.2, 0.28)
    s0, s1 = math.exp(0.1), math.exp(-0.1)
    assert torch.allclose(pg, T(-s0, -s0, s1)) and not hit.any()
    pg.sum().backward()
    assert torch.allclose(logp.grad, T(-s0, -s0, s1))  # d/dlogp_t of s_it is s_i: each token carries its sequence's ratio
    # the paper's tiny clip range: s0 = 1.105 > 1 + 4e-4 with A > 0 is clipped, whole sequence
    _, hit = C.gspo(T(0.2, 0.0, -0.1), T(0, 0, 0), T(1, 1, -1), torch.tensor([0, 0, 1]), 3e-4, 4e-4)
    assert hit.tolist() == [True, True, True]


def test_cispo_by_hand():
    logp = LOG(0.75, 0.25).requires_grad_()
    pg, hit = C.cispo(logp, LOG(0.5, 0.5), T(1, 1), 0.28)  # r = 1.5 -> weight 1.28; r = 0.5 -> 0.5 (no floor)
    assert torch.allclose(pg, T(-1.28 * math.log(0.75), -0.5 * math.log(0.25)))
    assert hit.tolist() == [True, False]
    pg.sum().backward()
    assert torch.allclose(logp.grad, T(-1.28, -0.5))  # -sg(r_hat) A: every token keeps a gradient


def test_corrections_by_hand():
    w, hit = C.tis(LOG(0.4, 1.0, 6.0), 2.0)
    assert torch.allclose(w, T(0.4, 1.0, 2.0)) and hit.tolist() == [False, False, True]
    # IcePop's M(k) = k in band keeps the ratio itself; token_rs (the indicator) keeps 1
    w, hit = C.icepop(LOG(0.4, 1.5, 6.0), 0.5, 5.0)
    assert torch.allclose(w, T(0.0, 1.5, 0.0)) and hit.tolist() == [True, False, True]
    w, hit = C.token_rs(LOG(0.4, 1.5, 6.0), 0.5, 5.0)
    assert w.tolist() == [0.0, 1.0, 0.0] and hit.tolist() == [True, False, True]
    # sequence 0: ratios 0.25 and 4 (geometric mean 1, arithmetic 2.125); sequence 1: 1.5
    seq = torch.tensor([0, 0, 1])
    w, _ = C.seq_mask_geo(LOG(0.25, 4.0, 1.5), seq, 0.5, 2.0)
    assert w.tolist() == [1.0, 1.0, 1.0]
    w, hit = C.seq_mask_arith(LOG(0.25, 4.0, 1.5), seq, 0.5, 2.0)
    assert w.tolist() == [0.0, 0.0, 1.0] and hit.tolist() == [True, True, False]
    assert torch.allclose(C.k3(LOG(2.0, 1.0)), T(1 - math.log(2.0), 0.0))


def test_seq_mean():
    x = T(1, 3, 10, 0)
    assert C.seq_mean(x, torch.tensor([0, 0, 1, 2])).tolist() == [2.0, 2.0, 10.0, 0.0]
    # a sequence split over two micro-batches: their partial sums added give the whole sequence's mean
    a, b = C.seq_sums(T(1, 10), torch.tensor([0, 1]), 2), C.seq_sums(T(3, 0), torch.tensor([0, 2 - 1]), 2)
    totals = (a[0] + b[0], a[1] + b[1])
    assert C.seq_mean(T(1, 10), torch.tensor([0, 1]), totals).tolist() == [2.0, 5.0]


def test_sequence_quantities_are_per_trajectory_not_per_trace():
    """One trajectory recorded as two traces (one per call) gets ONE GSPO ratio and ONE mask decision: the
    trajectory's tokens have rho = 4 (call 1) and 0.25, 1 (call 2). Per trace, call 1's geometric mean 4 would be
    masked and call 2's 0.5 kept; per trajectory the mean is (ln 4 + ln 0.25 + 0) / 3 = 0: kept, with s = 1."""
    mk = lambda n, tid: sample_from_trace([1] * (n + 1), [0] + [1] * n, [0.0] * (n + 1), 1.0, 100,  # noqa: E731
                                          trajectory_id=tid)
    from trainer.packing import pack

    (mb,) = pack([mk(1, "t"), mk(2, "t"), mk(1, "u")], 64)
    assert mb.seq.tolist() == [0, 0, 0, 1]  # trajectory numbers, not trace numbers
    log_rho = LOG(4.0, 0.25, 1.0, 3.0)
    w, _ = C.seq_mask_geo(log_rho, mb.seq, 0.5, 2.0)
    assert w.tolist() == [1.0, 1.0, 1.0, 0.0]
    per_trace, _ = C.seq_mask_geo(log_rho, torch.tensor([0, 1, 1, 2]), 0.5, 2.0)
    assert per_trace.tolist() == [0.0, 1.0, 1.0, 0.0]  # what numbering traces would do
    pg, _ = C.gspo(log_rho, T(0, 0, 0, 0), T(1, 1, 1, 1), mb.seq, 3.0, 3.0)
    assert torch.allclose(pg, T(-1, -1, -1, -3))  # s = 1 for the trajectory t; 3 for u


def _finite_diff(f, x, eps=1e-6):
    g = torch.zeros_like(x)
    for i in range(len(x)):
        d = torch.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


@pytest.mark.parametrize("loss", C.LOSSES)
def test_gradient_is_the_objectives(loss):
    """Autograd of each loss's weighted sum against finite differences of the objective it stands for, off the
    clip boundaries: PPO's surrogate itself; GSPO's sequence-level -min(s_i A, clip(s_i) A), averaged per
    sequence (its token form must give the same gradient); CISPO's -r_hat A log pi with r_hat held at its value
    (the stop-gradient)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    n = len(seq)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    logp0 = old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.6  # ratios in about [0.74, 1.35]
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    counts = torch.bincount(seq).double()
    w = 1 / (counts[seq] * len(counts))  # seq_mean weights
    lo, hi = (3e-2, 4e-2) if loss == "gspo" else (0.2, 0.28)

    def token_form(logp):
        if loss == "ppo_clip":
            return (w * C.ppo_clip(logp, old, adv, lo, hi, 3.0)[0]).sum()
        if loss == "gspo":
            return (w * C.gspo(logp, old, adv, seq, lo, hi)[0]).sum()
        return (w * C.cispo(logp, old, adv, hi)[0]).sum()

    if loss == "gspo":
        def objective(logp):
            s = torch.exp(C.seq_mean(logp - old, seq))
            per_seq = -torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)
            return (w * per_seq).sum()
    elif loss == "cispo":
        r_hat = torch.exp(logp0 - old).clamp(max=1 + hi)

        def objective(logp):
            return (w * -r_hat * adv * logp).sum()
    else:
        objective = token_form
    x = logp0.clone().requires_grad_()
    token_form(x).backward()
    assert torch.allclose(x.grad, _finite_diff(objective, logp0), atol=1e-7), (x.grad, _finite_diff(objective, logp0))
    assert x.grad.abs().sum() > 0  # not trivially equal


@pytest.mark.parametrize("correction", ["tis", "icepop", "token_rs", "seq_mask_geo", "seq_mask_arith"])
def test_policy_loss_applies_the_correction_to_each_tokens_gradient(correction):
    """With the ratio against the trainer's own logprobs (ratio 1), each token's gradient is
    -A w_t / N: the correction's weight, 0 where it masks."""
    logp = LOG(0.5, 0.5, 0.5, 0.5).float().requires_grad_()
    rollout = LOG(0.5, 0.05, 0.4, 0.45).float()  # rho = 1, 10, 1.25, 1.11
    seq = torch.tensor([0, 0, 1, 1])
    cfg = LossConfig(correction=correction, tis_cap=2.0, icepop_high=5.0, seq_mask_high=2.0)
    loss, stats = policy_loss(logp, logp.detach(), torch.ones(4), torch.full((4,), 0.25), cfg, rollout, seq=seq)
    loss.backward()
    want = {"tis": [1.0, 2.0, 1.25, 1.0 / 0.9], "icepop": [1.0, 0.0, 1.25, 1.0 / 0.9], "token_rs": [1, 0, 1, 1],
            "seq_mask_geo": [0, 0, 1, 1],  # sequence 0: geometric mean sqrt(10) = 3.16 > 2
            "seq_mask_arith": [0, 0, 1, 1]}[correction]
    assert torch.allclose(logp.grad, -0.25 * torch.tensor(want, dtype=torch.float32), atol=1e-6), logp.grad
    assert stats["corrected"] == {"tis": 1, "icepop": 1, "token_rs": 1}.get(correction, 2)
    m = summarize(stats)
    assert m["mismatch_k3"] == pytest.approx(float(C.k3(torch.log(torch.tensor([1, 10, 1.25, 1 / 0.9]))).mean()), rel=1e-5)
    assert m["would_icepop_frac"] == 0.25 and m["would_seq_mask_geo_frac"] == 0.5


def test_tis_cap_alone_still_turns_tis_on():
    assert LossConfig(tis_cap=2.0).active_correction == "tis" and LossConfig().active_correction == "none"


def test_unknown_loss_is_one_line():
    with pytest.raises(ValueError, match="loss: 'ppo' is not one of ppo_clip, gspo, cispo"):
        policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1), LossConfig(loss="ppo"))


def test_constant_length_normalization():
    """Dr. GRPO: each trajectory's token sum over a constant C, mean over trajectories: weight 1 / (C * T)."""
    s = [sample_from_trace([1] * n, [0] + [1] * (n - 1), [0.0] * n, 1.0, 100) for n in (3, 5)]
    s = [x.__class__(**{**x.__dict__, "trajectory_id": f"t{i}"}) for i, x in enumerate(s)]
    assert [x.weight for x in assign_weights(s, "constant", 10)] == [1 / 20, 1 / 20]
    # a constant of the run, never the step's longest: 0 is refused, and the default is one documented number
    with pytest.raises(ValueError, match="norm_tokens >= 1"):
        assign_weights(s, "constant", 0)
    from trainer.config import ConfigError, TrainConfig

    assert TrainConfig().loss_norm_tokens == 4096
    with pytest.raises(ConfigError, match="loss_norm_tokens=0"):
        TrainConfig.from_overrides({"loss_norm": "constant", "loss_norm_tokens": 0})


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: no penalty up to 6 tokens, then -1/4 per token, -1 beyond 10
    got = [overlong_penalty(n, 10, 4) for n in (6, 7, 8, 10, 11)]
    assert got == [0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(8, 10, 4, penalty=0.5) == -0.25 and overlong_penalty(99, 0, 0) == 0.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(5, 10, 11)


def test_ratio_quantiles_by_hand():
    from trainer.step import ratio_quantiles

    log_rho = torch.log(torch.arange(1, 201, dtype=torch.float64) / 100)  # ratios 0.01 .. 2.00
    q = ratio_quantiles(log_rho)
    assert q["mismatch_ratio_max"] == pytest.approx(2.0) and q["mismatch_ratio_p99"] == pytest.approx(1.98)
    assert ratio_quantiles(torch.zeros(0)) == {"mismatch_ratio_max": 1.0, "mismatch_ratio_p99": 1.0}


def test_mismatch_warning_is_one_line_past_the_threshold():
    from trainer.metrics import mismatch_warnings

    m = {"mismatch_k3": 2e-3, "mismatch_ratio_max": 7.5, "mismatch_ratio_p99": 1.9}
    (line,) = mismatch_warnings(m, 1e-3, 4)
    assert "\n" not in line and line.startswith("step 4: rollout/trainer mismatch k3 2.00e-03 > 0.001")
    assert mismatch_warnings(m, 1e-2, 4) == [] and mismatch_warnings(m, 0.0, 4) == []  # below; 0: never
