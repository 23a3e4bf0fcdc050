"""The demo's task is learnable, deterministically: a short RL run with the trainer's own step code.

The run is in one process (``polarstream.learning``): seeded sampling, single-threaded torch, no
Kafka, so it gives the same curve on every machine. It fails when learning breaks: a loss sign error,
advantages that do not reach the loss, a warm start that leaves no signal, or an optimizer that moves
the weights on a step without signal.
"""

from __future__ import annotations

import pytest
import torch

from gateway.harnesses.builtin import SYSTEM, TOOLS
from polarstream import demo_tasks
from polarstream.learning import RunConfig, pass_rate, reward, rl_run

pytestmark = pytest.mark.slow


def test_reward_is_the_demo_evaluators_rule():
    call = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "8"}}\n</tool_call>'
    assert reward(call, "8") == 1.0
    assert reward(call.replace("answer.txt", "./answer.txt"), "8") == 1.0
    assert reward(call, "9") == 0.0  # wrong number
    assert reward(call.replace("answer.txt", "other.txt"), "8") == 0.0  # wrong file
    assert reward("The answer is 8.", "8") == 0.0  # prose never writes the file
    assert reward(call.replace("</tool_call>", ""), "8") == 0.0  # a truncated call runs nothing


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    from engine.models import ensure_model
    from polarstream.warmstart import warm_start

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("warm") / "model"
    # Shorter than the demo's warm start (CI time), with the tool path shown more often so a few RL
    # steps have signal; the rule is the same: the warm start never says which path is rewarded.
    warm_start(ensure_model("tiny"), out, demo_tasks.family(), system=SYSTEM, tools=TOOLS, steps=150,
               p_tool=0.3, seed=0, progress=False)
    return out


def test_reward_rises_and_weights_move_only_on_steps_with_signal(warm_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    train, heldout = demo_tasks.split(0)
    cfg = RunConfig(steps=8, tasks_per_step=4, samples=8, lr=8e-4, seed=0)
    log, model = rl_run(warm_model, train, cfg, system=SYSTEM, tools=TOOLS)

    for s in log.steps:  # a step without signal leaves every weight bit-identical; one with signal moves them
        assert s.moved == s.signal, s
    assert any(s.signal for s in log.steps)
    first, last = log.rewards[:3], log.rewards[-3:]
    assert sum(last) / 3 > sum(first) / 3 + 0.1, log.rewards

    # What RL taught carries over to problems it never trained on.
    tok = AutoTokenizer.from_pretrained(warm_model)
    before = pass_rate(AutoModelForCausalLM.from_pretrained(warm_model), tok, heldout, 4, system=SYSTEM, tools=TOOLS)
    after = pass_rate(model, tok, heldout, 4, system=SYSTEM, tools=TOOLS)
    assert after > before, (before, after)
