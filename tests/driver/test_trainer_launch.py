"""The trainer of several processes (the experiment's ``trainer: {nproc, nodes, rendezvous}``): checked before
anything starts, and written once (components.component_args) as the torchrun command that torch's own launcher
parses into the launch the file asks for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polarstream.driver.components import command_line, component_args
from polarstream.driver.configure import run_config
from polarstream.driver.experiment import ExperimentError, load_experiment
from polarstream.driver.processes import Processes
from infra.settings import Settings

URLS = {"engine": "http://10.0.0.5:8000", "gateway": "http://10.0.0.6:8100", "rollout": "http://10.0.0.7:8200"}
PORTS = {"engine": 8000, "gateway": 8100, "rollout": 8200, "ui": 8300, "streams_metrics": 9100, "trainer_metrics": 9200}


def _config(tmp_path: Path, trainer: str, **kw):
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t1", "instruction": "do it", "num_samples": 1, "min_valid": 1}\n')
    f = tmp_path / "exp.yaml"
    f.write_text("name: mine\nrun_id: mine-1\nmodel: tiny\ntrain: tasks.jsonl\neval: ''\nruntime: subprocess\n"
                 + "".join(f"{k}_url: {v}\n" for k, v in URLS.items()) + f"trainer: {trainer}\n")
    return run_config(load_experiment(f), tmp_path / "run", **kw)


def _trainer(cfg, **kw) -> tuple[str, ...]:
    return component_args("trainer", cfg, Settings(), PORTS, URLS, Path("/models/tiny"), "subprocess", Path("/run"), **kw)


def _parsed(args: tuple[str, ...]):
    """torchrun's own reading of the command (torch.distributed.run), not ours."""
    from torch.distributed.run import parse_args

    assert args[0] == "torchrun"
    return parse_args(list(args[1:]))


def test_one_trainer_process_is_polarstream_train_as_before(tmp_path):
    cfg = _config(tmp_path, "{kl_coef: 0.01}")
    args = _trainer(cfg)
    assert args[0] == "train" and cfg.trainer_settings == {"kl_coef": "0.01"}
    assert command_line(args) == ("polarstream", *args)


def test_several_processes_on_one_machine_run_under_torchrun_standalone(tmp_path):
    cfg = _config(tmp_path, "{nproc: 2, kl_coef: 0.01}")
    assert (cfg.trainer_nproc, cfg.trainer_nodes) == (2, 1)
    assert cfg.trainer_settings == {"kl_coef": "0.01"}  # nproc is torchrun's, not a --set of the trainer's
    args = _trainer(cfg)
    launch = _parsed(args)
    assert launch.standalone and launch.nproc_per_node == "2" and launch.module and launch.max_restarts == 0
    assert launch.training_script == "polarstream"
    assert launch.training_script_args == list(_trainer(_config(tmp_path, "{kl_coef: 0.01}")))  # the same train args
    assert command_line(args) == args
    # here, torchrun is this Python's module (the venv's torch), and the command line it shows still marks it
    cmd = Processes(tmp_path / "logs", {}).command(args)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and cmd[3:] == list(args[1:])


def test_several_machines_meet_at_the_rendezvous_of_node_0(tmp_path):
    cfg = _config(tmp_path, "{nproc: 1, nodes: 2, rendezvous: 'trainer-0.polar:29400'}",
                  only=frozenset({"trainer"}), node_rank=1)
    launch = _parsed(_trainer(cfg))
    assert (launch.nnodes, launch.node_rank, launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id) == (
        "2", 1, "static", "trainer-0.polar:29400", "mine-1")
    assert not launch.standalone and launch.nproc_per_node == "1"
    # a launcher passes what its scheduler expands per node (a Kubernetes indexed Job's completion index)
    assert "$(JOB_COMPLETION_INDEX)" in _trainer(cfg, node_rank="$(JOB_COMPLETION_INDEX)")


@pytest.mark.parametrize("trainer, kw, message", [
    ("{nproc: 0}", {}, "trainer.nproc: 0: expected a whole number of trainer processes on each machine, 1 or more"),
    ("{nproc: two}", {}, "trainer.nproc: 'two': expected a whole number"),
    ("{nodes: 2}", {}, "trainer.nodes: 2 machines need trainer.rendezvous: host:port"),
    ("{nodes: 2, rendezvous: 'node0'}", {}, "trainer.rendezvous: 'node0': expected host:port"),
    ("{nodes: 2, rendezvous: 'node0:29400'}", {"only": frozenset({"trainer"}), "node_rank": 2},
     "--node-rank 2: the trainer runs on 2 machine(s) (trainer.nodes), numbered 0 to 1"),
    ("{nodes: 2, rendezvous: 'node0:29400'}", {"only": frozenset({"engine"}), "node_rank": 1},
     "--node-rank 1: only a trainer machine has one; start it with --only trainer"),
    ("{nprocs: 2}", {}, "trainer.nprocs: not a trainer setting"),
])
def test_a_launch_the_trainer_cannot_make_is_refused_before_anything_starts(tmp_path, trainer, kw, message):
    with pytest.raises(ExperimentError) as e:
        _config(tmp_path, trainer, **kw)
    assert str(e.value).startswith(message), str(e.value)
