"""``--cpu N``: the N tests that used the most CPU, and the suite's total.

On a 2-core machine the suite is CPU-bound (issue 60), so wall-clock durations mislead: a test looks slow
because the other workers are busy. CPU seconds are the test's own cost: its process's user + system time
over setup, call and teardown, plus that of the children it reaped (engines, trainers, nodes, CLIs). A
session fixture's children (each worker's broker and S3 server) are reaped at the end and counted in no test.
Under xdist each worker measures its tests and the numbers travel in the reports' user_properties.
"""

from __future__ import annotations

import resource

import pytest

KEY = "cpu_s"


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu", type=int, default=0, metavar="N",
                     help="list the N tests that used the most CPU (own + reaped children), and the total")


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    item._cpu_start = _cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and hasattr(item, "_cpu_start"):
        item.user_properties.append((KEY, round(_cpu() - item._cpu_start, 2)))  # the teardown report carries it
    yield


def pytest_terminal_summary(terminalreporter, config) -> None:
    n = config.getoption("--cpu")
    if not n:
        return
    seen = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) == "teardown":
                for k, v in getattr(r, "user_properties", []):
                    if k == KEY:
                        seen[r.nodeid] = v
    if not seen:
        return
    terminalreporter.write_sep("=", f"most CPU: {n} of {len(seen)} tests, {sum(seen.values()):.0f} CPU-s in all")
    for nodeid, s in sorted(seen.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{s:8.1f}s cpu  {nodeid}")
