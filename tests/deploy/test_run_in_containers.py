"""Issue 75's run across containers: ``polarstream run examples/arith.yaml --launcher podman`` with a trainer of
2 machines (torchrun, one rank each, gloo), every part of the run in its own container of the project image on
one network (polarstream/driver/containers.py). It learns to the demo's bars; a trainer container, SIGKILLed
mid-step, restarts and the trainer resumes (every step trained once, none twice); a gateway node's container,
killed, leaves its sessions to the other node and the run loses nothing. Marked ``containers``: longer than
`make test` allows (`make containers-test`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.runtimes.images import engine_argv

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.containers, pytest.mark.slow]


def _podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*engine_argv("podman"), *args], capture_output=True, text=True, timeout=120)


def _trainer_steps(prefix: str) -> list[dict]:
    """The trainer's step records so far, read in its first container (rank 0's disk)."""
    out = _podman("exec", f"{prefix}-trainer-1", "cat", "/var/lib/polarstream/run/trainer/train.jsonl")
    return [json.loads(line) for line in out.stdout.splitlines() if '"event": "step"' in line]


def _crash(name: str) -> None:
    """SIGKILL the container's main process from the host, as a crash would (``podman kill`` is a stop to
    podman: the restart policy would not apply)."""
    os.kill(int(_podman("inspect", "--format", "{{.State.Pid}}", name).stdout.strip()), signal.SIGKILL)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


@pytest.mark.timeout(3600)
def test_arith_across_containers_learns_and_outlives_a_killed_trainer_and_gateway_node(tmp_path):
    run_dir, log, exp = tmp_path / "run", tmp_path / "launcher.log", tmp_path / "arith.yaml"
    # the demo's file, its trainer on 2 machines (the launcher puts the rendezvous at trainer-1)
    exp.write_text((ROOT / "examples" / "arith.yaml").read_text() + 'trainer: {nodes: 2, rendezvous: "trainer-1:29400"}\n')
    launcher = subprocess.Popen([sys.executable, "-m", "polarstream", "run", str(exp),
                                 "--launcher", "podman", "--run-dir", str(run_dir)],
                                stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)

    def wait_until(what: str, check, timeout: float = 1800):
        deadline = time.monotonic() + timeout
        while not check():
            assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before {what}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{_tail(log)}"
            time.sleep(2)

    try:
        wait_until("the containers", lambda: (run_dir / "containers.txt").exists(), 1200)  # the image's build first
        prefix = (run_dir / "containers.txt").read_text().strip()
        # rank 1's container, SIGKILLed once step 3 is trained (a checkpoint exists) while step 4's groups come
        # in: rank 0's collective fails, both containers restart (on-failure) and meet at the rendezvous again
        wait_until("step 3", lambda: len(_trainer_steps(prefix)) >= 3)
        _crash(f"{prefix}-trainer-2")
        # a gateway node, killed while the resumed trainer's steps run: its sessions go to the other node
        wait_until("step 6", lambda: len(_trainer_steps(prefix)) >= 6)
        _crash(f"{prefix}-node-2")
        assert launcher.wait(timeout=2400) == 0, _tail(log)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=120)
    assert not _podman("ps", "-a", "--filter", f"label=io.polarstream.run={prefix}", "-q").stdout.strip()  # all removed

    summary = json.loads((run_dir / "driver" / "demo-summary.json").read_text())
    assert summary["learned"], {k: summary[k] for k in ("bars", "reward_per_step", "heldout_before", "heldout_after")}
    # every step trained once, none twice, across the trainer's restart: its own records, copied out of it
    steps = [json.loads(line) for line in (run_dir / "trainer" / "train.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert sorted(s["step"] for s in steps) == list(range(1, 25))
    groups = [g for s in steps for g in s["groups"]]
    assert len(groups) == len(set(groups)) == 24 * 4, "a group trained twice, or one missing"
    # the killed node's sessions: node-1 ends holding every partition of polar.sessions (the group's cooperative
    # rebalance: each line is what it gained or gave up)
    held: dict[str, set[int]] = {"node-1": set(), "node-2": set()}
    everything: set[int] = set()
    for host in held:
        for line in (run_dir / f"{host}.log").read_text().splitlines():
            for word, change in (("assigned partitions", set.update), ("revoked partitions", set.difference_update)):
                if word in line:
                    parts = set(json.loads(line.rsplit(word, 1)[1]))
                    change(held[host], parts)
                    everything |= parts
    assert everything and held["node-1"] == everything, f"node-1 ends with {held['node-1']}, not all of {everything}"
