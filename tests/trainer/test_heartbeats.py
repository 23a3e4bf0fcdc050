"""Two real gloo processes: while rank 0 waits for data, its heartbeats keep rank 1's broadcast from
timing out (issue 6: a rank must never sit in one collective for as long as Kafka stays quiet)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# argv: ready-file prefix, dist timeout (s), rank 0's wait (s), heartbeat interval (s)
_RANK = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from trainer.train import _broadcast_step, _with_heartbeats
prefix, timeout, wait, every = sys.argv[1], *map(float, sys.argv[2:5])
rank = int(os.environ["RANK"])
open(f"{prefix}{rank}", "w").close()  # start the clock only once both ranks have imported torch
while not all(os.path.exists(f"{prefix}{r}") for r in (0, 1)):
    time.sleep(0.02)
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
payload = _with_heartbeats(lambda: (time.sleep(wait), ("samples", 7))[1], True, every) if rank == 0 else None
got = _broadcast_step(payload, True)
print("GOT", rank, got, flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(tmp_path, timeout_s: float, wait_s: float, every_s: float) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = [str(tmp_path / "ready-"), str(timeout_s), str(wait_s), str(every_s)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, *args], env={**env, "RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    deadline = time.monotonic() + 120
    try:
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_heartbeats_carry_a_wait_longer_than_the_collective_timeout(tmp_path):
    ranks = _run_pair(tmp_path, timeout_s=3, wait_s=5, every_s=0.5)
    for r, p in enumerate(ranks):
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"GOT {r} ('samples', 7)" in p.stdout


def test_without_heartbeats_the_waiting_rank_times_out(tmp_path):
    # the control: one heartbeat interval longer than the timeout is what the trainer had before
    ranks = _run_pair(tmp_path, timeout_s=3, wait_s=5, every_s=60)
    assert ranks[1].returncode != 0 and "GOT 1" not in ranks[1].stdout
    assert "timed out" in ranks[1].stderr.lower() or "timeout" in ranks[1].stderr.lower(), ranks[1].stderr[-3000:]
