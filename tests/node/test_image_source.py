"""Issue 72: a task's image got as Harbor gets it (gateway/runtimes/image_source.py), on the real podman.

Docker Hub does not answer on this machine: that is the "registry unreachable" case. A Terminal-Bench
2.0-shaped task (docker_image *and* environment/Dockerfile, ``memory = "2G"``, ``storage = "10G"``) is
built from its Dockerfile with one line saying so and scores its oracle; ``--force-build`` takes the
build path even so; an image that can be neither pulled nor built is refused at load, by ``polarstream
tasks`` and by ``polarstream run`` before anything starts; a storage limit this storage cannot enforce
is one warning for the runtime, and its sessions run. (The path where the pull succeeds needs a registry
that answers, which this machine has none of: not tested here.)"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gateway.runtimes import ContainerRuntime, ExecSpec, ImageBuildError, Limits
from gateway.runtimes import image_source
from gateway.runtimes.image_source import plan_image, probe, qualified, registry
from gateway.runtimes.podman import storage_quota
from polarstream.cli import app
from producers.tasks import load_tasks

NOWHERE = "registry.invalid/nobody/base:1"  # .invalid never resolves (RFC 2606): no registry, no stand-in


def tb2_task(root: Path, name: str, *, image: str = "", dockerfile: str | None = "FROM debian:bookworm-slim\nWORKDIR /app\n"
             "RUN echo hello > /app/greeting.txt\n", env: str = 'cpus = 1\nmemory = "2G"\nstorage = "10G"\n') -> Path:
    """A task in Terminal-Bench 2.0's shape (our own: theirs may not be committed)."""
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "instruction.md").write_text("Write /app/greeting.txt in capitals to /app/answer.txt.\n")
    image_line = f'docker_image = "{image}"\n' if image else ""
    (d / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n\n'
                                 f'[environment]\nbuild_timeout_sec = 600.0\n{image_line}{env}')
    (d / "tests" / "test.sh").write_text('#!/bin/bash\nmkdir -p /logs/verifier\n'
                                         'if [ "$(cat /app/answer.txt 2>/dev/null)" = HELLO ]; then echo 1; else echo 0; fi'
                                         ' > /logs/verifier/reward.txt\n')
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\ntr a-z A-Z < /app/greeting.txt > /app/answer.txt\n")
    if dockerfile is not None:
        (d / "environment").mkdir()
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    return d


def _rows(output: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in output.splitlines()[1:] if line.strip()}


# ------------------------------------------------------------------------------------------ pure


@pytest.mark.parametrize("short, full", [
    ("alexgshaw/fix-git:20251031", "docker.io/alexgshaw/fix-git:20251031"),
    ("ubuntu", "docker.io/library/ubuntu:latest"),
    ("python:3.13-slim-bookworm", "docker.io/library/python:3.13-slim-bookworm"),
    ("ghcr.io/org/img", "ghcr.io/org/img:latest"),
    ("localhost:5000/img:2", "localhost:5000/img:2"),
    ("localhost/polar-task:abc", "localhost/polar-task:abc"),
    ("quay.io/a/b/c:1", "quay.io/a/b/c:1"),
    ("org/img@sha256:" + "0" * 64, "docker.io/org/img@sha256:" + "0" * 64),
])
def test_a_short_name_resolves_as_docker_resolves_it(short, full):
    assert qualified(short) == full
    assert registry(short) == full.split("/")[0]


@pytest.mark.parametrize("driver, fs, opts, enforced", [
    ("overlay", "xfs", "rw,relatime,prjquota", True),
    ("overlay", "xfs", "rw,pquota", True),
    ("overlay", "xfs", "rw,relatime", False),  # xfs without project quotas
    ("overlay", "extfs", "rw,relatime,discard", False),  # this machine
    ("vfs", "xfs", "rw,prjquota", False),
])
def test_storage_is_enforced_only_on_overlay_over_xfs_with_project_quotas(driver, fs, opts, enforced):
    assert storage_quota(driver, fs, opts) is enforced


# ------------------------------------------------------------------------------ podman, no image run

podman = pytest.mark.integration  # the real engine (and Docker Hub's absence)


