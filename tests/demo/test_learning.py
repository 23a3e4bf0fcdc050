"""The demo's task is learnable, deterministically: a short RL run with the trainer's own step code.

The run is in one process (``polarstream.demo.learning``): seeded sampling, a fixed number of torch threads,
no Kafka, so it gives the same curve run after run. It fails when learning breaks: a loss sign error,
advantages that do not reach the loss, a warm start that leaves no signal, or an optimizer that moves
the weights on a step without signal (rare in these runs; tests/trainer/test_optim.py and
test_train_no_signal.py make such steps on purpose).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.harnesses.builtin import SYSTEM, TOOLS
from polarstream.demo.arith import reward
from polarstream.demo.learning import LearningConfig, rl_run
from tests.demo import collapse

pytestmark = pytest.mark.slow
# A fixed thread count keeps the run reproducible; two (the CI machine's cores) take ~60% of one's time.
THREADS = 2


def test_reward_is_the_demo_evaluators_rule():
    call = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "8"}}\n</tool_call>'
    assert reward(call, "8") == 1.0
    assert reward(call.replace("answer.txt", "./answer.txt"), "8") == 1.0
    assert reward(call, "9") == 0.0  # wrong number
    assert reward(call.replace("answer.txt", "other.txt"), "8") == 0.0  # wrong file
    assert reward("The answer is 8.", "8") == 0.0  # prose never writes the file
    assert reward(call.replace("</tool_call>", ""), "8") == 0.0  # a truncated call runs nothing


# A few train problems, so that a warm start short enough for CI knows their sums well; the behaviour
# RL must teach (finish with the tool call, with the right number in it) is the demo's.
PROBLEMS = collapse.problems()


# For the no-collapse rule the run must get past 0.8: the tool path shown half the time (still never which
# path is rewarded) starts RL at ~0.3 instead of ~0.06.
WARM_HALF_TOOL = dict(steps=80, batch_size=8, drills=32, p_tool=0.5, seed=0)


def _warm(settings: dict) -> Path:
    """The warm start, built once per machine and shared by the suite's workers (``build_once``: the others
    wait for the first instead of building it again on the same cores): cached under the cache dir by its
    settings and the code that makes it (polarstream/demo/warmstart.py and the tiny model's build), as the
    demo caches its own; ~1-3 minutes of a busy 2-core machine otherwise, in every suite."""
    import hashlib
    import json

    import polarstream.demo.warmstart
    from infra.models import build_once, ensure_model
    from infra.settings import CACHE_DIR
    from polarstream.demo.warmstart import warm_start

    base = ensure_model("tiny")
    source = Path(polarstream.demo.warmstart.__file__).read_bytes()
    key = hashlib.sha256(repr((sorted(settings.items()), PROBLEMS, SYSTEM, TOOLS, base.name, THREADS)).encode() + source).hexdigest()[:12]

    def build(out: Path) -> None:
        caller = torch.get_num_threads()  # the caller's runs keep theirs, whichever worker builds this
        torch.set_num_threads(THREADS)
        try:
            # The demo's rule: the tool path is shown now and then, and never which path is rewarded.
            warm_start(base, out, PROBLEMS, system=SYSTEM, tools=TOOLS, progress=False, **settings)
        finally:
            torch.set_num_threads(caller)
        (out / "polarstream.json").write_text(json.dumps({"warm_start": settings}))  # build_once's mark

    return build_once(CACHE_DIR / "models" / f"test-learning-warm-{key}", build)


@pytest.mark.timeout(900)  # a 20-step run: ~25 s alone, a few minutes beside three busy workers
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_learning_stays_learned(seed):
    """Issue 48's rule, in process: once a run's 2-step mean reward reaches 0.8, it never falls more than 0.3
    below its best. Every step trains on all the problems (``all_problems``), so a step's reward measures
    the policy, not which problems it drew (drawing 4 of the demo's 65 problems a step, one in-process run fell
    0.39 across steps that made no update at all). The rule must bite: seeds 0 and 1 get past 0.8 by step ~11
    (2 by step ~16). One seed per test, so the suite's workers share them. It guards the trainer's
    defaults (lr_saturation included) but does not reproduce issue 48's collapse: in 20 steps these runs end
    near 0.85, short of the saturated regime where the demo's collapse happened. Each run must also learn
    (its last 4 steps 0.2 above its first 4) and move the weights exactly on the steps with signal: what a
    separate 8-step run checked before, at ~50 s of a busy suite."""
    from polarstream.driver.report import worst_fall

    # One thread: the suite runs the three seeds at once beside other tests on 2 cores, where two threads
    # each (oversubscribed) took 144-274 s a seed against ~50 s alone.
    torch.set_num_threads(1)
    warm = _warm(WARM_HALF_TOOL)
    log, _ = rl_run(warm, PROBLEMS, LearningConfig(steps=20, samples=8, lr=1.2e-3, seed=seed, all_problems=True),
                    system=SYSTEM, tools=TOOLS)
    fall, rewards = worst_fall(log.rewards), [round(r, 2) for r in log.rewards]
    print(f"seed {seed}: worst fall after 0.8 {fall}; step rewards {rewards}")
    for s in log.steps:  # a step with signal moves the weights; one without leaves every weight bit-identical
        assert s.moved == s.signal, s
    assert sum(rewards[-4:]) / 4 >= sum(rewards[:4]) / 4 + 0.2, rewards  # it learned
    assert fall is not None or seed != 0, f"seed 0 never reached a 2-step mean of 0.8: {rewards}"
    assert fall is None or fall <= 0.3, (fall, rewards)


def test_the_recorded_collapse_does_not_happen_with_the_trainers_defaults():
    """Issue 48's rule on a recorded update: it may not take the pass rate down by more than 0.3. The
    recording (tests/demo/collapse.py) carries the model its groups were sampled from, so the replay
    starts where the recording did on any machine. At a constant rate (``lr_saturation=1``, the default
    before the fix) the recorded step, whose groups mostly pass and carry a few lone failures, takes the
    pass rate from about 0.73 to about 0.13; with the trainer's defaults it keeps it. The replay is run
    with one torch thread where the recording used two, so every run of this test sums in another order
    than the recording did: the outcome must hold to TOLERANCE, not to the bit."""
    from trainer.config import TrainConfig

    torch.set_num_threads(1)
    rec = collapse.load()
    constant = collapse.replay(rec, lr_saturation=1.0)
    defaults = collapse.replay(rec, lr_saturation=TrainConfig().lr_saturation)
    want = rec["expected"]
    print(f"pass rate before -> after the recorded step {rec['collapse_step']}: constant lr {constant} (recorded "
          f"{want['constant']}), trainer defaults {defaults} (recorded {want['defaults']})")
    # the collapse is in the data: without it this test proves nothing
    assert constant[0] - constant[1] > collapse.FALL, constant
    assert defaults[0] - defaults[1] <= collapse.FALL, defaults
    for got, rec_ in ((constant, want["constant"]), (defaults, want["defaults"])):
        assert all(abs(g - r) <= collapse.TOLERANCE for g, r in zip(got, rec_)), (got, rec_)


@pytest.mark.timeout(900)
def test_a_lora_adapter_learns_too():
    """Issue 64: the same run with a LoRA adapter (rank 16, alpha 32; trainer/lora.py) on the frozen warm start,
    at 2.5x the full-weight rate (8x collapsed to 0 by step 3): it learns (last 4 steps 0.2 above the first 4)
    and stays learned by issue 48's rule, and moves the adapter exactly on the steps with signal. Seed 0 went
    0.44 -> 0.84 over its first and last 4 steps (full weights: 0.48 -> 0.84)."""
    from polarstream.driver.report import worst_fall

    torch.set_num_threads(1)
    log, model = rl_run(_warm(WARM_HALF_TOOL), PROBLEMS, LearningConfig(steps=20, samples=8, lr=3e-3, seed=0,
                                                                         all_problems=True, lora_rank=16, lora_alpha=32),
                        system=SYSTEM, tools=TOOLS)
    from trainer.lora import adapter_params

    assert adapter_params(model) and not any(p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    fall, rewards = worst_fall(log.rewards), [round(r, 2) for r in log.rewards]
    print(f"lora seed 0: worst fall after 0.8 {fall}; step rewards {rewards}")
    for s in log.steps:
        assert s.moved == s.signal, s
    assert sum(rewards[-4:]) / 4 >= sum(rewards[:4]) / 4 + 0.2, rewards
    assert fall is not None and fall <= 0.3, (fall, rewards)
