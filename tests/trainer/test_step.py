"""One real optimizer step on a tiny model moves logprobs the way the advantages say."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.plugins.trainer import make_group
from trainer.loss import LossConfig, microbatch_logprobs
from trainer.packing import assign_weights, pack, samples_from_group
from trainer.step import accumulate_gradients


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