@podman
async def test_a_registry_that_did_not_answer_is_not_asked_again_for_a_while():
    image_source._unreachable.pop("registry.invalid", None)
    first = await probe(NOWHERE)
    assert first.state == "unreachable" and "registry.invalid did not answer" in first.detail
    # asked again through an engine that does not exist: an answer without running anything is the memory's
    t0 = time.monotonic()
    again = await probe("registry.invalid/other/img:2", engine="/nonexistent/podman")
    assert again == first and time.monotonic() - t0 < 0.5
    image_source._unreachable["registry.invalid"] = (time.monotonic() - image_source.FORGET_S - 1, "old")
    with pytest.raises(FileNotFoundError):  # forgotten: the engine is asked again
        await probe(NOWHERE, engine="/nonexistent/podman")


@podman
async def test_a_registry_that_holds_the_connection_and_says_nothing_is_given_up_after_the_probe_deadline(monkeypatch):
    import socket

    monkeypatch.setattr(image_source, "PROBE_S", 2.0)  # the deadline itself, shortened: 20 s in use
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers a byte
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        name = f"127.0.0.1:{silent.getsockname()[1]}/org/img:1"
        t0 = time.monotonic()
        seen = await probe(name)
        took = time.monotonic() - t0
        assert seen.state == "unreachable" and seen.detail.endswith("did not answer in 2 s") and 1.5 < took < 10, (seen, took)
        t0 = time.monotonic()
        assert await probe(name) == seen and time.monotonic() - t0 < 0.5  # remembered, not waited on again


@podman
async def test_plans_follow_harbor_pull_else_build_else_refuse(tmp_path, podman_base):
    unpullable = "polarstream-fixture/never-published:1"  # docker.io: unreachable here, absent where it answers
    both, = load_tasks(tb2_task(tmp_path, "both", image=unpullable))
    assert both.environment.image == unpullable and "Dockerfile" in both.environment.context  # both kept
    plan = await plan_image(both.environment)
    assert plan.how == "build" and plan.why in ("registry unreachable", "not in the registry"), plan
    assert plan.image == f"docker.io/{unpullable}"
    forced, = load_tasks(f"{tb2_task(tmp_path, 'forced', image=unpullable)}?force_build=1")
    assert forced.environment.force_build and (await plan_image(forced.environment)).label().startswith("built:force_build")
    image_only, = load_tasks(tb2_task(tmp_path, "image-only", image=unpullable, dockerfile=None))
    refused = await plan_image(image_only.environment)
    assert refused.refused and refused.why.startswith(f"cannot pull {unpullable} (") and "no environment/Dockerfile" in refused.why
    with pytest.raises(ImageBuildError, match=f"cannot pull {unpullable}"):  # and where a session would open it
        await image_source.task_image(image_only.environment)
    bad_base, = load_tasks(tb2_task(tmp_path, "bad-base", image=unpullable, dockerfile=f"FROM {NOWHERE}\n"))
    refused = await plan_image(bad_base.environment)
    assert refused.refused and f"base {NOWHERE} cannot be pulled" in refused.why and "no offline stand-in" in refused.why
    # a docker_image that is itself a Debian base present here: used as it is, no Dockerfile needed
    debian, = load_tasks(tb2_task(tmp_path, "debian", image=podman_base, dockerfile=None))
    assert (await plan_image(debian.environment)).how in ("local", "standin")


@podman
def test_polarstream_tasks_refuses_an_image_it_can_neither_pull_nor_build_in_one_line(tmp_path):
    tb2_task(tmp_path, "no-dockerfile", image="polarstream-fixture/never-published:1", dockerfile=None)
    tb2_task(tmp_path, "no-base", dockerfile=f"FROM {NOWHERE}\nRUN true\n")
    tb2_task(tmp_path, "fine", dockerfile="FROM debian:bookworm-slim\n")
    r = CliRunner().invoke(app, ["tasks", str(tmp_path)])
    assert r.exit_code == 1, r.output
    rows = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert len(r.stdout.splitlines()) == 3, r.stdout  # one line a task
    assert "refused: cannot pull polarstream-fixture/never-published:1 (" in rows["no-dockerfile"]
    assert "and the task has no environment/Dockerfile to build instead" in rows["no-dockerfile"]
    assert f"refused: its Dockerfile's base {NOWHERE} cannot be pulled" in rows["no-base"]
    assert "image built" in rows["fine"] or "image local" in rows["fine"], rows["fine"]
    assert r.stderr.strip() == "error: 2 of 3 tasks refused"


