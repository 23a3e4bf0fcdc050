"""The verifier's network and what the agent leaves behind, on real podman containers through a node's pipeline:
the agent's phase cannot reach the outside, the verifier's can (apt-get update against Debian's archive);
what the agent started is gone before the verifier (kill) or still there (keep); and a verifier whose
install cannot reach its host is an infra error (masked, counted, its evidence recorded), never a 0."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from gateway.node import metrics as node_metrics
from gateway.node.config import NodeConfig
from gateway.node.pipeline import Pipeline
from gateway.node.session import Job
from gateway.runtimes import ContainerRuntime
from schemas import EnvironmentSpec, EvaluatorSpec, HarnessSpec, SessionAssigned, TaskRequest, Timeouts, WorkspaceSpec
from tests.node.test_podman import fake_gateway

import pytest

pytestmark = pytest.mark.integration

DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\n"
# The agent starts a server-like process and leaves it, and tries the outside world.
AGENT = ("sleep 1000 >/dev/null 2>&1 & "
         "if getent hosts deb.debian.org; then echo agent-reached; else echo agent-refused; fi")
# A TB 2.0-shaped verifier: it lists what runs beside it, installs from the network, and writes 1 or 0.
TEST_SH = """\
for p in /proc/[0-9]*; do tr '\\0' ' ' < "$p/cmdline" 2>/dev/null; echo; done > /logs/verifier/procs.txt
apt-get update
if apt-cache show curl > /dev/null; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def container_job(i: int, *, verifier_network: str = "host", agent_processes: str = "kill") -> Job:
    task = TaskRequest(task_id="net", instruction="x", num_samples=8, min_valid=1,
                       workspace=WorkspaceSpec(kind="image", mount="/app"),
                       environment=EnvironmentSpec(context={"Dockerfile": DOCKERFILE}),
                       harness=HarnessSpec(name="command", command=["sh", "-c", AGENT]),
                       evaluator=EvaluatorSpec(kind="harbor", command="bash /tests/test.sh", tests={"test.sh": TEST_SH},
                                               network=verifier_network, agent_processes=agent_processes, timeout_s=240),
                       timeouts=Timeouts(init_s=120, agent_s=60))
    a = SessionAssigned(session_id=f"net.s{i}", group_id="net", task_id="net", sample_index=i, session_key="k", task=task)
    return Job(assigned=a, attempt=0, key="k")


async def test_the_agent_is_offline_the_verifier_online_leftovers_killed_or_kept_and_a_verifier_fault_masked(
        tmp_path, podman_base):
    server, relay, sock, port = await fake_gateway(tmp_path)
    events: list = []

    async def publish(ev):
        events.append(ev)

    async def settle(run_id):
        return 0

    cfg = NodeConfig(work_dir=tmp_path / "node", cache_dir=tmp_path, runtime="podman", node_id="vnet", run_workers=3,
                     keep_workdirs=True)
    rt = ContainerRuntime(sock, owner=str(tmp_path))
    p = Pipeline(cfg, rt, port, publish, settle)
    node_metrics.watch(p)
    try:
        p.admit(container_job(0))
        p.admit(container_job(1, agent_processes="keep"))
        p.admit(container_job(2, verifier_network="none"))  # its install cannot reach the archive
        await p.drain()
    finally:
        server.close()
        relay.close()
        await rt.cleanup()
    fin = {e.session_id: e for e in events if e.kind == "finished"}
    sessions = cfg.work_dir / "sessions"
    for sid in fin:
        assert "agent-refused" in (sessions / sid / "logs" / "harness.log").read_text()  # the agent had no outside

    # the verifier reached Debian's archive; the agent's sleep was killed before it (kill) or left (keep)
    assert (fin["net.s0"].status, fin["net.s0"].reward, fin["net.s0"].verifier_fault) == ("ok", 1.0, None), fin["net.s0"]
    assert (fin["net.s1"].status, fin["net.s1"].reward) == ("ok", 1.0), fin["net.s1"]
    killed = (sessions / "net.s0" / "eval" / "eval-logs" / "procs.txt").read_text()
    kept = (sessions / "net.s1" / "eval" / "eval-logs" / "procs.txt").read_text()
    assert "sleep 1000" not in killed and "bash /tests/test.sh" in killed
    assert "sleep 1000" in kept

    # a verifier that could not install is masked with its cause and lines, and counted; it is not a 0
    bad = fin["net.s2"]
    assert bad.status == "infra_error" and bad.reward is None
    assert bad.verifier_fault is not None and bad.verifier_fault.cause == "dns", bad
    assert any("deb.debian.org" in line for line in bad.verifier_fault.evidence)
    assert "verifier fault (dns)" in bad.detail and bad.metrics["verifier_fault"] == 1.0
    assert not [e for e in events if e.session_id == "net.s2" and e.kind == "evaluated"]
    assert p.verifier_faults == {"dns": 1}
    exposed = generate_latest(REGISTRY).decode()
    assert 'polar_node_verifier_faults_total{cause="dns",node="vnet"} 1.0' in exposed
    # each session's stages, timed: on its finished event, and summed in the node's metrics
    for stage in ("open", "run", "verify", "close"):
        assert f'polar_node_stage_sessions_total{{node="vnet",sandbox="podman",stage="{stage}"}} 3.0' in exposed
    for e in fin.values():  # the verifier's parts too: its network set, its files in and back in one exec
        assert {"open_s", "run_s", "eval_s", "verify_network_s", "verify_exec_s"} <= set(e.metrics), e.metrics
        assert e.metrics["verify_exec_s"] <= e.metrics["eval_s"]


