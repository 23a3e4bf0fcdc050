"""An experiment file's ``agent_network`` and ``agent_processes`` reach every task it trains and evaluates on;
without them each task keeps what its task.toml says (the agent offline, the verifier online, leftovers killed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polarstream.driver.configure import run_config
from polarstream.driver.experiment import ExperimentError, load_experiment


def image_task(root: Path) -> Path:
    d = root / "tasks" / "t"
    (d / "tests").mkdir(parents=True)
    (d / "environment").mkdir()
    (d / "instruction.md").write_text("Do it.\n")
    (d / "tests" / "test.sh").write_text("test -f /app/done\n")
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    return d.parent


def test_the_files_policies_reach_each_task_and_the_defaults_keep_the_tasks_own(tmp_path):
    src = str(image_task(tmp_path))
    cfg = run_config(load_experiment(None, model="tiny", train=src, eval=src, agent_network="internet", agent_processes="keep"),
                     tmp_path, driver_only=True)
    for t in [*cfg.train_tasks, *cfg.eval_tasks]:
        assert t.environment.allow_internet is True and t.evaluator.agent_processes == "keep"
        assert t.evaluator.network == "host"
    (plain,) = run_config(load_experiment(None, model="tiny", train=src, eval=""), tmp_path, driver_only=True).train_tasks
    assert plain.environment.allow_internet is False and plain.evaluator.agent_processes == "kill"


def test_an_unknown_agent_network_is_one_line(tmp_path):
    with pytest.raises(ExperimentError, match="agent_network") as e:
        load_experiment(None, agent_network="everything")
    assert "\n" not in str(e.value)
