"""Loss correctness: TIS without a second forward, dual-clip, seq_mean per trajectory across builders."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas import TrainingGroup, Trajectory
from streams.assembly import CallTokens
from streams.builders import assemble
from tests.plugins.trainer import make_group
from trainer.config import ConfigError, TrainConfig
from trainer.loss import LossConfig, microbatch_logprobs, policy_loss
from trainer.packing import assign_weights, pack, samples_from_group
from trainer.step import accumulate_gradients


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# -- truncated importance sampling -------------------------------------------------------------------


def test_tis_takes_one_forward_and_weights_by_trainer_over_rollout(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    group = make_group("g", [[11, 12, 13], [21, 22]], [1.0, 0.0])
    samples = assign_weights(samples_from_group(group, 1024)[0], "token_mean")
    mb = pack(samples, 1024)[0]
    with torch.no_grad():
        current, _ = microbatch_logprobs(model, mb, 1.0)
    # the engine's logprobs differ from the trainer's by these per-token offsets
    offsets = torch.tensor([0.5, -0.3, 0.1, -2.0, 1.0])  # pi/pi_rollout = e^-0.5, e^0.3 ... e^2 capped at 2
    mb.rollout_logprobs = current + offsets
    cap = 2.0
    expected = torch.exp(-offsets).clamp(max=cap)

    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    stats = accumulate_gradients(model, [mb], LossConfig(tis_cap=cap, ratio_base="proximal"))
    hook.remove()
    assert len(forwards) == 1  # no second, no-grad forward for pi_old
    assert stats["ratio"] == pytest.approx(5.0, abs=1e-6)  # pi_old is this forward: ratio 1
    assert stats["tis_weight"] == pytest.approx(float(expected.sum()), rel=1e-5)

    # per token: the gradient is that of -sum(w * A * tis * logp)
    got = _grads(model)
    model.zero_grad()
    logp, _ = microbatch_logprobs(model, mb, 1.0)
    (-(mb.weights * mb.advantages * expected * logp).sum()).backward()
    assert torch.allclose(got, _grads(model), atol=1e-7, rtol=1e-5)


# -- dual-clip -----------------------------------------------------------------------------------------


def test_dual_clip_caps_negative_advantage_loss():
    ratios = torch.tensor([5.0, 2.0, 5.0, 0.5])
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    old = torch.full((4,), math.log(0.1))
    w = torch.full((4,), 0.25)

    def run(c):
        logp = (old + torch.log(ratios)).requires_grad_()
        loss, stats = policy_loss(logp, old, adv, w, LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=c))
        loss.backward()
        return loss.item(), stats, logp.grad.tolist()

    # token 0: r=5, A=-1: max(5, 1.28) = 5 -> capped at c*|A| = 3, no gradient
    # token 1: r=2, A=-1: 2 < 3, unchanged; token 2: A>0, clipped at 1.28; token 3: r=0.5 < 0.8, A=-2: 1.6
    loss, stats, grad = run(3.0)
    assert loss == pytest.approx((3.0 + 2.0 - 1.28 + 1.6) / 4, abs=1e-6)
    assert grad == pytest.approx([0.0, 2.0 / 4, 0.0, 0.0], abs=1e-6)
    assert stats["clipped"] == 3
    loss, stats, grad = run(0.0)  # off: the unbounded -r A of today
    assert loss == pytest.approx((5.0 + 2.0 - 1.28 + 1.6) / 4, abs=1e-6)
    assert grad == pytest.approx([5.0 / 4, 2.0 / 4, 0.0, 0.0], abs=1e-6)
    assert LossConfig().dual_clip == 3.0


def test_dual_clip_setting():
    assert TrainConfig().dual_clip == 3.0
    assert TrainConfig.from_overrides({"dual_clip": "0"}).dual_clip == 0.0
    with pytest.raises(ConfigError, match="dual_clip"):
        TrainConfig.from_overrides({"dual_clip": "0.5"})


# -- seq_mean per trajectory: per_request and prefix_merging optimize the same objective ------------


def _session(turns: int, seed: int) -> list[CallTokens]:
    """An agent session: each call's prompt = the previous prompt + its completion + a tool result."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, 250, (n,), generator=g).tolist()  # noqa: E731
    calls, prompt = [], ids(5)
    for k in range(turns):
        comp = ids(2 + k)
        calls.append(CallTokens(event_id=f"e{seed}-{k}", call_index=k, prompt_ids=list(prompt), delta=None,
                                completion_ids=comp, logprobs=[-5.5] * len(comp)))
        prompt = prompt + comp + ids(3)
    return calls


