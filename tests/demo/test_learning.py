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
from polarstream.demo import arith
from polarstream.demo.arith import reward
from polarstream.demo.learning import LearningConfig, rl_run

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
PROBLEMS = arith.split(0)[0][::11]


# For the no-collapse rule the run must get past 0.8: the tool path shown half the time (still never which
# path is rewarded) starts RL at ~0.3 instead of ~0.06.
WARM_HALF_TOOL = dict(steps=80, batch_size=8, drills=32, p_tool=0.5, seed=0)


def _warm(settings: dict) -> Path:
    """The warm start, built once per machine: cached under the cache dir by its settings and the code that
    makes it (polarstream/demo/warmstart.py and the tiny model's build), as the demo caches its own; ~1-3 minutes
    of a busy 2-core machine otherwise, in every suite."""
    import hashlib
    import os
    import shutil

    import polarstream.demo.warmstart
    from infra.models import ensure_model
    from infra.settings import CACHE_DIR
    from polarstream.demo.warmstart import warm_start

    torch.set_num_threads(THREADS)
    base = ensure_model("tiny")
    source = Path(polarstream.demo.warmstart.__file__).read_bytes()
    key = hashlib.sha256(repr((sorted(settings.items()), PROBLEMS, SYSTEM, TOOLS, base.name, THREADS)).encode() + source).hexdigest()[:12]
    out = CACHE_DIR / "models" / f"test-learning-warm-{key}"
    if not (out / "config.json").exists():
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        # The demo's rule: the tool path is shown now and then, and never which path is rewarded.
        warm_start(base, tmp, PROBLEMS, system=SYSTEM, tools=TOOLS, progress=False, **settings)
        try:
            tmp.rename(out)
        except OSError:  # another test process built it first: the same model
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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
    from polarstream.report import worst_fall

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


COLLAPSE = Path(__file__).parent / "data" / "seed2-collapse.json.gz"


def _replay_collapse(model_dir: Path, lr_saturation: float) -> tuple[float, float]:
    """Issue 48's collapse, replayed: the trainer's step code on the recorded groups of the demo's first 8
    steps (seed 2, from its own warm start); the pass rate of the next two steps' problems (16 samples
    each) before and after the 8th, whose only signal was a lone failure in each of two groups."""
    import gzip
    import json
    import re

    from transformers import AutoTokenizer

    from polarstream.demo.learning import sample
    from trainer.attention import load_model
    from trainer.config import TrainConfig
    from trainer.loss import LossConfig
    from trainer.optim import apply_update, param_groups, saturation_scale
    from trainer.packing import assign_weights, pack, sample_from_trace
    from trainer.step import accumulate_gradients

    data = json.loads(gzip.decompress(COLLAPSE.read_bytes()))
    cfg = TrainConfig(lr=data["lr"], weight_decay=0.0, lr_saturation=lr_saturation)  # the demo's trainer settings
    torch.manual_seed(0)
    model = load_model(model_dir, torch.float32, "auto")
    train_attn = model.config._attn_implementation
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    tok = AutoTokenizer.from_pretrained(model_dir)

    def next_problems_pass_rate() -> float:
        model.eval()
        model.set_attn_implementation("sdpa")  # sampled with a KV cache; trained with polar_varlen
        gen, passed, n = torch.Generator().manual_seed(0), 0.0, 0
        for i in data["eval_prompts"]:
            prompt = data["prompts"][i]
            a, b = re.search(r"Compute (\d+) \+ (\d+)", tok.decode(prompt)).groups()
            for c in sample(model, tok, prompt, 16, 48, 1.0, gen):
                passed += reward(tok.decode(c), str(int(a) + int(b)))
                n += 1
        model.train()
        model.set_attn_implementation(train_attn)
        return passed / n

    rates = []
    model.train()
    for step in range(8):
        if step == 7:
            rates.append(next_problems_pass_rate())
        traces = [t for t in data["traces"] if t["step"] == step]
        samples = []
        for t in traces:
            prompt, mask = data["prompts"][t["prompt"]], [int(c) for c in t["mask"]]
            lps = iter(t["logprobs"])
            s = sample_from_trace(prompt + t["ids"], [0] * len(prompt) + mask,
                                  [0.0] * len(prompt) + [next(lps) if m else 0.0 for m in mask], t["advantage"], 0)
            samples.append(s)
        rewards = [t["reward"] for t in traces if t["trace"] == 0]  # one per trajectory, as the trainer counts them
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * saturation_scale(sum(rewards) / len(rewards), cfg.lr_saturation, cfg.lr_saturation_floor)
        samples = assign_weights(samples, cfg.loss_norm)
        accumulate_gradients(model, pack(samples, cfg.token_budget), LossConfig(), cfg.temperature)
        apply_update(model, optimizer, samples, cfg.grad_clip)
    rates.append(next_problems_pass_rate())
    return rates[0], rates[1]


def test_the_recorded_collapse_does_not_happen_with_the_trainers_defaults():
    """Issue 48's rule on the replayed update: it may not take the next problems' pass rate down by more
    than 0.3. Fails on the code before the fix, whose default was a constant rate (``lr_saturation=1``):
    there the replayed step 8 takes it from about 0.98 to about half."""
    from infra.settings import Settings
    from polarstream.config import RunConfig
    from polarstream.demo.model import demo_model
    from trainer.config import TrainConfig

    torch.set_num_threads(THREADS)
    warm, _ = demo_model(RunConfig(seed=2, min_pass_rate=0.0), Settings(), arith.split(2)[0])  # the demo's own, cached
    constant = _replay_collapse(warm, lr_saturation=1.0)
    defaults = _replay_collapse(warm, lr_saturation=TrainConfig().lr_saturation)
    print(f"next problems' pass rate before -> after the replayed step 8: constant lr {constant}, trainer defaults {defaults}")
    assert constant[0] - constant[1] > 0.3, constant  # the collapse is in the data: without it this test proves nothing
    assert defaults[0] - defaults[1] <= 0.3 and defaults[1] >= 0.7, defaults
