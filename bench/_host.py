"""A host-speed index: how fast this machine runs a fixed workload right now, against a reference.

The shared machines here have measured the same code 2-4x apart from one hour to the next, so a figure
means little without the speed of the host when it was taken. ``host_index()`` times two fixed
workloads, pure Python (the interpreter: what the gateway, the stream worker and the publisher's
Python side spend), numpy (BLAS matrix products, one thread: what the engine and the trainer spend) and
memory (a 64 MB array streamed through: batch-1 decode reads every weight for each token), each the
median of a few short repetitions, and divides reference times by them: 1.0 is the reference host
(REFERENCE_S, the 2-core development VM), 0.5 a host running at half its speed. A figure divided by the
index is the figure "per unit of host speed", comparable across runs.

The median, not the best: a first version took the best of 7, which a loaded host still reaches in its
quiet milliseconds (it read 0.9-1.0 while the engine's batch-1 decode ran at half its usual speed), and
it had no memory-bound part, where a busy neighbour shows first.
"""

from __future__ import annotations

import math
import os
import statistics
import time

# Seconds each workload took on the reference host (the median of REPEATS; 2-core dev VM, 2026-12-05).
REFERENCE_S = {"python": 0.080, "numpy": 0.060, "memory": 0.030}
REPEATS = 7


def _python_work() -> int:
    """Integer arithmetic, dict and string work: the interpreter's common paths."""
    d: dict[int, str] = {}
    acc = 0
    for i in range(120_000):
        acc = (acc * 31 + i) % 1_000_003
        d[i & 1023] = str(acc)
        acc += len(d.get((i * 7) & 1023, ""))
    return acc


def _numpy_work() -> float:
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 256)), rng.standard_normal((256, 256))
    for _ in range(20):
        a = (a @ b) / 256.0
    return float(a[0, 0])


def _memory_work(_buf=[]) -> float:
    """Stream a 64 MB array twice (a copy and a sum): bound by memory bandwidth, not the core."""
    import numpy as np

    if not _buf:
        _buf.append(np.ones(8 * 1024 * 1024))  # 64 MB of float64, allocated once
    a = _buf[0]
    return float((a * 1.0).sum())


def _median_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_index(repeats: int = REPEATS) -> dict:
    """{"python": x, "numpy": y, "memory": z, "index": geometric mean, "seconds": {...}, "load_avg_1m": ...};
    higher is faster."""
    seconds = {"python": _median_of(_python_work, repeats),
               "numpy": _single_thread_blas(lambda: _median_of(_numpy_work, repeats)),
               "memory": _median_of(_memory_work, repeats)}
    ratios = {k: REFERENCE_S[k] / v for k, v in seconds.items()}
    index = math.prod(ratios.values()) ** (1 / len(ratios))
    return {**{k: round(v, 3) for k, v in ratios.items()}, "index": round(index, 3),
            "seconds": {k: round(v, 5) for k, v in seconds.items()}, "load_avg_1m": round(os.getloadavg()[0], 2)}


def _single_thread_blas(fn):
    """Run ``fn`` with BLAS on one thread where threadpoolctl is there (else as the environment set it)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return fn()
    with threadpool_limits(limits=1, user_api="blas"):
        return fn()


if __name__ == "__main__":
    import json

    print(json.dumps(host_index()))
