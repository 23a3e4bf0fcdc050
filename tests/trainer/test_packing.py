"""Packing: shifting, bin packing, weights, sharding, and packed == unpacked logprobs."""

import random

import pytest
import torch

from tests.plugins.trainer import make_group
from trainer.attention import load_model
from trainer.loss import microbatch_logprobs
from trainer.packing import (
    Sample, assign_weights, first_fit_decreasing, pack, pad_by_length, sample_from_trace, samples_from_group, shard,
)


def test_sample_shifts_and_drops_tokens_after_the_last_sampled_one():
    s = sample_from_trace([10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 0], [0, 0, -0.5, -0.7, 0, 0], 2.0, max_len=100)
    assert s.input_ids == (10, 11, 12)  # 14, 15 predict nothing; 13 is only a target
    assert s.targets == (11, 12, 13)
    assert s.trained == (1, 2) and s.rollout_logprobs == (-0.5, -0.7) and s.advantage == 2.0


def test_sample_truncated_to_max_len_keeps_its_prefix():
    s = sample_from_trace(list(range(10)), [0, 0] + [1] * 8, [0.0] * 10, 1.0, max_len=4)
    assert s.input_ids == (0, 1, 2, 3) and s.trained == (1, 2, 3)
    assert sample_from_trace([1, 2], [0, 0], [0, 0], 1.0, 10) is None  # nothing sampled
    assert sample_from_trace(list(range(10)), [0, 0] + [1] * 8, [0.0] * 10, 1.0, max_len=0).length == 9  # 0: no cut


def test_group_gives_each_trace_its_trajectory_advantage():
    g = make_group("g", [[5, 6], [7, 8, 9]], [1.0, 0.0])
    samples, cut = samples_from_group(g, max_len=100)
    assert [s.advantage for s in samples] == [0.5, -0.5] and cut == 0
    _, cut = samples_from_group(g, max_len=4)  # 4 inputs predict only the first completion token
    assert cut == 1 + 2


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_respects_budget_and_uses_every_sample_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 2 * sum(lengths) / 64 + 1  # FFD never wastes more than half a bin on average
    assert first_fit_decreasing([10, 65, 60], 64) == [[1], [2], [0]]  # too long for the budget: a bin of its own


def test_weights_give_token_and_sequence_means():
    samples = [sample_from_trace([1] * 5, [0, 1, 1, 1, 1], [0.0] * 5, 1.0, 100),
               sample_from_trace([1] * 3, [0, 0, 1], [0.0] * 3, 1.0, 100)]
    tok = assign_weights(samples, "token_mean")
    assert [s.weight for s in tok] == pytest.approx([1 / 5, 1 / 5])
    seq = assign_weights(samples, "seq_mean")
    assert [s.weight for s in seq] == pytest.approx([1 / 8, 1 / 2])
    assert sum(s.weight * len(s.trained) for s in seq) == pytest.approx(1.0)


