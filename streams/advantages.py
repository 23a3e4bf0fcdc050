"""Group-relative advantages (GRPO and friends), as pure functions of a group's rewards.

Only usable members enter here: a failed or infrastructure-masked sample is left out of the baseline
by the caller, so it cannot drag its group's mean. The std is the population std of the usable
rewards (ddof=0), shared by the whole group; with ``leave_one_out`` each member's baseline is the mean
of the *other* members (Polar's choice), still divided by that one group std.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Advantages:
    values: list[float]
    mean: float
    std: float
    zero_variance: bool


def group_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """(mean, population std) of the rewards."""
    n = len(rewards)
    if n == 0:
        raise ValueError("rewards: a group needs at least one usable member")
    mean = math.fsum(rewards) / n
    var = math.fsum((r - mean) ** 2 for r in rewards) / n
    return mean, math.sqrt(var)


def compute_advantages(
    rewards: Sequence[float],
    baseline: Literal["mean", "leave_one_out"] = "mean",
    std_normalized: bool = True,
    epsilon: float = 1e-6,
) -> Advantages:
    """Advantage per reward: (r - baseline) [/ (group std + epsilon)].

    A group whose rewards are all equal carries no learning signal: every advantage is exactly 0 and
    ``zero_variance`` is set, so the caller can flag or drop it.
    """
    mean, std = group_stats(rewards)
    n = len(rewards)
    zero_variance = all(r == rewards[0] for r in rewards)
    if zero_variance:
        return Advantages([0.0] * n, mean, std, True)
    total = math.fsum(rewards)
    if baseline == "mean":
        centred = [r - mean for r in rewards]
    elif baseline == "leave_one_out":
        centred = [r - (total - r) / (n - 1) for r in rewards]  # n >= 2 here: one reward has zero variance
    else:
        raise ValueError(f"baseline: unknown {baseline!r}; expected mean or leave_one_out")
    scale = std + epsilon if std_normalized else 1.0
    return Advantages([c / scale for c in centred], mean, std, False)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to the reward of a
    response of ``length`` sampled tokens, with L_max = ``max_tokens`` and L_cache = ``buffer``:

        0                                       |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache     L_max - L_cache < |y| <= L_max
        -1                                      L_max < |y|

    times ``penalty`` (DAPO: 1). ``max_tokens`` 0 turns it off. A response in the last ``buffer`` tokens of
    the budget loses reward linearly instead of all at once at the cut."""
    if max_tokens <= 0:
        return 0.0
    if buffer <= 0 or not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong buffer: {buffer} must be in (0, max_tokens={max_tokens}]")
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return penalty * ((max_tokens - buffer) - length) / buffer
    return -penalty
