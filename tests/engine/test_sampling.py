"""Pure sampling functions: truncation, temperature, draws, top-logprob order."""

import math

import torch

from engine.sampling import draw, perturb, process, top_logprobs, truncate


def test_top_k_keeps_exactly_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = truncate(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0  # kept values unchanged


def test_top_p_keeps_the_token_that_crosses_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = torch.isfinite(truncate(logits, torch.tensor([0]), torch.tensor([0.7]))).tolist()[0]
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 crosses it
    kept = torch.isfinite(truncate(logits, torch.tensor([0]), torch.tensor([0.5]))).tolist()[0]
    assert kept == [True, False, False, False]


def test_rows_are_truncated_independently_and_off_means_off():
    logits = torch.randn(3, 50)
    out = truncate(logits, torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert int(torch.isfinite(out[1]).sum()) == 5
    p = logits[2].softmax(-1)
    kept = torch.isfinite(out[2])
    assert p[kept].sum() >= 0.5 and p[kept].sum() - p[kept].min() < 0.5


def test_greedy_rows_use_temperature_one():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    out = process(logits, torch.tensor([0.0, 0.5]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert torch.allclose(out[0], logits[0]) and torch.allclose(out[1], logits[1] / 0.5)


def test_draw_is_argmax_for_greedy_and_reproducible_per_seed():
    torch.manual_seed(0)
    logits = torch.randn(1, 100).expand(4, 100).contiguous()
    greedy = torch.tensor([True, False, False, False])
    gens = [None] + [torch.Generator().manual_seed(7) for _ in range(3)]
    a = draw(logits, greedy, gens, torch.Generator().manual_seed(1))
    assert a[0] == logits[0].argmax()
    assert a[1] == a[2] == a[3]  # same seed, same row values: same draw
    gens2 = [None] + [torch.Generator().manual_seed(7) for _ in range(3)]
    assert torch.equal(draw(logits, greedy, gens2, torch.Generator().manual_seed(2)), a)


def test_draw_matches_the_categorical_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3).contiguous()
    g = torch.Generator().manual_seed(0)
    tokens = draw(logits, torch.zeros(20000, dtype=torch.bool), [None] * 20000, g)
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_top_logprobs_engine_order_and_dedup():
    lp = torch.tensor([[-0.1, -3.0, -2.0, -5.0]]).log_softmax(-1)
    # chosen is the argmax: it appears once, then the next best
    rows = top_logprobs(lp, torch.tensor([0]), [2])
    assert [t for t, _ in rows[0]] == [0, 2]
    # chosen is not among the best: chosen first, then the top k
    rows = top_logprobs(lp, torch.tensor([3]), [2])
    assert [t for t, _ in rows[0]] == [3, 0, 2]
    assert math.isclose(rows[0][0][1], float(lp[0, 3]))
    assert top_logprobs(lp, torch.tensor([1]), [0]) == [[(1, float(lp[0, 1]))]]


def test_perturb_adds_seeded_gaussian_noise_and_sigma_0_is_off():
    logits = torch.zeros(4, 5000)
    assert perturb(logits, 0.0) is logits
    a = perturb(logits, 0.5, torch.Generator().manual_seed(1))
    b = perturb(logits, 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert abs(float(a.std()) - 0.5) < 0.01 and abs(float(a.mean())) < 0.01
