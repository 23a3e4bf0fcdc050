"""The rollout-vs-trainer divergence the trainer reports (issue 65), on the in-process loop: about 0 when the
sampler and the trainer are the same policy (S = 0), and growing with the sampler's logit noise (the engine's
--logit-noise). One step each on the base tiny model (its rewards are all 0: the step has no signal, but
runs forward and backward and reports its mismatch like any other)."""

from __future__ import annotations

import torch

from gateway.harnesses.builtin import SYSTEM, TOOLS
from polarstream.demo.learning import LearningConfig, rl_run
from tests.demo import collapse


def test_mismatch_is_zero_on_policy_and_grows_with_the_samplers_noise(tiny_model_dir):
    torch.set_num_threads(1)
    got = {}
    for sigma in (0.0, 0.3, 1.0, 3.0):
        cfg = LearningConfig(steps=1, tasks_per_step=2, samples=4, max_new_tokens=24, seed=0, logit_noise=sigma)
        log, _ = rl_run(tiny_model_dir, collapse.problems()[:4], cfg, system=SYSTEM, tools=TOOLS)
        got[sigma] = log.steps[0].mismatch
    print({s: {k: round(v, 6) for k, v in m.items() if k.startswith("mismatch")} for s, m in got.items()})
    assert got[0.0]["mismatch_k3"] <= 1e-4 and abs(got[0.0]["mismatch_ratio_max"] - 1) <= 1e-3
    k3 = [got[s]["mismatch_k3"] for s in (0.0, 0.3, 1.0, 3.0)]
    p99 = [got[s]["mismatch_ratio_p99"] for s in (0.0, 0.3, 1.0, 3.0)]
    assert all(a < b for a, b in zip(k3, k3[1:])), k3
    assert all(a < b for a, b in zip(p99, p99[1:])), p99