def test_shard_balances_and_pads_with_empty_microbatches():
    samples = assign_weights([sample_from_trace([1] * n, [0] + [1] * (n - 1), [0.0] * n, 1.0, 100)
                              for n in (30, 20, 10, 9, 5)], "token_mean")
    mbs = pack(samples, 32)
    shards = [shard(mbs, 2, r) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    real = [mb for s in shards for mb in s if mb.num_sequences]
    assert sum(mb.num_sequences for mb in real) == 5 and len(real) == len(mbs)


def _random_samples(vocab, n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(3, 40)
        mask = [0] * rng.randint(1, L - 1)
        mask += [1] * (L - len(mask))
        if rng.random() < 0.5:  # an interstitial in the middle, like a prefix-merged trace
            mid = len(mask) + (L - len(mask)) // 2
            mask = [m if i < mid or i > mid + 2 else 0 for i, m in enumerate(mask)]
            mask[-1] = 1
        out.append(sample_from_trace([rng.randrange(vocab) for _ in range(L)], mask, [-1.0] * L, 1.0, 100))
    return assign_weights([s for s in out if s], "token_mean")


def _one_at_a_time(model, s, temperature=1.0):
    logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return torch.stack([lp[p, s.targets[p]] for p in s.trained])


@pytest.mark.parametrize("attn", ["polar_varlen", "sdpa"])
@pytest.mark.parametrize("mode", ["packed", "packed_rows", "padded"])
def test_packed_logprobs_equal_unpacked(trainer_model_dir, mode, attn):
    model = load_model(trainer_model_dir, attn=attn).eval()
    samples = _random_samples(model.config.vocab_size, 12, seed=1)
    mbs = {"packed": lambda: pack(samples, 96), "packed_rows": lambda: pack(samples, 96, row_len=40),
           "padded": lambda: pad_by_length(samples, 96)}[mode]()
    assert len(mbs) < len(samples)  # several sequences share each micro-batch
    if mode == "packed_rows":  # several rows, several sequences in a row, padding at row ends
        assert any(mb.input_ids.shape[0] > 1 for mb in mbs)
        assert any(mb.num_sequences > mb.input_ids.shape[0] for mb in mbs)
        assert any(mb.num_tokens > mb.num_real_tokens for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.members) == list(range(len(samples)))
    with torch.no_grad():
        for mb in mbs:
            got, _ = microbatch_logprobs(model, mb, 1.0)
            ref = torch.cat([_one_at_a_time(model, samples[i]) for i in mb.members])
            assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    if mode == "packed":
        assert sum(mb.num_tokens for mb in mbs) == sum(s.length for s in samples)  # zero padding


def test_long_sample_gets_a_microbatch_of_its_own():
    samples = [sample_from_trace([1] * n, [0] + [1] * (n - 1), [0.0] * n, 1.0, 0) for n in (50, 10, 8)]
    mbs = pack(samples, 32)
    assert sorted(mb.num_tokens for mb in mbs) == [16, 49]  # 49 > 32 inputs: trained whole, alone
    assert [mb.attention_pairs for mb in mbs] == [49 * 50 // 2, 9 * 10 // 2 + 7 * 8 // 2]  # per sequence
    assert [mb.logit_rows for mb in mbs] == [49, 16]  # one per trained token


def _group_samples(vocab, seed, prefix_len=70, groups=2, per_group=3):
    """Groups whose samples share a ``prefix_len``-token prompt, with an interstitial in the branches."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        for _ in range(per_group):
            ids = prefix + [rng.randrange(vocab) for _ in range(rng.randint(4, 30))]
            mask = [0] * (prefix_len - 5) + [1] * (len(ids) - prefix_len + 5)  # trained from inside the prefix
            mask[prefix_len + 2] = 0
            out.append(sample_from_trace(ids, mask, [-1.0] * len(ids), 1.0 - g, 0, group_id=f"g{g}"))
    return assign_weights(out, "token_mean")


def _grads(model, fn):
    model.zero_grad()
    fn().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("share_prefix", [False, True])
def test_packed_gradients_equal_one_at_a_time(trainer_model_dir, share_prefix):
    """fp32: packed (and shared-prefix) logprobs and gradients equal one sequence at a time within 1e-5."""
    model = load_model(trainer_model_dir).eval()
    samples = _group_samples(model.config.vocab_size, seed=2) + _random_samples(model.config.vocab_size, 4, seed=3)
    mbs = pack(samples, 200, share_prefix=share_prefix)
    if share_prefix:  # each group's prompt is fed once: fewer tokens and attention pairs than unshared
        plain = pack(samples, 200)
        assert any(mb.layout.shares_prefix for mb in mbs)
        assert sum(mb.num_tokens for mb in mbs) == sum(mb.num_tokens for mb in plain) - 2 * 2 * 70
        assert sum(mb.attention_pairs for mb in mbs) < sum(mb.attention_pairs for mb in plain)
    assert sorted(i for mb in mbs for i in mb.members) == list(range(len(samples)))
    weights = [torch.tensor(s.weight) * torch.linspace(1, 2, len(s.trained)) for s in samples]

    def packed():
        total = 0
        for mb in mbs:
            lp, _ = microbatch_logprobs(model, mb, 0.7)
            total = total + (torch.cat([weights[i] for i in mb.members]) * lp).sum()
        return total

    def one_at_a_time():
        return sum((w * _one_at_a_time(model, s, 0.7)).sum() for w, s in zip(weights, samples))

    with torch.no_grad():
        for mb in mbs:
            got, _ = microbatch_logprobs(model, mb, 0.7)
            ref = torch.cat([_one_at_a_time(model, samples[i], 0.7) for i in mb.members])
            assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    a, b = _grads(model, packed), _grads(model, one_at_a_time)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_activation_checkpointing_gives_the_same_gradients(trainer_model_dir):
    samples = _group_samples(256, seed=6)
    mbs = pack(samples, 400, share_prefix=True)
    grads = []
    for ckpt in (False, True):
        model = load_model(trainer_model_dir, activation_checkpointing=ckpt).train()
        grads.append(_grads(model, lambda: sum(microbatch_logprobs(model, mb, 1.0)[0].sum() for mb in mbs)))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_cut_traces_are_counted_and_logged_as_a_warning_naming_the_group(caplog):
    from trainer.config import TrainConfig
    from trainer.selection import Chosen, StepPlan
    from trainer.train import _samples

    class Log(list):
        write = list.append

    g = make_group("g-long", [[5] * 20, [6] * 3], [1.0, 0.0])  # 4 prompt tokens + 20 / 3 sampled
    plan = StepPlan(chosen=[Chosen(group=g, staleness=0, weight=1.0)])
    samples, cut = _samples(plan, TrainConfig(token_budget=8), Log())
    assert cut == 0 and max(s.length for s in samples) == 23  # longer than the budget: trained whole
    log = Log()
    with caplog.at_level("WARNING"):
        samples, cut = _samples(plan, TrainConfig(token_budget=8, max_trace_tokens=10), log)
    assert cut == 20 - 7 and "g-long" in caplog.text
    assert log == [{"event": "warning", "warning": "trace_cut", "group_id": "g-long", "event_id": g.event_id,
                    "cut_tokens": 13, "max_trace_tokens": 10}]
