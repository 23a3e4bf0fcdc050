"""Interleaved rounds: the one way a benchmark compares targets on a shared, noisy machine.

    from bench._rounds import interleaved
    res = interleaved({"ours": run_ours, "peer": run_peer}, rounds=5, cpu_floor=1.5, threads=2)

Each round runs every target once, in the same order (A B A B ...), so a load change hits all targets
alike instead of whichever ran last. Around every pass it measures wall time and CPU time (this process
and its waited-for children), so a pass that got little CPU (``cpu_per_wall < cpu_floor``) is flagged
and re-run, up to ``retries`` times; the flag stays in the record either way. Load average is recorded
before and after. A target callable runs one pass and returns a dict of its own metrics (deterministic
work counts such as tokens fed, or a latency distribution); the last pass's dict is kept as
``metrics``, and every pass's dict is kept under ``passes``.

Servers a benchmark started (an engine, a gateway, a broker) are neither this process nor its waited-for
children, so their CPU is invisible to getrusage: pass ``cpu_pids`` (a callable returning their pids) and
their CPU time, read from /proc, counts in each pass's ``cpu_s`` too.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any


def set_threads(n: int) -> int:
    """Fix the intra-op thread count for this process (torch, OpenMP, MKL) and its children."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:  # a benchmark without torch still gets the environment for its children
        pass
    return n


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def _cpu_s() -> float:
    self_, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def proc_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, threads included) of other processes, from /proc; gone ones count 0."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


def timed(fn: Callable[[], dict | None], cpu_pids: Callable[[], list[int]] | None = None) -> dict:
    """One pass: ``fn``'s own metrics plus ``wall_s``, ``cpu_s`` and ``cpu_per_wall``."""
    pids = cpu_pids() if cpu_pids else []
    c0, t0 = _cpu_s() + proc_cpu_s(pids), time.perf_counter()
    metrics = fn() or {}
    wall, cpu = time.perf_counter() - t0, _cpu_s() + proc_cpu_s(pids) - c0
    return {**metrics, "wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall if wall > 0 else 0.0}


def summary(values: list[float]) -> dict[str, float]:
    """min, median, max and spread (max / min) of a list of positive numbers."""
    lo, hi = min(values), max(values)
    return {"min": lo, "median": statistics.median(values), "max": hi, "spread": hi / lo if lo > 0 else None, "n": len(values)}


def interleaved(
    targets: dict[str, Callable[[], dict | None]],
    rounds: int = 3,
    *,
    cpu_floor: float = 0.0,
    retries: int = 2,
    threads: int | None = None,
    warmup: bool = False,
    progress: bool = True,
    cpu_pids: Callable[[], list[int]] | None = None,
) -> dict[str, Any]:
    """Run every target ``rounds`` times in A B A B order; see the module docstring.

    Returns ``{"rounds", "order", "threads", "cpu_floor", "load_avg": {"before", "after"},
    "targets": {name: {"wall_s": summary, "cpu_per_wall": summary, "flagged": n, "reruns": n,
    "metrics": last pass's dict, "passes": [every kept pass]}}}``.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if threads is not None:
        set_threads(threads)
    names = list(targets)
    if warmup:  # one untimed pass each: imports, allocator and caches settle before anything counts
        for name in names:
            targets[name]()
    before = load_avg()
    kept: dict[str, list[dict]] = {n: [] for n in names}
    flagged = dict.fromkeys(names, 0)
    reruns = dict.fromkeys(names, 0)
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("interleaved rounds", total=rounds * len(names))
    try:
        for r in range(rounds):
            for name in names:
                if bar:
                    bar.update(task, description=f"round {r + 1}/{rounds}: {name}")
                p = timed(targets[name], cpu_pids)
                tries = 0
                while cpu_floor and p["cpu_per_wall"] < cpu_floor and tries < retries:
                    flagged[name] += 1
                    reruns[name] += 1
                    tries += 1
                    p = timed(targets[name], cpu_pids)
                p["round"] = r
                p["low_cpu"] = bool(cpu_floor and p["cpu_per_wall"] < cpu_floor)
                flagged[name] += int(p["low_cpu"])
                kept[name].append(p)
                if bar:
                    bar.advance(task)
    finally:
        if bar:
            bar.stop()
    out: dict[str, Any] = {
        "rounds": rounds, "order": names, "threads": threads, "cpu_floor": cpu_floor,
        "load_avg": {"before": before, "after": load_avg()}, "targets": {},
    }
    for name in names:
        passes = kept[name]
        out["targets"][name] = {
            "wall_s": summary([p["wall_s"] for p in passes]),
            "cpu_per_wall": summary([p["cpu_per_wall"] for p in passes]),
            "flagged": flagged[name], "reruns": reruns[name],
            "metrics": {k: v for k, v in passes[-1].items() if k not in ("wall_s", "cpu_s", "cpu_per_wall", "round", "low_cpu")},
            "passes": passes,
        }
    return out
