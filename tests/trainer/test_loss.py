"""GRPO / PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from trainer.loss import LossConfig, policy_loss, summarize, token_logprobs

CFG = LossConfig(clip_low=0.2, clip_high=0.28)


def _three_tokens(ratios, advantages):
    old = torch.full((3,), math.log(0.5))
    logp = (old + torch.log(torch.tensor(ratios))).requires_grad_()
    return logp, old, torch.tensor(advantages), torch.full((3,), 1 / 3)


def test_three_token_loss_clipped_and_unclipped():
    # token 0: ratio 1.1, A=+1 -> inside the clip range: -1.1
    # token 1: ratio 1.5, A=+1 -> clipped at 1 + 0.28:    -1.28 (no gradient)
    # token 2: ratio 0.6, A=-1 -> clipped at 1 - 0.2:     +0.8  (no gradient)
    logp, old, adv, w = _three_tokens([1.1, 1.5, 0.6], [1.0, 1.0, -1.0])
    loss, stats = policy_loss(logp, old, adv, w, CFG)
    assert loss.item() == pytest.approx((-1.1 - 1.28 + 0.8) / 3, abs=1e-6)
    assert stats["clipped"] == 2 and stats["tokens"] == 3
    loss.backward()
    # d/dlogp of -ratio*A/3 is -ratio*A/3 on the unclipped token, zero on the clipped ones
    assert logp.grad.tolist() == pytest.approx([-1.1 / 3, 0.0, 0.0], abs=1e-6)


def test_three_token_loss_pessimistic_side_is_not_clipped():
    # A<0 with ratio above 1+clip_high: min() keeps the unclipped (worse) term, so the gradient flows
    logp, old, adv, w = _three_tokens([1.5, 0.9, 1.0], [-1.0, -1.0, 2.0])
    loss, stats = policy_loss(logp, old, adv, w, CFG)
    assert loss.item() == pytest.approx((1.5 + 0.9 - 2.0) / 3, abs=1e-6)
    assert stats["clipped"] == 0
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([1.5 / 3, 0.9 / 3, -2.0 / 3], abs=1e-6)


def test_asymmetric_clip_bounds():
    logp, old, adv, w = _three_tokens([1.25, 0.79, 1.3], [1.0, -1.0, 1.0])
    _, stats = policy_loss(logp, old, adv, w, CFG)
    assert stats["clipped"] == 2  # 0.79 < 0.8 with A<0, 1.3 > 1.28 with A>0; 1.25 is inside


def test_truncated_importance_weight():
    old = torch.log(torch.tensor([0.5, 0.6]))
    rollout = torch.log(torch.tensor([1.0, 0.2]))  # pi_old / pi_rollout = 0.5 and 3.0 -> capped at 2
    logp = old.clone().requires_grad_()
    adv, w = torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5])
    loss, stats = policy_loss(logp, old, adv, w, LossConfig(tis_cap=2.0), rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(0.5 * 0.5 + 2.0 * 0.5), abs=1e-6)
    assert stats["tis_weight"] == pytest.approx(2.5)


def test_k3_kl_to_reference():
    logp = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
    ref = torch.log(torch.tensor([0.25, 0.25]))
    zero = torch.zeros(2)
    loss, stats = policy_loss(logp, logp.detach(), zero, torch.ones(2), LossConfig(kl_coef=0.1), ref_logp=ref)
    d = math.log(0.5)  # ref - logp on the first token; 0 on the second
    assert stats["ref_kl"] == pytest.approx(math.exp(d) - d - 1, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1), abs=1e-6)


def test_token_logprobs_match_log_softmax_with_temperature():
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 11), torch.randint(0, 11, (5,))
    logp, ent = token_logprobs(logits, targets, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(logp, ref.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)


def test_summarize_turns_sums_into_means():
    s = summarize({"tokens": 4, "clipped": 1, "approx_kl": 0.2, "entropy": 8.0, "loss": -0.5})
    assert s["clip_frac"] == 0.25 and s["approx_kl"] == pytest.approx(0.05) and s["entropy"] == 2.0
    assert s["loss"] == -0.5