# Terminal-Bench 2.0's verifier prelude, in its shape (our own words): install curl, fetch uv, run pytest with uvx.
TB_TEST_SH = """\
#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
uvx -p 3.13 -w pytest==8.4.1 pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def test_tasks_check_names_a_verifier_that_could_not_install_instead_of_scoring_it_0(tmp_path, podman_base):
    from typer.testing import CliRunner

    from polarstream.cli import app

    d = tmp_path / "offline-verifier"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Create /app/done.\n")
    (d / "task.toml").write_text("[environment]\nallow_internet = false\n")  # Harbor gives its verifier none either
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (d / "tests" / "test.sh").write_text(TB_TEST_SH)
    (d / "tests" / "test_outputs.py").write_text("import os\n\ndef test_done():\n    assert os.path.exists('/app/done')\n")
    (d / "solution" / "solve.sh").write_text("touch /app/done\n")
    r = CliRunner().invoke(app, ["tasks", str(d), "--check"])
    assert r.exit_code == 1, r.output
    header, row = r.stdout.splitlines()[:2]
    assert "verifier net" in header
    solution, untouched = row.split()[1:3]
    assert (solution, untouched) == ("error", "error"), row  # not 0: the verifier never judged
    assert " none " in row and "untouched: verifier fault (dns):" in row and "deb.debian.org" in row, row


def test_tasks_check_kills_what_the_solution_left_running_unless_told_to_keep_it(tmp_path, podman_base):
    from typer.testing import CliRunner

    from polarstream.cli import app

    d = tmp_path / "serve"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Leave a server running.\n")
    (d / "task.toml").write_text("[environment]\nallow_internet = false\n")
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (d / "tests" / "test.sh").write_text(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < \"$p/cmdline\" 2>/dev/null; echo; done | grep -q '^sleep 1000 ' "
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    (d / "solution" / "solve.sh").write_text("sleep 1000 >/dev/null 2>&1 &\n")
    killed = CliRunner().invoke(app, ["tasks", str(d), "--check"])
    kept = CliRunner().invoke(app, ["tasks", str(d), "--check", "--agent-processes", "keep"])
    assert killed.exit_code == 1 and killed.stdout.splitlines()[1].split()[1:3] == ["0", "0"], killed.output
    assert kept.exit_code == 0 and kept.stdout.splitlines()[1].split()[1:3] == ["1", "0"], kept.output
    bad = CliRunner().invoke(app, ["tasks", str(d), "--agent-processes", "some"])
    assert bad.exit_code == 2 and "--agent-processes: 'some' is not kill or keep" in bad.output
