"""The ``subprocess`` runtime: the program runs directly on the host (trusted local use only).

It gets its private HOME and the workspace as cwd, and the same prlimit limits as the sandbox, but it
shares the host's filesystem and network: use ``bwrap`` for anything you do not trust.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .base import HostSandbox, ExecResult, ExecSpec, RuntimeUnavailable, prlimit_argv, run_process


class SubprocessRuntime(HostSandbox):
    name = "subprocess"

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return str(spec_workspace)

    def home_view(self, spec_home: Path) -> str:
        return str(spec_home)

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{gateway_port}"

    def command(self, spec: ExecSpec) -> list[str]:
        """prlimit prefix + argv."""
        return [*prlimit_argv(spec.limits), *spec.argv]

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run on the host with the spec's environment only (nothing inherited from the node)."""
        if spec.mount or spec.mounts:
            wanted = ", ".join(filter(None, [spec.mount, *spec.mounts]))
            raise RuntimeUnavailable(f"subprocess: cannot show directories at {wanted} (no sandbox); use --runtime bwrap")
        return await run_process(self.command(spec), spec.env, spec.workspace, spec.limits.timeout_s, spec.log_path)
