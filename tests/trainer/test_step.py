"""One real optimizer step on a tiny model moves logprobs the way the advantages say; the trainer's step
(``train_step``) trains at the scheduled, saturation-scaled rate."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.plugins.trainer import make_group
from trainer.loss import LossConfig, microbatch_logprobs
from trainer.packing import assign_weights, pack, samples_from_group
from trainer.config import TrainConfig
from trainer.step import accumulate_gradients, train_step


def _sequence_logprob(model, sample):
    mb = pack([sample], 1024)[0]
    with torch.no_grad():
        lp, _ = microbatch_logprobs(model, mb, 1.0)
    return lp.sum().item()


@pytest.mark.parametrize("loss_norm", ["token_mean", "seq_mean"])
def test_one_step_raises_positive_and_lowers_negative(trainer_model_dir, loss_norm):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    group = make_group("g", [[11, 12, 13, 14], [21, 22, 23]], rewards=[1.0, 0.0], prompt=[5, 6, 7, 8, 9])
    samples, _ = samples_from_group(group, 1024)
    # rollout logprobs = the current model's, as if sampled from it just now (ratio 1: on-policy)
    samples = [s.__class__(**{**s.__dict__, "rollout_logprobs": tuple(
        microbatch_logprobs(model, pack([s], 1024)[0], 1.0)[0].tolist())}) for s in samples]
    before = [_sequence_logprob(model, s) for s in samples]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    micro = pack(assign_weights(samples, loss_norm), 1024)
    stats = accumulate_gradients(model, micro, LossConfig())
    opt.step()

    after = [_sequence_logprob(model, s) for s in samples]
    assert stats["tokens"] == 7 and stats["clipped"] == 0
    assert stats["ratio"] == pytest.approx(7.0, abs=1e-4)  # on-policy: every ratio is 1
    assert after[0] > before[0] + 0.1, (before, after)  # advantage +0.5
    assert after[1] < before[1] - 0.1, (before, after)  # advantage -0.5


def test_accumulation_over_microbatches_equals_one_batch(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    group = make_group("g", [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]], [1.0, 0.0, 0.5, 0.2], logprob=-5.0)
    samples = assign_weights(samples_from_group(group, 1024)[0], "token_mean")

    def grads(budget):
        model.zero_grad()
        accumulate_gradients(model, pack(samples, budget), LossConfig(), temperature=0.8)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    one, split = grads(1024), grads(9)
    assert len(pack(samples, 9)) == 3  # inputs of 7 | 6 | 5+4 tokens
    assert torch.allclose(one, split, atol=1e-6, rtol=1e-4)


def test_tis_ratio_is_against_the_trainer_and_the_weight_capped(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    group = make_group("g", [[11, 12, 13], [21, 22]], [1.0, 0.0], logprob=-30.0)  # engine far from the trainer
    micro = pack(assign_weights(samples_from_group(group, 1024)[0], "token_mean"), 1024)
    stats = accumulate_gradients(model, micro, LossConfig(tis_cap=2.0))
    assert stats["tokens"] == 5
    assert stats["ratio"] == pytest.approx(5.0, abs=1e-4)  # pi_old is the trainer's own (detached): exactly 1
    assert stats["tis_weight"] == pytest.approx(10.0)  # pi_old / pi_rollout = e^(~25), capped at 2
    plain = accumulate_gradients(model, micro, LossConfig())
    assert plain["ratio"] > 1e6  # without TIS the ratio is against the rollout logprobs


def test_kl_to_reference_grows_after_a_step(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa").requires_grad_(False)
    group = make_group("g", [[11, 12, 13], [21, 22]], [1.0, 0.0])
    micro = pack(assign_weights(samples_from_group(group, 1024)[0], "token_mean"), 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = accumulate_gradients(model, micro, LossConfig(kl_coef=0.1), ref_model=ref)
    opt.step()
    opt.zero_grad()
    second = accumulate_gradients(model, micro, LossConfig(kl_coef=0.1), ref_model=ref)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7) and second["ref_kl"] > 1e-4


def test_train_step_trains_at_the_scheduled_saturated_rate(trainer_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    group = make_group("g", [[11, 12, 13], [21, 22], [31, 32, 33, 34]], [1.0, 1.0, 0.0], logprob=-5.0)
    cfg = TrainConfig(lr=1e-3, warmup_steps=3, lr_saturation=0.5, token_budget=11, weight_decay=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=123.0)  # every group's rate is the step's
    before = [p.detach().clone() for p in model.parameters()]
    out = train_step(model, opt, samples_from_group(group, 1024)[0], cfg, reward_mean=0.75, step=1)
    assert out.lr_scale == pytest.approx(0.5)  # reward 0.75, knee 0.5: half the rate
    assert out.lr == pytest.approx(1e-3 * 2 / 4 * 0.5)  # step 1 of 3 warmup steps
    assert all(g["lr"] == out.lr for g in opt.param_groups)
    assert out.no_update is None and out.grad_norm > 0
    assert len(out.micro) == 2 and out.sums["tokens"] == 9  # inputs of 7 | 6 + 5 tokens
    assert out.sums["tokens_fed"] == sum(mb.num_tokens for mb in out.micro)
    assert sum(s.weight * len(s.trained) for s in out.samples) == pytest.approx(1.0)  # token_mean over the step
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())

    flat = make_group("f", [[11, 12], [21]], [1.0, 1.0])  # no signal: no update, yet the step's stats
    before = [p.detach().clone() for p in model.parameters()]
    out = train_step(model, opt, samples_from_group(flat, 1024)[0], cfg, reward_mean=1.0, step=2)
    assert out.no_update == "no_signal" and out.sums["tokens"] == 3
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
