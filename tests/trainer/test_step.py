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
    stats = accumulate_gradients(model, micro, LossConfig(tis_cap=2.0, ratio_base="proximal"))
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


def _traces(trajectories: int = 4, seed: int = 0):
    """Trajectories of two traces each (one per call: the second repeats the first call as its prefix), rollout
    logprobs 0.3 nats off the model's random ones in both directions, advantages of both signs."""
    import random

    from trainer.packing import sample_from_trace

    rng = random.Random(seed)
    out = []
    for t in range(trajectories):
        first = [5, 6, 7] + [rng.randrange(10, 60) for _ in range(4)]
        second = first + [8, 9] + [rng.randrange(10, 60) for _ in range(3)]
        adv = (-1) ** t * (0.5 + t / 4)
        for ids, start in ((first, 3), (second, 9)):
            mask = [0] * start + [1] * (len(ids) - start)
            lps = [0.0] * start + [-5.2 + rng.choice((-0.3, 0.3)) for _ in ids[start:]]
            out.append(sample_from_trace(ids, mask, lps, adv, 1024, group_id="g", trajectory_id=f"g/t{t}"))
    return out


def _step(model_dir, samples, opt_cls=torch.optim.SGD, **settings):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    cfg = TrainConfig(lr=0.5, lr_saturation=1.0, weight_decay=0.0, grad_clip=0.0, attn_implementation="sdpa",
                      **settings)
    opt = opt_cls(model.parameters(), lr=cfg.lr)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    out = train_step(model, opt, samples, cfg, reward_mean=0.0)
    return model, out, len(steps), len(forwards)


@pytest.mark.parametrize("settings", [{"loss": "gspo", "gspo_clip_low": 0.2, "gspo_clip_high": 0.28},
                                      {"correction": "seq_mask_geo", "seq_mask_low": 0.65, "seq_mask_high": 2.0},
                                      {"correction": "seq_mask_arith", "seq_mask_low": 0.74, "seq_mask_high": 2.0}])
def test_a_trajectory_split_over_microbatches_gets_the_update_of_a_whole_one(trainer_model_dir, settings):
    """GSPO's ratio and the sequence masks are over the trajectory even when its traces land in different
    micro-batches (token_budget 16): the same update as with every trace in one. The trajectories' mean ratios
    pi_trainer / pi_rollout are about 0.58, 0.70, 0.70, 0.76 (geometric) and 0.61, 0.73, 0.72, 0.77 (arithmetic):
    the bands mask one and three of the four."""
    samples = _traces()
    whole, out1, _, _ = _step(trainer_model_dir, samples, token_budget=1024, loss_norm="seq_mean", **settings)
    split, out2, _, _ = _step(trainer_model_dir, samples, token_budget=16, loss_norm="seq_mean", **settings)
    from trainer.step import splits_a_trajectory

    assert not splits_a_trajectory(out1.micro) and splits_a_trajectory(out2.micro)
    for a, b in zip(whole.parameters(), split.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert out1.sums["corrected"] == out2.sums["corrected"]
    if "correction" in settings:  # the band masks some trajectories, not all: the test can tell them apart
        assert 0 < out1.sums["corrected"] < out1.sums["tokens"], out1.sums


def test_minibatches_each_take_an_optimizer_step_with_the_proximal_logprobs_taken_once(trainer_model_dir):
    samples = _traces()
    model, out, steps, forwards = _step(trainer_model_dir, samples, minibatches=2, epochs=2, ratio_base="proximal",
                                        token_budget=1024)
    assert steps == 4  # 2 minibatches x 2 epochs
    assert forwards == 2 + 4  # one no-grad forward per micro-batch before any update, then one per update
    # the first update's ratio is 1 (pi_prox is the weights it starts from); later ones see the policy's drift
    assert abs(out.sums["ratio"] / out.sums["tokens"] - 1) > 1e-3
    one, out1, steps1, forwards1 = _step(trainer_model_dir, samples, ratio_base="proximal", token_budget=1024)
    assert (steps1, forwards1) == (1, 1)  # one update: pi_prox is its own forward, no extra pass
    assert out1.sums["ratio"] == pytest.approx(out1.sums["tokens"], abs=1e-4)


def test_the_ratio_base_is_a_setting_not_a_side_effect_of_the_correction(trainer_model_dir):
    """behaviour: ratio pi_theta / pi_rollout (far from 1 here, so PPO clips); proximal: ratio 1 on the one update.
    The correction (tis) weights by pi_prox / pi_rollout under either base."""
    samples = _traces()
    _, beh, _, _ = _step(trainer_model_dir, samples, correction="tis", tis_cap=2.0)
    _, prox, _, _ = _step(trainer_model_dir, samples, correction="tis", tis_cap=2.0, ratio_base="proximal")
    n = beh.sums["tokens"]
    assert abs(beh.sums["ratio"] / n - 1) > 0.1 and beh.sums["clipped"] > 0
    assert prox.sums["ratio"] == pytest.approx(n, abs=1e-3) and prox.sums["clipped"] == 0
    assert beh.sums["tis_weight"] == pytest.approx(prox.sums["tis_weight"], rel=1e-5)
