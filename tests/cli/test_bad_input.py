"""Every subcommand answers bad input in one line, fast, without a traceback.

The commands and their arguments are read from the typer app itself, so a new command is walked too.
Each case gives one argument a bad value of its kind and the others valid ones: a nonexistent path, a
directory without a model, an unreachable URL, a port in use, malformed YAML or JSON, an output path
under a regular file, a word outside an argument's closed set. Kafka and S3 point at a closed port, so no case waits on a network timeout.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import typer
import yaml
from typer.core import TyperGroup
from typer.testing import CliRunner

from infra.models import ensure_model
from polarstream.cli import app

# The bad values each argument gets, by argument name; URL arguments are recognised by name below.
KINDS = {
    "config": ("missing", "malformed_yaml"),
    "judge": ("missing", "malformed_yaml"),
    "experiment": ("missing", "malformed_yaml"),
    "model": ("missing", "no_model"),
    "port": ("busy_port",),
    "script": ("missing", "malformed_yaml"),
    "chat_template": ("missing",),
    "tasks_file": ("missing", "malformed_json", "not_a_task_dir", "docker_task"),
    "image_name": ("no_standin",),
    "from_offsets": ("missing", "malformed_json"),
    "lora_modules": ("missing",),
    "out": ("under_file",),
    "run_dir": ("under_file",),
    "render": ("under_file",),
    "work_dir": ("under_file",),
    "tombstones": ("under_file",),
}
# Arguments whose value is one of a closed set of words: an unknown word must be named in the error.
KINDS |= {name: ("unknown_word",) for name in (
    "runtime", "site_settings", "weight_transfer", "strategy", "format", "topic", "api",
    "loss", "correction", "engine_dtype", "action", "name", "container_engine", "launcher")}
# (export --harness and --source, infra mirror --source are open: a filter and a cluster name)
URL_ARGS = ("engine", "gateway")  # besides every *url argument
# Valid values of required arguments ({...}: filled from the Env), and extra arguments some commands need.
REQUIRED = {
    "engine_url": "{dead_url}", "model": "{model_dir}", "tasks_file": "{tasks_file}", "to_prefix": "r1",
    "format": "jsonl", "out": "{root}/out.jsonl", "task_id": "t1", "session_id": "s1", "name": "tiny",
    "source": "a", "target": "b", "index": "0", "action": "status", "topic": "calls",
    "image_name": "debian:bookworm-slim", "server": "s3",
}
EXTRA = {("forget",): ["--session", "s1"]}


def _leaves(cmd, path=()):
    if isinstance(cmd, TyperGroup):
        for name, sub in cmd.commands.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


def _kinds(cmd, param) -> tuple[str, ...]:
    if param.name in KINDS:
        return KINDS[param.name]
    if param.name.endswith("url") or param.name in URL_ARGS:
        return ("unreachable",)
    hint = get_type_hints(cmd.callback).get(param.name)
    assert Path not in (hint, *get_args(hint)), f"{param.name} is a path: add it to KINDS in {__file__}"
    return ()


COMMANDS = dict(_leaves(typer.main.get_command(app)))
CASES = [(path, p.name, kind) for path, cmd in COMMANDS.items() for p in cmd.params for kind in _kinds(cmd, p)]


@dataclass
class Env:
    root: Path
    dead_port: int
    busy_port: int

    @property
    def dead_url(self) -> str:
        return f"http://127.0.0.1:{self.dead_port}"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def tasks_file(self) -> Path:
        return self.root / "tasks.jsonl"

    def bad(self, kind: str, name: str) -> tuple[str, str | None]:
        """(value, text the error must contain; None when an earlier check may answer instead)."""
        r = self.root
        if kind == "missing":
            return str(r / "missing" / "nothing.yaml"), str(r / "missing" / "nothing.yaml")
        if kind == "malformed_yaml":
            return str(r / "bad.yaml"), str(r / "bad.yaml")
        if kind == "malformed_json":
            return str(r / "bad.json"), str(r / "bad.json")
        if kind == "not_a_task_dir":  # a directory with no instruction.md in it or below it
            return str(r / "empty"), str(r / "empty")
        if kind == "docker_task":  # a Harbor task whose image asks for a GPU
            return str(r / "docker-task"), str(r / "docker-task")
        if kind == "no_standin":  # a base image ``images base`` cannot stand in for
            return "quay.io/acme/tool:1", "quay.io/acme/tool:1"
        if kind == "no_model":
            return str(r / "empty"), str(r / "empty")
        if kind == "unknown_word":
            return "bogus-word", "bogus-word"
        if kind == "busy_port":
            return str(self.busy_port), str(self.busy_port)
        if kind == "under_file":
            return str(r / "a-file" / "out"), None
        assert kind == "unreachable"
        url = {"storage_url": "s3://polarstream/ckpt", "engine": f"polar={self.dead_url}"}.get(name, self.dead_url)
        return url, f"127.0.0.1:{self.dead_port}"  # s3:// goes to POLAR_S3_ENDPOINT: the same closed port


@pytest.fixture(scope="module")
def env():
    root = Path(tempfile.mkdtemp(prefix="ps-"))  # short paths: an error box wraps long ones
    # a real model: the gateway reads its tokenizer and template before it waits on the engine
    shutil.copytree(ensure_model("tiny"), root / "model")
    (root / "empty").mkdir()
    (root / "a-file").write_text("")
    (root / "docker-task" / "environment").mkdir(parents=True)
    (root / "docker-task" / "tests").mkdir()
    (root / "docker-task" / "instruction.md").write_text("Fix it.\n")
    (root / "docker-task" / "tests" / "test.sh").write_text("exit 0\n")
    (root / "docker-task" / "environment" / "Dockerfile").write_text("FROM python:3.13\nWORKDIR /app\n")
    (root / "docker-task" / "task.toml").write_text("[environment]\ngpus = 1\n")
    (root / "bad.yaml").write_text("turns: [1,\n")
    (root / "bad.json").write_text('{"calls": \n')
    (root / "tasks.jsonl").write_text(json.dumps({"task_id": "t1", "instruction": "do it", "num_samples": 1, "min_valid": 1}) + "\n")
    dead, busy = socket.socket(), socket.socket()
    dead.bind(("127.0.0.1", 0))
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    dead_port = dead.getsockname()[1]
    dead.close()
    yield Env(root, dead_port, busy.getsockname()[1])
    busy.close()
    shutil.rmtree(root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(env: Env, path: tuple[str, ...], bad_name: str, bad_value: str) -> list[str]:
    """The command line: the bad argument, valid required ones, a free port for servers."""
    values = {name: v.format(**{k: getattr(env, k) for k in ("root", "dead_url", "model_dir", "tasks_file")})
              for name, v in REQUIRED.items()}
    values[bad_name] = bad_value
    args, positional = [*path, *EXTRA.get(path, [])], []
    for p in COMMANDS[path].params:
        if p.name == bad_name or (p.required and p.name in values) or p.name == "port":
            value = values.get(p.name, str(_free_port()))
            if isinstance(p, typer.core.TyperArgument):
                positional.append(value)
            else:
                args += [p.opts[0], value]
        else:
            assert not p.required, f"{' '.join(path)}: give required {p.name} a valid value in REQUIRED"
    return args + positional


def _refuse(*_a, **_k):
    raise AssertionError("a bad input got as far as starting a server")


def test_every_command_has_a_case():
    covered = {path for path, _, _ in CASES}
    assert set(COMMANDS) == covered, f"no bad input for {sorted(set(COMMANDS) - covered)}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, name, kind", CASES, ids=[f"{' '.join(p)}:{n}:{k}" for p, n, k in CASES])
def test_bad_input_is_one_line(env, monkeypatch, path, name, kind):
    monkeypatch.setattr("uvicorn.run", _refuse)
    monkeypatch.setattr("engine.app.make_server", _refuse)  # the engine's own uvicorn Server
    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    value, named = env.bad(kind, name)
    polar_env = {"POLAR_KAFKA_BOOTSTRAP": f"127.0.0.1:{env.dead_port}", "POLAR_KAFKA_PORT": str(env.dead_port),
                 "POLAR_S3_ENDPOINT": env.dead_url, "POLAR_DATA_DIR": str(env.root / "data"), "POLAR_CONFIG": None,
                 "POLAR_DEBUG": None, "POLAR_ROLLOUT_PORT": str(env.dead_port),
                 "POLAR_WAIT_FOR_S": "0"}  # components otherwise wait for Kafka (tests/infra/test_reach.py)
    t0 = time.monotonic()
    r = CliRunner().invoke(app, _args(env, path, name, value), env=polar_env)
    took = time.monotonic() - t0
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{type(r.exception).__name__}: {r.exception}"
    assert r.exit_code != 0, r.output
    assert took < 20, f"took {took:.1f}s"
    assert "Traceback" not in r.output
    assert len(r.stderr.splitlines()) <= 8, r.stderr
    if named is not None:  # the error says which value it refused (box borders and wrapping aside)
        flat = re.sub(r"[\s│╭╮╰╯─]", "", r.stderr)
        assert re.sub(r"\s", "", named) in flat, r.stderr


# -- experiment files and task sources (issue 49): the problems a user's own run meets first -----------

@pytest.mark.parametrize("body, words", [
    ("colour: red\n", "colour: Extra inputs are not permitted"),
    ("async_level: -1\n", "async_level: Input should be greater than or equal to 0"),
    ("train: no/such/tasks\n", "train: "),  # the missing task dir, resolved against the file's folder
    ("eval: builtin:arith-everything\n", "eval: 'builtin:arith-everything': the built-in sources are"),
    ("group_size: many\n", "group_size: Input should be a valid integer"),
    ("zero_signal: drop\n", "zero_signal: Input should be 'mask'"),
    ("- a list\n", "expected a mapping of settings"),
    ("max_steps: [1,\n", "malformed YAML"),
])
def test_a_bad_experiment_file_is_one_line_naming_the_field(tmp_path, body, words):
    f = tmp_path / "exp.yaml"
    f.write_text(body)
    from polarstream.driver.experiment import ExperimentError, load_experiment

    with pytest.raises(ExperimentError) as e:
        load_experiment(f)
    assert str(e.value).startswith(f"{f}") and words in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["run", str(f)])
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1


def test_an_empty_split_and_a_task_that_needs_a_gpu_stop_the_run_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr("infra.stack.Stack.up", lambda *a: (_ for _ in ()).throw(AssertionError("started the stack")))
    (tmp_path / "empty.jsonl").write_text("\n")
    docker = tmp_path / "docker-task"
    (docker / "environment").mkdir(parents=True)
    (docker / "tests").mkdir()
    (docker / "instruction.md").write_text("x\n")
    (docker / "tests" / "test.sh").write_text("exit 0\n")
    (docker / "environment" / "Dockerfile").write_text("FROM x\n")
    (docker / "task.toml").write_text("[environment]\ngpus = 2\n")
    for train, words in (("empty.jsonl", "no tasks in it"), ("docker-task", "needs 2 GPU(s)")):
        f = tmp_path / "exp.yaml"
        f.write_text(yaml.safe_dump({"model": str(tmp_path), "train": train, "eval": ""}))
        r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
        assert r.exit_code == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_driver_only_without_the_components_urls_is_one_line(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("rollout_url: http://127.0.0.1:8700\n")
    r = CliRunner().invoke(app, ["run", str(f), "--driver-only"])
    assert r.exit_code == 1 and "--driver-only needs rollout_url and engine_url" in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    # a LoRA run's served version is its gateway's stamp (its engines report the base's): the gate needs it
    f.write_text("rollout_url: http://127.0.0.1:8700\nengine_url: http://127.0.0.1:8000\nlora: {rank: 4}\n")
    r = CliRunner().invoke(app, ["run", str(f), "--driver-only"])
    assert r.exit_code == 1 and "--driver-only with lora needs gateway_url" in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("trainer, words", [({"kl": 0.1}, "trainer.kl: not a trainer setting"),
                                            ({"max_staleness": 2}, "trainer.max_staleness: set by the experiment's async_level")])
def test_a_trainer_setting_the_trainer_lacks_or_the_experiment_owns_is_one_line(tmp_path, monkeypatch, trainer, words):
    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t1", "instruction": "do it", "num_samples": 1, "min_valid": 1}) + "\n")
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({"model": str(tmp_path), "train": "tasks.jsonl", "eval": "", "trainer": trainer}))
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("body, only, words", [
    ("engine_url: http://127.0.0.1:8700\n", "engine", "--only needs run_id in the file"),
    ("run_id: r1\n", "engine,gpu", "--only engine,gpu: expected some of ui,engine,node,streams,trainer,rollout"),
    ("run_id: r1\n", "engine", "--only engine: needs engine_url in the file"),
    ("run_id: r1\nengine_url: http://127.0.0.1:8700\n", "trainer", "--only trainer: needs gateway_url in the file"),
])
def test_only_without_what_its_components_need_is_one_line(tmp_path, monkeypatch, body, only, words):
    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    f = tmp_path / "exp.yaml"
    f.write_text(body)
    r = CliRunner().invoke(app, ["run", str(f), "--only", only, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and words in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


# -- issue 66: what the file alone does not show (the model, the tasks, the harness, the runtime) is checked
# before anything starts, one line naming the file, the key and the fix ---------------------------------

CODING = Path(__file__).parents[2] / "examples" / "coding"


def _coding(tmp_path: Path, **settings) -> Path:
    """examples/coding.yaml as shipped, over two of its Harbor tasks copied beside it, ``settings`` on top."""
    for name in ("fix-word-count", "write-slugify"):
        shutil.copytree(CODING / name, tmp_path / "coding" / name)
    f = tmp_path / "coding.yaml"
    f.write_text(yaml.safe_dump({**yaml.safe_load((CODING.parent / "coding.yaml").read_text()), **settings}))
    return f


@pytest.mark.parametrize("settings, words", [
    # the shipped example's old placeholder: a name that is no directory, no built-in and no cached hub id
    ({"model": "MODEL"}, "model: 'MODEL': no such directory, not a built-in name (tiny, tiny:SEED, smollm2), and no "
                         "hub id 'MODEL' in the local Hugging Face cache (nothing is downloaded); set model: to"),
    # a directory beside the file (not in the working directory) that holds no model
    ({"model": "coding"}, "/coding': not a model directory (no config.json); set model: to"),
    ({"train": "coding/fix-word-count/tests"}, "train: "),  # the tasks themselves: no instruction.md there
    ({"harness": "aider"}, "harness: 'aider': expected builtin or one of"),
    ({"harness": "pi"}, "is not installed in"),  # POLAR_CACHE_DIR below is empty
    ({"runtime": "subprocess"}, "runtime: subprocess runs sessions unsandboxed, and task polarstream-fix-word-count "
                                "wants its workspace at /app, which only bwrap can show; install bubblewrap"),
    ({"runtime": "auto"}, "runtime: auto found no bwrap here"),  # PATH below has no bwrap
    ({"runtime": "bwrap"}, "runtime: bwrap is not installed here; install bubblewrap"),
])
def test_the_model_tasks_harness_and_runtime_are_one_line_before_anything_starts(tmp_path, monkeypatch, settings, words):
    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    monkeypatch.setattr("polarstream.driver.processes.Processes.start", _refuse)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no bwrap, wherever the suite runs
    monkeypatch.setenv("POLAR_CACHE_DIR", str(tmp_path / "cache"))  # no harness CLI installed
    # a model that is there (the real tiny model's directory) and the builtin harness, unless the case sets them
    f = _coding(tmp_path, **{"model": str(ensure_model("tiny")), "harness": "builtin", **settings})
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    key = next(iter(settings))
    assert r.stderr.startswith(f"error: {f}: {key}: ") and words in r.stderr, r.stderr
    if key == "harness" and settings[key] == "pi":
        assert r.stderr.rstrip().endswith("run `polarstream harness install pi`"), r.stderr


def test_print_config_of_a_file_starts_nothing_and_a_placeholder_model_is_printed_not_checked(tmp_path, monkeypatch):
    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    monkeypatch.setattr("polarstream.driver.processes.Processes.start", _refuse)
    f = _coding(tmp_path, model="MODEL")
    r = CliRunner().invoke(app, ["run", str(f), "--print-config"])
    assert r.exit_code == 0 and yaml.safe_load(r.stdout)["model"] == "MODEL", r.output