def _group(builder: str) -> TrainingGroup:
    sessions = [_session(3, 1), _session(1, 2), _session(2, 3)]  # 3, 1 and 2 traces per_request
    trajs = [Trajectory(event_id=f"t{i}", session_id=f"s{i}", group_id="g", sample_index=i, builder=builder,
                        traces=assemble(calls, builder).traces) for i, calls in enumerate(sessions)]
    return TrainingGroup(group_id="g", trajectories=trajs, advantages=[0.7, -0.3, -0.4])


def _per_trajectory_logprobs(model, samples):
    out: dict[str, tuple[list[int], list[float]]] = {}
    for s in samples:
        with torch.no_grad():
            lp, _ = microbatch_logprobs(model, pack([s], 1024)[0], 1.0)
        targets, logps = out.setdefault(s.trajectory_id.split("/")[-1], ([], []))
        targets += [s.targets[p] for p in s.trained]
        logps += lp.tolist()
    return out


def _objective(model, samples, loss_norm):
    model.zero_grad()
    stats = accumulate_gradients(model, pack(assign_weights(samples, loss_norm), 1024), LossConfig())
    return stats["loss"], _grads(model)


def test_per_request_and_prefix_merging_train_the_same_objective(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    merged, _ = samples_from_group(_group("prefix_merging"), 1024)
    per_req, _ = samples_from_group(_group("per_request"), 1024)
    assert (len(merged), len(per_req)) == (3, 6)

    for norm in ("token_mean", "seq_mean"):
        loss_a, grad_a = _objective(model, merged, norm)
        loss_b, grad_b = _objective(model, per_req, norm)
        assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7), norm
        assert torch.allclose(grad_a, grad_b, atol=1e-7, rtol=1e-4), norm

    a, b = _per_trajectory_logprobs(model, merged), _per_trajectory_logprobs(model, per_req)
    assert a.keys() == b.keys() == {"t0", "t1", "t2"}
    for k in a:
        assert a[k][0] == b[k][0]  # the same sampled tokens, in the same order
        assert torch.allclose(torch.tensor(a[k][1]), torch.tensor(b[k][1]), atol=1e-5)


def test_seq_mean_weights_each_trajectory_equally():
    per_req, _ = samples_from_group(_group("per_request"), 1024)
    weighted = assign_weights(per_req, "seq_mean")
    by_traj: dict[str, float] = {}
    for s in weighted:
        by_traj[s.trajectory_id] = by_traj.get(s.trajectory_id, 0.0) + s.weight * len(s.trained)
    assert len(by_traj) == 3 and all(v == pytest.approx(1 / 3) for v in by_traj.values())


def test_a_group_sent_in_parts_trains_the_same_weights():
    """Split into group parts, with a member split into trajectory parts (schemas/parts.py), the step
    that takes all the parts gives every token the weight the whole group's step gives it."""
    from schemas import encode, split_record

    whole = _group("per_request")
    one_trace = max(len(encode(t.model_copy(update={"traces": [tr]}))) for t in whole.trajectories for tr in t.traces)
    parts = [p for p, _ in split_record(whole, one_trace + 700)]  # room for about one trace a part
    assert len(parts) > 1 and any(t.parts > 1 for p in parts for t in p.trajectories)
    for norm in ("token_mean", "seq_mean"):
        want = assign_weights(samples_from_group(whole, 1024)[0], norm)
        got = assign_weights([s for p in parts for s in samples_from_group(p, 1024)[0]], norm)
        assert [(s.targets, s.advantage) for s in got] == [(s.targets, s.advantage) for s in want]
        assert [s.weight for s in got] == pytest.approx([s.weight for s in want]), norm
