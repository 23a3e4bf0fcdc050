"""The demo's task is learnable, deterministically: a short RL run with the trainer's own step code.

The run is in one process (``polarstream.learning``): seeded sampling, a fixed number of torch threads,
no Kafka, so it gives the same curve run after run. It fails when learning breaks: a loss sign error,
advantages that do not reach the loss, a warm start that leaves no signal, or an optimizer that moves
the weights on a step without signal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.harnesses.builtin import SYSTEM, TOOLS
from polarstream import demo_tasks
from polarstream.learning import RunConfig, pass_rate, reward, rl_run

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
PROBLEMS = demo_tasks.split(0)[0][::11]


WARM = dict(steps=80, batch_size=8, drills=32, p_tool=0.25, seed=0)


@pytest.fixture(scope="module")
def warm_model():
    """The warm start, built once per machine: cached under the cache dir by its settings and the code that
    makes it (polarstream/warmstart.py and the tiny model's build), as the demo caches its own; ~3 minutes
    of a busy 2-core machine otherwise, in every suite."""
    import hashlib
    import os
    import shutil

    import polarstream.warmstart
    from engine.models import ensure_model
    from infra.settings import CACHE_DIR
    from polarstream.warmstart import warm_start

    torch.set_num_threads(THREADS)
    base = ensure_model("tiny")
    source = Path(polarstream.warmstart.__file__).read_bytes()
    key = hashlib.sha256(repr((sorted(WARM.items()), PROBLEMS, SYSTEM, TOOLS, base.name, THREADS)).encode() + source).hexdigest()[:12]
    out = CACHE_DIR / "models" / f"test-learning-warm-{key}"
    if not (out / "config.json").exists():
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        # The demo's rule: the tool path is shown now and then, and never which path is rewarded.
        warm_start(base, tmp, PROBLEMS, system=SYSTEM, tools=TOOLS, progress=False, **WARM)
        try:
            tmp.rename(out)
        except OSError:  # another test process built it first: the same model
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def test_reward_rises_and_weights_move_only_on_steps_with_signal(warm_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    cfg = RunConfig(steps=8, tasks_per_step=3, samples=8, lr=8e-4, seed=0)
    log, model = rl_run(warm_model, PROBLEMS, cfg, system=SYSTEM, tools=TOOLS)

    for s in log.steps:  # a step without signal leaves every weight bit-identical; one with signal moves them
        assert s.moved == s.signal, s
    assert any(s.signal for s in log.steps)
    # Per-step rewards are 24 samples of whichever problems were drawn: the rise is measured on all of
    # them, 8 samples each, before and after.
    tok = AutoTokenizer.from_pretrained(warm_model)
    before = pass_rate(AutoModelForCausalLM.from_pretrained(warm_model), tok, PROBLEMS, 8, system=SYSTEM, tools=TOOLS)
    after = pass_rate(model, tok, PROBLEMS, 8, system=SYSTEM, tools=TOOLS)
    print(f"pass rate {before:.3f} -> {after:.3f}; step rewards {log.rewards}")
    assert after >= before + 0.2, (before, after, log.rewards)
