"""Packing: shifting, bin packing, weights, sharding, and packed == unpacked logprobs."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.plugins.trainer import make_group
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
    with pytest.raises(ValueError, match="exceed the token budget"):
        first_fit_decreasing([65], 64)


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


def _one_at_a_time(model, s):
    logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return torch.stack([lp[p, s.targets[p]] for p in s.trained])


@pytest.mark.parametrize("mode", ["packed", "packed_rows", "padded"])
def test_packed_logprobs_equal_unpacked(trainer_model_dir, mode):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa").eval()
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
