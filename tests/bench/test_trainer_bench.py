"""bench/trainer.py's workload: the sessions have the promised shapes and the work counters agree.

Runs in seconds: one group at the benchmark's default shape scale, no model.
"""

from __future__ import annotations

import pytest

from bench import trainer as bt


@pytest.fixture(scope="module")
def shapes():
    return bt.group_shapes(2)


@pytest.fixture(scope="module")
def groups(shapes):
    return bt.build_groups(shapes[:1], bt.SCALE, 8192)


def test_full_scale_shapes_are_harness_sized(shapes):
    for g in shapes:
        assert g.system == 12_000 and 100 <= g.task <= 400
        assert len(g.samples) == bt.GROUP_SIZE == 8
        for turns in g.samples:
            assert 24 <= len(turns) <= 40
            assert all(30 <= s <= 300 and 200 <= t <= 2_000 for s, t in turns)
    assert bt.group_shapes(2) == shapes  # deterministic


def test_sessions_at_scale_share_the_group_prefix_and_chain_token_exactly(shapes):
    k = bt.SCALE
    shape = shapes[0]
    sessions = bt.make_sessions(shape, k, 8192, seed=1)
    prefix = bt.scaled(shape.system, k) + bt.scaled(shape.task, k)
    first = sessions[0][0].prompt_ids
    assert len(first) == prefix
    for calls, turns in zip(sessions, shape.samples, strict=True):
        assert len(calls) == len(turns)  # turn counts are not scaled
        assert calls[0].prompt_ids == first  # system prompt, tools and task identical across the group
        for c, (sampled, _) in zip(calls, turns):
            assert len(c.completion_ids) == bt.scaled(sampled, k)
        for a, b, (_, tool) in zip(calls, calls[1:], turns):
            assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
            assert len(b.prompt_ids) == len(a.prompt_ids) + len(a.completion_ids) + bt.scaled(tool, k)


def test_work_counters_order_and_agree(shapes, groups):
    w = {}
    for mode in bt.MODES:
        samples, cut = bt.step_samples(groups["per_request" if mode == "per_request" else "prefix_merging"])
        assert cut == 0  # traces are trained whole
        w[mode] = bt.work(bt.build_micro(mode, samples, bt.BUDGET // bt.SCALE))
    pr, pm, sh, pad = (w[m] for m in bt.MODES)
    assert pr["tokens_fed"] > pm["tokens_fed"] > sh["tokens_fed"]
    assert pr["attention_pairs"] > pm["attention_pairs"] > sh["attention_pairs"]
    assert pad["tokens_fed"] >= pm["tokens_fed"] == pm["real_tokens"] == pad["real_tokens"]
    trained = {x["trained_tokens"] for x in w.values()}
    assert len(trained) == 1  # the same sampled tokens in every mode
    assert all(x["logit_rows"] == x["trained_tokens"] for x in w.values())  # logits only where trained
    assert pr["sequences"] == sum(len(t) for t in shapes[0].samples)  # one trace per call
    assert pm["sequences"] == bt.GROUP_SIZE
    # the whole group fits one micro-batch, so sharing saves exactly what the prefix bound says
    bound = bt.prefix_bound(groups["prefix_merging"])
    assert bound["token_bound"] == round(pm["tokens_fed"] / sh["tokens_fed"], 3)
    P, B, n = bound["prefix_tokens_mean"], bound["branch_tokens_mean"], bound["samples_per_group"]
    assert bound["token_bound_formula"] == pytest.approx(n * (P + B) / (P + n * B), abs=1e-3)
    assert bound["attention_pairs_bound"] == pytest.approx(pm["attention_pairs"] / sh["attention_pairs"], abs=1e-3)


def test_ratios_and_flops():
    class Cfg:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim = 128, 4, 2, 32
        num_hidden_layers, intermediate_size, vocab_size = 2, 384, 8192

    w = {"tokens_fed": 10, "attention_pairs": 55, "logit_rows": 3}
    f = bt.model_flops(Cfg, w)
    assert f["total"] == f["linear"] + f["attention"] + f["lm_head"] and f["lm_head"] == 3 * 2 * 128 * 8192 * 3
    work = {"per_request": {"tokens_fed": 100, "attention_pairs": 400, "logit_rows": 5, "model_flops": 90, "trained_tokens": 5},
            "prefix_merging": {"tokens_fed": 10, "attention_pairs": 40, "logit_rows": 5, "model_flops": 9, "trained_tokens": 5}}
    r = bt.ratios(work)
    assert r["merged_vs_per_request"] == {"tokens_fed_ratio": 10.0, "attention_pairs_ratio": 10.0, "logit_rows_ratio": 1.0,
                                          "model_flops_ratio": 10.0, "same_trained_tokens": True}
    assert r["shared_vs_merged"]["tokens_fed_ratio"] is None  # a mode that did not run gives no ratio
