"""bench/judge_agreement.py's arithmetic: agreement over what both judges scored, failures apart, Cohen's kappa."""

from __future__ import annotations

import pytest

from bench.judge_agreement import agreement, markdown, passes


def test_pass_is_a_score_above_zero():
    assert passes(5) and passes(1) and not passes(0) and not passes(-5)


def test_agreement_counts_only_what_both_scored_and_keeps_failures_apart():
    rows = [(5, 5, None), (5, -2, None), (-5, -5, None), (-5, 0, None), (-5, 3, None),
            (5, None, "unparseable"), (-5, None, "unparseable"), (-5, None, "refusal")]
    a = agreement(rows)
    assert a["confusion"] == {"rule_pass_model_pass": 1, "rule_pass_model_fail": 1, "rule_fail_model_pass": 1,
                              "rule_fail_model_fail": 2}  # a score of 0 fails
    assert (a["trajectories"], a["scored_by_both"], a["agreed"]) == (8, 5, 3)
    assert a["agreement"] == pytest.approx(3 / 5)
    assert a["model_failures"] == {"refusal": 1, "unparseable": 2} and a["model_failure_count"] == 3
    assert a["model_failures_by_rule"] == {"rule_pass": 1, "rule_fail": 2}
    # chance: A passes 2/5, B passes 2/5 -> 0.4 * 0.4 + 0.6 * 0.6 = 0.52; kappa = (0.6 - 0.52) / 0.48
    assert a["kappa"] == pytest.approx((0.6 - 0.52) / 0.48)


def test_a_judge_that_always_says_pass_agrees_by_chance_only():
    a = agreement([(5, 5, None)] * 5 + [(-5, 5, None)] * 5)
    assert a["agreement"] == 0.5 and a["kappa"] == pytest.approx(0.0)


def test_nothing_scored_gives_no_rate_not_zero():
    a = agreement([(5, None, "unparseable"), (-5, None, "timeout")])
    assert a["agreement"] is None and a["kappa"] is None and a["scored_by_both"] == 0
    assert agreement([(5, 5, None), (5, 4, None)])["kappa"] is None  # both always pass: no chance to beat


def test_the_page_shows_the_confusion_and_the_failures():
    rows = [(5, 5, None), (-5, 5, None), (-5, None, "unparseable")]
    result = {"agreement": agreement(rows), "right_answers": 1, "rule_vs_outcome_agreement": 1.0, "threads": 1,
              "judge": {"smollm2_concurrency": 16}, "rule": {"wall_s": 0.1},
              "smollm2": {"scores": {"5": 2}, "wall_s": 30.0, "per_trajectory_s": 10.0},
              "rows": [{"failure": None, "detail": ""}, {"failure": None, "detail": ""},
                       {"failure": "unparseable", "detail": "7 + 8 = | `15`"}]}
    page = markdown(result, "summary")
    assert "| SmolLM2: pass | 1 | 1 |" in page and "| SmolLM2: no verdict | 0 | 1 |" in page
    assert "Agreement **50%**" in page and "unparseable 1" in page and "7 + 8 = / '15'" in page
    with pytest.raises(ValueError):
        markdown(result, "table")
