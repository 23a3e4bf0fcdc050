"""A Terminal-Bench 2.0-shaped task on this machine, which reaches PyPI and Debian only through a TLS proxy
whose CA only the host trusts, and reaches neither Docker Hub nor astral.sh (docs/rollout.md, "Air-gapped
sites and TLS proxies"): real podman, real PyPI.

- its ``FROM python:3.13-slim-bookworm`` is met by a Debian trixie stand-in that carries python 3.13 and
  a pip that installs; its ``RUN pip install`` reaches PyPI with the host's CA, and fails without it;
- its unmodified ``tests/test.sh`` (apt-get, astral.sh's installer, ``uvx -p 3.13 -w pytest==8.4.1``)
  scores the solution 1 and the untouched workspace 0, with the uv we bring where astral.sh is unreachable.

The verifier reaches the mirrors on the engine's bridge, the network its phase gets (Harbor's default);
the agent's phase has none but the gateway.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gateway.node.oracle import check_task
from gateway.runtimes import ContainerRuntime, ExecSpec, ImageBuildError, Limits
from gateway.runtimes.images import ensure_image, image_exists
from gateway.runtimes.site import SiteSettings, host_site
from producers.tasks import load_tasks
from schemas import EnvironmentSpec, TaskRequest

pytestmark = pytest.mark.integration

TASK = Path(__file__).parent / "fixtures" / "tb2-uv-verifier"
# {run}: a RUN line of its own each time, so that no layer cached by an earlier build (with or without
# the site's CA) stands in for the install
DOCKERFILE = "FROM python:3.13-slim-bookworm\nWORKDIR /app\nRUN echo {run} && pip install six==1.17.0\n"


@pytest.fixture(scope="module")
def site() -> SiteSettings:
    found = host_site("auto")
    assert found.ca_bundle, "this machine's pip names a CA bundle (pip config list: cert); the test is about it"
    return found


async def _rmi(tag: str) -> None:
    from gateway.runtimes.images import _run, engine_argv

    await _run([*engine_argv("podman"), "rmi", "-f", tag])


async def test_a_python_313_build_installs_from_pypi_through_the_site_ca_and_not_without_it(tmp_path, site):
    env = EnvironmentSpec(context={"Dockerfile": DOCKERFILE.format(run=uuid.uuid4().hex)})
    tag, built_s = await ensure_image(env, "podman", log=tmp_path / "build.log", site=site)
    try:
        assert built_s > 0
        rt = ContainerRuntime(None, owner=str(tmp_path))
        task = TaskRequest(task_id="t", instruction="x", workspace={"kind": "image", "mount": "/app"}, environment=env)
        box = await rt.open(task, tmp_path / "s")
        try:
            spec = ExecSpec(argv=["sh", "-c", "python --version; python -c 'import six; print(six.__version__)'; pip --version; "
                                  "if ls /usr/lib/python3*/EXTERNALLY-MANAGED 2>/dev/null; then echo marked; else echo unmarked; fi"],
                            env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, workspace=tmp_path, home=tmp_path / "s" / "home",
                            limits=Limits(timeout_s=60), network="none", log_path=tmp_path / "run.log")
            ran = await box.run(spec)
        finally:
            await box.close()
        out = ran.output_tail
        assert ran.returncode == 0 and "Python 3.13." in out and "\n1.17.0\n" in out, out
        assert out.rstrip().endswith("unmarked")  # no PEP 668 marker: pip installs as in the registry's python images
    finally:
        await _rmi(tag)
    # the same build with no site settings meets the proxy's certificate and fails, naming its step
    bare = EnvironmentSpec(context={"Dockerfile": DOCKERFILE.format(run=uuid.uuid4().hex)})
    with pytest.raises(ImageBuildError, match=r"STEP 3/\d: RUN echo \w+ && pip install six==1.17.0"):
        await ensure_image(bare, "podman", log=tmp_path / "bare.log", site=SiteSettings())
    assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "bare.log").read_text()


async def test_an_unmodified_tb2_verifier_scores_the_solution_1_and_the_untouched_workspace_0(tmp_path, site):
    (task,) = load_tasks(TASK)
    assert task.environment is not None and task.environment.memory_mb == 2048
    assert not task.environment.allow_internet and task.evaluator.network == "host"  # the agent offline, the verifier not
    rt = ContainerRuntime(None, owner=str(tmp_path))
    result = await check_task(task, rt, tmp_path)
    logs = {k: (tmp_path / k / "eval.log").read_text() for k in ("untouched", "solved")}
    assert result.untouched.reward == 0.0 and result.untouched.error == "", (result.untouched, logs["untouched"][-2000:])
    assert result.solved is not None and result.solved.reward == 1.0, (result.solved, logs["solved"][-2000:])
    solved = logs["solved"]
    assert "astral.sh" in solved and "2 passed" in solved  # the installer found no astral.sh; our uvx ran pytest
    assert "1 failed, 1 passed" in logs["untouched"]  # on python 3.13, as the test asks: only the answer was missing
    assert await rt.cleanup() == 0
    tag = (await ensure_image(task.environment, "podman", site=site))[0]
    assert await image_exists("podman", tag)


async def test_a_stand_in_made_by_an_older_recipe_is_made_again(tmp_path):
    from gateway.runtimes.images import STANDIN_LABEL, _run, engine_argv, recipe_id, stale_standin, standin_recipe

    # a python:3.9 stand-in as the first recipe made them: labelled a stand-in, no recipe label
    name, tar = "docker.io/library/python:3.9-slim-bullseye", tmp_path / "empty.tar"
    assert (await _run(["tar", "-cf", str(tar), "-T", "/dev/null"]))[0] == 0
    if await image_exists("podman", name):
        pytest.skip(f"{name} is present on this machine; the test would replace it")
    try:
        rc, out = await _run([*engine_argv("podman"), "import", "--change", f"LABEL {STANDIN_LABEL}=debian-bullseye-minbase",
                              str(tar), name])
        assert rc == 0, out
        assert await stale_standin("podman", name)
        rc, out = await _run([*engine_argv("podman"), "import", "--change", f"LABEL {STANDIN_LABEL}=debian-bullseye-minbase",
                              "--change", f"LABEL io.polarstream.standin.recipe={recipe_id(standin_recipe(name))}", str(tar), name])
        assert rc == 0, out
        assert not await stale_standin("podman", name)
    finally:
        await _rmi(name)
    assert not await stale_standin("podman", name)  # not there: nothing to make again


@pytest.mark.parametrize("mode", ["auto", "off"])
async def test_pip_in_a_session_container_reaches_pypi_with_the_site_settings_only(tmp_path, site, mode):
    env = EnvironmentSpec(context={"Dockerfile": "FROM python:3.13-slim-bookworm\nWORKDIR /app\n"}, allow_internet=True)
    task = TaskRequest(task_id="t", instruction="x", workspace={"kind": "image", "mount": "/app"}, environment=env)
    box = await ContainerRuntime(None, owner=str(tmp_path), site_settings=mode).open(task, tmp_path / "s")
    try:
        ran = await box.run(ExecSpec(argv=["pip", "download", "--no-deps", "--retries", "0", "-d", "/tmp/dl", "six==1.17.0"],
                                     env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, workspace=tmp_path,
                                     home=tmp_path / "s" / "home", limits=Limits(timeout_s=120), network="none",
                                     log_path=tmp_path / "pip.log"))
    finally:
        await box.close()
    if mode == "auto":
        assert ran.returncode == 0 and "Saved /tmp/dl/six-1.17.0" in ran.output_tail, ran.output_tail
    else:
        assert ran.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in ran.output_tail, ran.output_tail
