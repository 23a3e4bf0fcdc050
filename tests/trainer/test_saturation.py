"""The learning rate falls as a step's reward saturates, and the trainer's health warnings (issue 48)."""

import pytest

from polarstream.driver.report import worst_fall
from trainer.metrics import health_warnings
from trainer.optim import saturation_scale


def test_full_rate_up_to_the_knee_then_linear_to_the_floor():
    assert saturation_scale(0.0, 0.5, 0.05) == 1.0
    assert saturation_scale(0.5, 0.5, 0.05) == 1.0
    assert saturation_scale(0.75, 0.5, 0.05) == pytest.approx(0.5)
    assert saturation_scale(0.9375, 0.5, 0.05) == pytest.approx(0.125)  # seed 2's collapsing step: lr / 8
    assert saturation_scale(1.0, 0.5, 0.05) == 0.05
    assert saturation_scale(1.7, 0.5, 0.05) == 0.05  # out-of-range rewards are clamped, never a negative rate
    assert saturation_scale(0.99, 1.0, 0.05) == 1.0  # knee 1: off


def test_warnings_name_a_low_entropy_and_a_fall_within_two_steps():
    assert health_warnings([0.5, 0.6], 0.05, 0.01, 2) == []
    (low,) = health_warnings([0.9], 0.004, 0.01, 9)
    assert "entropy 0.0040 is below the floor 0.01" in low and low.startswith("step 9:")
    (fall,) = health_warnings([0.94, 0.91, 0.62], 0.03, 0.01, 18)  # fell 0.32 from the best of the two before
    assert "fell from 0.940 to 0.620" in fall
    assert health_warnings([0.94, 0.91, 0.65], 0.03, 0.01, 18) == []  # 0.29: within the rule
    assert health_warnings([0.9, 0.1], 0.0, 0.01, 2)[0].startswith("step 2: mean reward fell")  # no entropy: no entropy warning


def test_worst_fall_counts_from_the_first_2_step_mean_at_0_8():
    assert worst_fall([0.2, 0.5, 0.7]) is None  # never reached 0.8
    # issue 48's seed 2: 2-step means peak at 0.985, then fall to 0.39 (steps 19-20)
    rewards = [0.19, 0.28, 0.44, 0.41, 0.66, 0.53, 0.47, 0.56, 0.72, 0.91, 0.97, 1.00, 0.97, 1.00, 0.97, 0.84, 0.91,
               0.62, 0.25, 0.53, 0.50, 0.75, 0.88, 1.00]
    assert worst_fall(rewards) == pytest.approx(0.985 - 0.39)
    assert worst_fall([0.3, 0.9, 0.9, 0.1]) == pytest.approx(0.4)  # a drop before 0.8 was reached does not count
    assert worst_fall([0.1, 0.9, 0.1]) is None  # 2-step means 0.5, 0.5: never reached 0.8
