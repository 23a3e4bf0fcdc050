"""A real Slurm cluster of one node, this machine: munged, slurmctld and slurmd started from Debian's
``slurm-wlm`` and ``munge`` without systemd, each in the foreground under this test session, with a
generated slurm.conf in a directory of their own (state, spool, munge key and socket in it too).

The node is this host as ``slurmd -C`` finds it (its real CPUs and memory); no cgroups (proctrack/linuxproc,
task/none), no accounting, every daemon as root. ``start`` returns once ``sinfo`` shows the node idle;
``stop`` cancels what is left and stops the daemons. Clients (sbatch, srun, squeue, scancel) find the
cluster through ``env`` (SLURM_CONF).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from infra.process import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo")


def missing() -> list[str]:
    """The programs this cluster needs that are not installed (`make system` installs them)."""
    return [p for p in DAEMONS if not shutil.which(p)]


class LocalSlurm:
    def __init__(self) -> None:
        # munged wants its socket's directory open to all (0755), and a socket path under 108 bytes: not
        # pytest's 0700 tmp_path
        self.dir = Path(tempfile.mkdtemp(prefix="polar-slurm-"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env)

    def log(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        d = self.dir
        subprocess.run(["mungekey", "--create", "--keyfile", str(d / "munge.key")], check=True, capture_output=True)
        self._daemon("munged", "munged", "--foreground", f"--socket={d / 'munge.sock'}", f"--key-file={d / 'munge.key'}",
                     f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'munged.file.log'}")
        self._wait("munged's socket", lambda: (d / "munge.sock").exists(), "munged", 20)
        (d / "state").mkdir()
        (d / "spool").mkdir()
        # this host as slurmd sees it: NodeName=... CPUs=... RealMemory=... (the first line)
        hardware = subprocess.run(["slurmd", "-C"], check=True, capture_output=True, text=True).stdout.splitlines()[0]
        hardware = " ".join(f for f in hardware.split() if not f.startswith("NodeName="))
        self.conf.write_text("\n".join([
            "ClusterName=polartest", f"SlurmctldHost={self.node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d / 'munge.sock'}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
            "KillWait=10",  # SIGTERM to SIGKILL when a step is cancelled or the job ends
            f"NodeName={self.node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN",
            f"PartitionName=polar Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._daemon("slurmctld", "slurmctld", "-D", "-c", "-f", str(self.conf))
        self._daemon("slurmd", "slurmd", "-D", "-N", self.node, "-f", str(self.conf))
        self._wait("the node idle in sinfo", self._idle, "slurmctld", timeout)
        return self

    def _idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env)
        return out.returncode == 0 and f"{self.node} idle" in out.stdout

    def _wait(self, what: str, ok, daemon: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) before {what}:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout:.0f}s:\n{self.log(daemon)}\n{self.log('slurmd')}")
            time.sleep(0.5)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scancel, scontrol) against this cluster."""
        return subprocess.run(args, capture_output=True, text=True, env=self.env, check=check)

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 30  # slurmd ends their steps; a daemon stopped first would orphan them
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):  # the node first: it ends its jobs' steps
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