def _refuse(*a, **k):
    raise AssertionError("started something before the checks")


@podman
def test_polarstream_run_refuses_such_a_task_before_anything_starts(tmp_path, monkeypatch):
    from infra.models import ensure_model

    monkeypatch.setattr("infra.stack.Stack.up", _refuse)
    monkeypatch.setattr("polarstream.driver.processes.Processes.start", _refuse)
    tb2_task(tmp_path / "tasks", "no-dockerfile", image="polarstream-fixture/never-published:1", dockerfile=None)
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump({"model": str(ensure_model("tiny")), "train": "tasks", "eval": ""}))
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.output
    assert r.stderr.startswith(f"error: {f}: train: task no-dockerfile: cannot pull polarstream-fixture/never-published:1 ("), r.stderr
    assert not (tmp_path / "run").exists()
    # force_build as the experiment file says it, on the source: this task has nothing to build
    f.write_text(yaml.safe_dump({"model": str(ensure_model("tiny")), "train": "tasks?force_build=1", "eval": ""}))
    r = CliRunner().invoke(app, ["run", str(f), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and r.stderr == (f"error: {f}: train: task no-dockerfile: force_build: it has no "
                                             "environment/Dockerfile to build\n"), r.output


# --------------------------------------------------------------------------------- podman, sessions


@podman
def test_a_tb2_shaped_task_with_no_registry_is_built_said_once_and_scores_its_oracle(tmp_path, podman_base, caplog):
    tb2_task(tmp_path, "tb2-shaped", image="polarstream-fixture/never-published:1")
    with caplog.at_level(logging.WARNING, logger="polarstream.node"):
        r = CliRunner().invoke(app, ["tasks", str(tmp_path), "--check"])
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0].split()
    assert header == ["task", "solution", "untouched", "build", "s", "run", "s", "image", "verifier", "net", "verdict"], r.stdout
    row = _rows(r.stdout)["tb2-shaped"]
    # no allow_internet key: Harbor's default, the verifier goes outside (the agent does not)
    assert (row[1], row[2], row[6], row[7]) == ("1", "0", "outside", "ok"), row
    # built from its Dockerfile, as no registry answers here (or, where Docker Hub answers, it has no such image)
    assert row[5].startswith(("built:unreachable", "built:absent")), row
    said = [rec.getMessage() for rec in caplog.records if "instead of pulling" in rec.getMessage()]
    # two sessions (untouched, solved) and one line: which task, what it did not pull, why
    assert len(said) == 1 and said[0].startswith("task tb2-shaped: building environment/Dockerfile instead of pulling "
                                                 "docker.io/polarstream-fixture/never-published:1 ("), said
    storage = [rec for rec in caplog.records if "storage limits" in rec.getMessage()]
    enforced = bool(asyncio.run(ContainerRuntime()._storage_opt(10240)))
    assert len(storage) == (0 if enforced else 1), storage  # one for the run's two sessions
    r = CliRunner().invoke(app, ["tasks", str(tmp_path), "--check", "--force-build"])
    assert r.exit_code == 0, r.output
    row = _rows(r.stdout)["tb2-shaped"]
    assert (row[1], row[2], row[7]) == ("1", "0", "ok") and row[5].startswith("built:force_build"), row


@podman
async def test_a_storage_limit_this_storage_cannot_enforce_is_one_warning_and_the_sessions_run(tmp_path, podman_base, caplog):
    task, = load_tasks(tb2_task(tmp_path, "storage", dockerfile=f"FROM {podman_base}\nWORKDIR /app\nRUN echo hi > f\n"))
    assert task.environment.storage_mb == 10240 and task.environment.memory_mb == 2048
    rt = ContainerRuntime(None, owner=str(tmp_path))

    async def session(root: Path) -> None:
        box = await rt.open(task, root)
        try:
            ran = await box.run(ExecSpec(argv=["cat", "f"], env={"PATH": "/usr/bin:/bin"}, workspace=root / "w",
                                         home=root / "home", limits=Limits(timeout_s=30), network="none",
                                         log_path=root / "run.log"))
            assert ran.returncode == 0 and "hi" in ran.output_tail
        finally:
            await box.close()

    with caplog.at_level(logging.WARNING, logger="polarstream.node"):
        await asyncio.gather(session(tmp_path / "s0"), session(tmp_path / "s1"))  # opening at once, as a node's do
        await session(tmp_path / "s2")
    warned = [rec.getMessage() for rec in caplog.records if "storage limits" in rec.getMessage()]
    if rt._storage_quota:  # a machine whose storage enforces it: no warning
        assert warned == []
    else:
        assert len(warned) == 1 and "advisory" in warned[0], warned


# ------------------------------------------------------------------------ a registry that answers


@pytest.fixture
def local_registry(tmp_path, monkeypatch):
    """Docker's registry (Debian's docker-registry) on a free port of 127.0.0.1, plain HTTP, which podman is
    told to accept (registries.conf ``insecure``, as a site mirror's would be); its host:port."""
    import shutil
    import socket
    import subprocess

    exe = shutil.which("docker-registry")
    if exe is None:
        pytest.skip("docker-registry is not installed (Debian: apt-get install docker-registry)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{s.getsockname()[1]}"
    conf = tmp_path / "registry.yml"
    conf.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'registry'}\nhttp:\n  addr: {host}\n")
    (tmp_path / "registries.conf").write_text(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n')
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(tmp_path / "registries.conf"))
    proc = subprocess.Popen([exe, "serve", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", int(host.split(":")[1]))) == 0:
                    break
            time.sleep(0.05)
        yield host
    finally:
        proc.terminate()
        proc.wait()


def _podman(*args: str) -> str:
    import subprocess

    from gateway.runtimes.images import engine_argv

    return subprocess.run([*engine_argv("podman"), *args], check=True, capture_output=True, text=True).stdout


@podman
async def test_an_image_its_registry_has_is_pulled_and_force_build_builds_the_dockerfile_instead(tmp_path, podman_base,
                                                                                                 local_registry, caplog):
    published = f"{local_registry}/polar-fixture/prebuilt:1"
    # the "prebuilt" image holds what the Dockerfile does not, so the session shows which one it runs in
    ctx = tmp_path / "prebuilt"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {podman_base}\nWORKDIR /app\nRUN echo from-registry > /app/origin\n")
    _podman("build", "-q", "-t", published, str(ctx))
    _podman("push", "-q", published)
    _podman("rmi", published)  # gone from the store: only the registry has it
    dockerfile = f"FROM {podman_base}\nWORKDIR /app\nRUN echo from-dockerfile > /app/origin\n"
    task, = load_tasks(tb2_task(tmp_path, "prebuilt-task", image=published, dockerfile=dockerfile))
    rt = ContainerRuntime(None, owner=str(tmp_path))

    async def origin(t, root: Path) -> str:
        box = await rt.open(t, root)
        try:
            ran = await box.run(ExecSpec(argv=["cat", "/app/origin"], env={"PATH": "/usr/bin:/bin"}, workspace=root / "w",
                                         home=root / "home", limits=Limits(timeout_s=30), network="none",
                                         log_path=root / "run.log"))
            return ran.output_tail.strip()
        finally:
            await box.close()

    try:
        assert (await plan_image(task.environment)).label() == "pulled"
        with caplog.at_level(logging.WARNING, logger="polarstream.node"):
            assert await origin(task, tmp_path / "s1") == "from-registry"
            assert not [r for r in caplog.records if "instead of pulling" in r.getMessage()]
            assert (await plan_image(task.environment)).label() == "local"  # pulled once, then found
            forced, = load_tasks(f"{tmp_path / 'prebuilt-task'}?force_build=1")
            assert (await plan_image(forced.environment)).label().startswith("built:force_build")
            assert await origin(forced, tmp_path / "s2") == "from-dockerfile"
        said = [r.getMessage() for r in caplog.records if "instead of pulling" in r.getMessage()]
        assert said == [f"task prebuilt-task: building environment/Dockerfile instead of pulling {published} (force_build)"]
    finally:
        _podman("rmi", "-i", published)
