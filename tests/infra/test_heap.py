"""freeze_startup_heap: what is alive at start-up leaves the collector's reach; later objects do not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_start_up_objects_leave_the_collector_and_later_ones_stay_in_it():
    # in a child process: freezing is process-wide and would leak into the rest of the test run
    script = textwrap.dedent("""
        import gc
        from infra.heap import freeze_startup_heap
        startup = [[i] for i in range(200_000)]  # a big start-up heap: 200k tracked lists
        frozen = freeze_startup_heap()
        tracked = {id(o) for o in gc.get_objects()}
        later = [[i] for i in range(10)]
        after = {id(o) for o in gc.get_objects()}
        cycle = []; cycle.append(cycle); ref = id(cycle); del cycle  # garbage made after the freeze
        print(frozen >= 200_000, id(startup[0]) in tracked, id(later[0]) in after, gc.collect() >= 1)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "True", "True"]
