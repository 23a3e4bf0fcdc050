"""Task sources (producers/tasks.py): Harbor directories, flat rows and TaskRequest lines as the tasks a
user meant, and every problem as one line naming where."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producers.tasks import TaskSourceError, load_tasks, with_phase_policies

EXAMPLES = Path(__file__).parents[2] / "examples" / "coding"


def harbor(root: Path, name: str = "t", *, toml: str = "", dockerfile: str | None = None, workspace: bool = True) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("Make the tests pass.\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (d / "tests" / "test_x.py").write_text("import unittest\n")
    if toml:
        (d / "task.toml").write_text(toml)
    if dockerfile is not None:
        (d / "environment").mkdir()
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    if workspace:
        (d / "workspace").mkdir()
        (d / "workspace" / "main.py").write_text("print('hi')\n")
    return d


def test_the_example_coding_tasks_load_as_harbor_tasks():
    tasks = load_tasks(EXAMPLES)
    assert len(tasks) >= 5 and len({t.task_id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.evaluator.kind == "harbor" and t.evaluator.command == "bash /tests/test.sh"
        assert "test.sh" in t.evaluator.tests and any(k.startswith("test_") for k in t.evaluator.tests)
        assert t.workspace.kind == "dir" and Path(t.workspace.source).is_dir() and t.workspace.mount == "/app"
        assert (Path(t.metadata["solution"]) / "solve.sh").is_file()
        assert t.instruction.strip() and t.evaluator.timeout_s == 60 and t.timeouts.agent_s == 300


def test_task_toml_sets_name_timeouts_network_and_workdir(tmp_path):
    d = harbor(tmp_path, toml='[task]\nname = "org/fix bug"\n[verifier]\ntimeout_sec = 42\nnetwork_mode = "public"\n'
                              '[agent]\ntimeout_sec = 99\n[metadata]\nworkdir = "/srv/code"\n')
    (t,) = load_tasks(d)
    assert (t.task_id, t.evaluator.timeout_s, t.evaluator.network, t.timeouts.agent_s, t.workspace.mount) == (
        "org-fix-bug", 42.0, "host", 99.0, "/srv/code")
    assert t.evaluator.tests["test.sh"].startswith("#!/bin/bash") and t.metadata["source"] == "harbor"


def test_the_dockerfile_workdir_is_used_when_a_workspace_is_given(tmp_path):
    (t,) = load_tasks(harbor(tmp_path, dockerfile="FROM python:3.13\nWORKDIR /tmp\nRUN true\nWORKDIR /work\n"))
    assert t.workspace.mount == "/work" and t.evaluator.network == "none"


def test_a_published_task_runs_in_its_own_image_with_its_limits(tmp_path):
    d = harbor(tmp_path, dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY data.txt /app/\n", workspace=False,
               toml='[environment]\ncpus = 1.5\nmemory_mb = 512\nbuild_timeout_sec = 90\nallow_internet = true\n'
                    '[verifier]\nenv = { MODE = "strict", N = 3 }\n')
    (d / "environment" / "data.txt").write_text("42\n")
    (t,) = load_tasks(d)
    env = t.environment
    assert t.workspace.kind == "image" and t.workspace.mount == "/app" and t.evaluator.env == {"MODE": "strict", "N": "3"}
    assert env.context == {"Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY data.txt /app/\n", "data.txt": "42\n"}
    assert (env.cpus, env.memory_mb, env.build_timeout_s, env.allow_internet, env.context_dir) == (1.5, 512, 90.0, True, "")
    (binary,) = load_tasks(harbor(tmp_path, "bin", dockerfile="FROM x\n", workspace=False))
    (tmp_path / "bin" / "environment" / "blob").write_bytes(b"\xff\xfe")
    (binary,) = load_tasks(tmp_path / "bin")  # a binary file: the context goes by its path
    assert binary.environment.context == {} and binary.environment.context_dir == str(tmp_path / "bin" / "environment")
    (pre,) = load_tasks(harbor(tmp_path, "pre", toml='[environment]\ndocker_image = "org/img:1"\nmemory = "2G"\n', workspace=False))
    assert (pre.workspace.kind, pre.environment.image, pre.environment.memory_mb, pre.environment.allow_internet) == (
        "image", "org/img:1", 2048, False)


def test_the_verifier_gets_harbors_network_the_agent_keeps_none_and_an_experiment_can_change_both(tmp_path):
    image = "FROM debian:bookworm-slim\nWORKDIR /app\n"
    (published,) = load_tasks(harbor(tmp_path, "pub", dockerfile=image, workspace=False))
    assert published.evaluator.network == "host" and published.environment.allow_internet is False  # Harbor's default, per phase
    assert published.evaluator.agent_processes == "kill"
    (closed,) = load_tasks(harbor(tmp_path, "closed", dockerfile=image, workspace=False, toml="[environment]\nallow_internet = false\n"))
    assert closed.evaluator.network == "none"  # Harbor would give its verifier none either
    (private,) = load_tasks(harbor(tmp_path, "priv", dockerfile=image, workspace=False, toml='[verifier]\nnetwork_mode = "none"\n'))
    assert private.evaluator.network == "none"  # a [verifier] key wins
    (bwrap,) = load_tasks(harbor(tmp_path, "ws"))
    assert bwrap.evaluator.network == "none"  # no container: "outside" would be the host's own network
    assert with_phase_policies(published) is published
    open_ = with_phase_policies(published, "internet", "keep")
    assert open_.environment.allow_internet is True and open_.evaluator.agent_processes == "keep"
    assert with_phase_policies(open_, "gateway").environment.allow_internet is False
    assert published.environment.allow_internet is False and published.evaluator.agent_processes == "kill"  # a copy
    assert with_phase_policies(bwrap, "internet").environment is None


def test_a_metadata_workspace_path_is_resolved_against_the_task(tmp_path):
    d = harbor(tmp_path, toml='[metadata]\nworkspace = "../seed"\n', workspace=False)
    (tmp_path / "seed").mkdir()
    (t,) = load_tasks(d)
    assert Path(t.workspace.source) == (tmp_path / "seed").resolve()


@pytest.mark.parametrize("make, words", [
    (lambda p: harbor(p, dockerfile="FROM x\n", toml='[environment]\nmemory = "lots"\n', workspace=False), "not a size"),
    (lambda p: harbor(p, dockerfile="FROM x\n", toml='[environment]\ncpus = -1\n', workspace=False), "cpus"),
    (lambda p: harbor(p, toml="[environment]\ngpus = 1\n"), "needs 1 GPU(s)"),
    (lambda p: harbor(p, toml="[task\n"), "not valid TOML"),
    (lambda p: harbor(p, toml='[metadata]\nworkspace = "nowhere"\n', workspace=False), "is not a directory"),
    (lambda p: p, "not a Harbor task directory"),
])
def test_a_harbor_task_that_cannot_run_is_refused_in_one_line_naming_it(tmp_path, make, words):
    target = make(tmp_path)
    with pytest.raises(TaskSourceError) as e:
        load_tasks(target)
    assert words in str(e.value) and str(target.resolve() if target != tmp_path else tmp_path) in str(e.value)
    assert "\n" not in str(e.value)


def test_a_task_without_its_verifier_is_refused(tmp_path):
    d = harbor(tmp_path)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(TaskSourceError, match="no tests/test.sh"):
        load_tasks(d)


def test_flat_rows_and_task_requests_mix_in_one_jsonl(tmp_path):
    ws = tmp_path / "repo"
    ws.mkdir()
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "a", "instruction": "fix it", "workspace": str(ws), "setup_cmd": "make", "test_cmd": "pytest -q", "timeout": 30}),
        json.dumps({"instruction": "clone it", "workspace": "https://example.com/r.git", "ref": "v1", "test_cmd": "true"}),
        "",
        json.dumps({"task_id": "c", "instruction": "as a record", "num_samples": 2, "min_valid": 1}),
    ]) + "\n")
    a, b, c = load_tasks(f, num_samples=3)
    assert (a.task_id, a.workspace.kind, a.workspace.source, a.prepare, a.evaluator.command, a.timeouts.agent_s, a.num_samples) == (
        "a", "dir", str(ws), ["make"], "pytest -q", 30.0, 3)
    assert (b.task_id, b.workspace.kind, b.workspace.ref) == ("tasks-2", "git", "v1")
    assert (c.task_id, c.num_samples, c.evaluator.kind) == ("c", 2, "command")


def test_flat_rows_from_parquet(tmp_path):
    f = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "p1", "instruction": "do", "test_cmd": "true"},
                                         {"id": "p2", "instruction": "do more", "test_cmd": "false"}]), f)
    assert [(t.task_id, t.evaluator.command) for t in load_tasks(f)] == [("p1", "true"), ("p2", "false")]


@pytest.mark.parametrize("line, words", [
    ('{"instruction": "x", "test_cmd": "t", "colour": "red"}', "unknown key(s) colour"),
    ('{"instruction": "x", "workspace": "/nope/missing", "test_cmd": "t"}', "is not a directory or a git URL"),
    ('{"instruction": "", "test_cmd": "t"}', "instruction: missing"),
    ('{"task_id": "t", "instruction": "x", "num_samples": 0}', "num_samples"),
    ('[1, 2]', "expected a JSON object"),
    ('{"task_id": ', "not JSON"),
])
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, line, words):
    f = tmp_path / "t.jsonl"
    f.write_text('{"task_id": "ok", "instruction": "fine"}\n' + line + "\n")
    with pytest.raises(TaskSourceError) as e:
        load_tasks(f)
    assert str(e.value).startswith(f"{f}:2: ") and words in str(e.value) and "\n" not in str(e.value)


def test_an_empty_file_holds_no_tasks(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(TaskSourceError, match="no tasks in it"):
        load_tasks(tmp_path / "e.jsonl")


# Terminal-Bench 2.0 writes memory = "2G" and storage = "10G"; Harbor's own template memory_mb and storage_mb
@pytest.mark.parametrize("tb2, harbor_keys", [
    ('memory = "2G"\nstorage = "10G"\ncpus = 1\n', "memory_mb = 2048\nstorage_mb = 10240\ncpus = 1.0\n"),
    ('memory = "512M"\nstorage = "1.5G"\ncpus = "2"\n', "memory_mb = 512\nstorage_mb = 1536\ncpus = 2\n"),
    ('memory = "2Gi"\nmemory_mb = 2048\n', "memory_mb = 2048\n"),  # both spellings, agreeing
])
def test_both_spellings_of_each_resource_key_are_the_same_spec(tmp_path, tb2, harbor_keys):
    (a,) = load_tasks(harbor(tmp_path, "a", dockerfile="FROM x\n", toml=f"[environment]\n{tb2}", workspace=False))
    (b,) = load_tasks(harbor(tmp_path, "b", dockerfile="FROM x\n", toml=f"[environment]\n{harbor_keys}", workspace=False))
    assert a.environment == b.environment
    assert a.environment.memory_mb in (512, 2048) and isinstance(a.environment.cpus, (float, type(None)))


@pytest.mark.parametrize("toml, words", [
    ('storage = "ten gigs"', "[environment] storage = 'ten gigs' is not a size like '2G' or '512M'"),
    ("storage = 10", "[environment] storage = 10 is not a size like '2G'"),
    ('memory = "2G"\nmemory_mb = 1024', "[environment] memory = '2G' and memory_mb = 1024 disagree"),
    ('storage_mb = "10G"', "[environment] storage_mb = '10G' is not a whole number of MB"),
    ('cpus = "two"', "[environment] cpus = 'two' is not a number"),
])
def test_a_bad_size_is_one_line_naming_the_task_and_key(tmp_path, toml, words):
    d = harbor(tmp_path, dockerfile="FROM x\n", toml=f"[environment]\n{toml}\n", workspace=False)
    with pytest.raises(TaskSourceError) as e:
        load_tasks(d)
    assert str(e.value).startswith(f"{d.resolve()}: {words}") and "\n" not in str(e.value), str(e.value)


def test_a_prebuilt_image_and_its_dockerfile_both_travel_and_force_build_is_a_source_option(tmp_path):
    d = harbor(tmp_path, dockerfile="FROM debian:bookworm-slim\n", toml='[environment]\ndocker_image = "org/img:1"\n',
               workspace=False)
    (t,) = load_tasks(d)
    assert (t.environment.image, t.environment.context, t.environment.force_build) == (
        "org/img:1", {"Dockerfile": "FROM debian:bookworm-slim\n"}, False)
    assert load_tasks(f"{tmp_path}?force_build=1")[0].environment.force_build
    assert load_tasks(d, force_build=True)[0].environment.force_build
    assert not load_tasks(f"{d}?force_build=0")[0].environment.force_build
    with pytest.raises(TaskSourceError, match=r"\?force_bild=1: 'force_bild=1' is not a source option \(options: force_build=1\)"):
        load_tasks(f"{d}?force_bild=1")
