"""Test-wide fixtures live in tests/plugins/<component>.py, one file per owner, loaded here."""

import os
from pathlib import Path

# Before anything loads torch (libgomp reads it once): `make test` runs 3 workers on 2 cores, where OpenMP's
# default spin-wait let every waiting torch thread burn its core. Passive waiting took a tiny model's
# training steps from 9-29 CPU-s to 4.3-4.7 under that load (issue 60); it costs nothing on a quiet core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

pytest_plugins = sorted(
    f"tests.plugins.{p.stem}" for p in (Path(__file__).parent / "plugins").glob("*.py") if p.stem != "__init__"
)

# The tests that took the longest in `make test` on a new machine (.ci/run: empty model cache), with their
# seconds there (issue 60's run, 924 s; a prefix of a node id, its seconds shared by the tests it names).
# `make test` runs pytest-xdist's --dist load: it hands each worker a block of consecutive tests first
# (a quarter of its share: ~140 of 1700) and deals out the rest as workers run dry, never taking back what
# it handed out. In the order as collected, one block held all of tests/demo and the preset run (~715 s
# of these, one after another on one worker: the suite's critical path). So each worker's first block
# starts with its share of these, split longest first onto the least loaded block, and is filled up with
# the next tests as collected; the rest follow as collected. Not --dist loadfile: it keys tests by node
# id, and schemathesis' five tests share one (tests/fuzz), so four never ran.
HEAVY = {
    "demo/test_cli_demo.py": 283, "infra/test_chaos.py": 150, "demo/test_learning.py::test_learning_stays_learned": 128,
    "demo/test_run_resume.py": 79, "security/test_mirror_cli.py": 62, "demo/test_run_harbor.py": 61,
    "engine/test_models.py::test_smollm2": 57, "driver/test_preset.py::test_a_preset_of_your_own_runs_end_to_end": 57,
    "demo/test_demo.py": 55, "demo/test_run_split.py": 51, "trainer/test_fsdp_resume.py": 48,
    "rollout/test_cluster.py": 74, "bench/test_bench_shape.py": 61, "node/test_node_inprocess.py::test_cancel": 36,
    "harnesses/test_all_clis.py": 36, "streams/test_worker.py::test_changelogs": 35, "mirror/test_multi_dc.py": 35,
    "streams/test_kill.py": 34, "harnesses/test_family_clis.py": 33, "harnesses/test_slow_engine.py": 27,
    "security/test_secure_e2e.py": 26, "trainer/test_kill.py": 30, "fuzz/test_gateway_fuzz.py": 30,
    "gateway/test_router.py": 25, "demo/test_learning.py::test_the_recorded_collapse": 9,
    # issue 62's and 63's, with their seconds alone under a load of 10-30 (not yet from a cold suite run)
    "demo/test_run_image_tasks.py": 70, "node/test_podman_node.py": 60, "node/test_terminal_examples.py": 55,
    "trainer/test_broadcast_sync.py": 45, "harnesses/test_clis_in_containers.py": 30, "engine/test_weight_transfer.py": 20,
    "node/test_podman.py": 12,
    # issue 73's: the vLLM peer's import is most of them (alone, load ~7)
    "engine/test_vllm_routes.py": 65, "engine/test_vllm_oracle.py": 60, "trainer/test_vllm_api.py": 40,
    "engine/test_shutdown.py": 15,
    # issue 76's: two short runs through sbatch on a one-node Slurm cluster, the second of 2 trainer ranks (load ~13)
    "deploy/test_slurm_run.py": 245,
}


def _workers(config) -> int:
    """The number of xdist workers when this process is one of them, else 0. (A worker's own
    ``numprocesses`` is None: xdist clears it there, and workers are where the tests are collected.)"""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput:
        return 0
    argv = " ".join(workerinput.get("mainargv", []))
    if any(f"--dist {m}" in argv or f"--dist={m}" in argv for m in ("loadscope", "loadfile", "loadgroup", "worksteal")):
        return 0  # the blocks below are --dist load's
    return int(workerinput.get("workercount", 0))


def layout(names: list[str], workers: int) -> list[int]:
    """The order (indices into ``names``, node ids relative to tests/) in which --dist load's first blocks
    give each of ``workers`` workers an even share of HEAVY's seconds, longest first."""
    weight = {}
    for prefix, seconds in HEAVY.items():
        hits = [i for i, n in enumerate(names) if n.startswith(prefix) and i not in weight]
        for i in hits:
            weight[i] = seconds / len(hits)
    # xdist.scheduler.load.LoadScheduling.schedule: blocks of this many, one per worker, in worker order
    block = max(len(names) // workers // 4, 2) if len(names) >= 2 * workers else 1
    bins: list[list[int]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for i in sorted(weight, key=lambda i: (-weight[i], i)):
        w = min((w for w in range(workers) if len(bins[w]) < block), key=lambda w: load[w], default=None)
        if w is None:
            break
        bins[w].append(i)
        load[w] += weight[i]
    placed = {i for b in bins for i in b}
    light = [i for i in range(len(names)) if i not in placed]
    if block == 1:  # dealt one at a time, round robin: the heaviest first
        return sorted(placed, key=lambda i: -weight[i]) + light
    order = []
    for b in bins:
        fill, light = light[: block - len(b)], light[block - len(b):]
        order += b + fill
    return order + light


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """In an xdist worker, HEAVY's tests spread over the workers' first blocks (``layout``); in one process
    the order is left as collected."""
    workers = _workers(config)
    if not workers or not items:
        return
    root = Path(__file__).parent

    def name(item) -> str:
        try:
            return str(Path(item.path).relative_to(root)) + item.nodeid[len(item.nodeid.split("::")[0]):]
        except ValueError:
            return item.nodeid

    items[:] = [items[i] for i in layout([name(it) for it in items], workers)]
