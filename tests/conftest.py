"""Test-wide fixtures live in tests/plugins/<component>.py, one file per owner, loaded here."""

from pathlib import Path

import pytest

pytest_plugins = sorted(
    f"tests.plugins.{p.stem}" for p in (Path(__file__).parent / "plugins").glob("*.py") if p.stem != "__init__"
)

# The modules that took the longest in `make test` (its --durations), longest first. `make test` runs
# pytest-xdist workers with --dist load, which deals the tests out in collection order, round robin at
# first: putting these first starts the long ones at once, on every worker, and the short ones fill in
# (a long test dealt out last leaves the other workers idle while one finishes it). Not --dist loadfile:
# it keys tests by node id, and schemathesis' five tests share one (tests/fuzz), so four never ran.
HEAVY_FIRST = (
    "demo/test_cli_demo.py", "demo/test_learning.py", "infra/test_chaos.py", "demo/test_run_resume.py", "bench/test_bench_shape.py",
    "demo/test_run_harbor.py", "driver/test_preset.py", "engine/test_models.py", "demo/test_run_split.py",
    "trainer/test_fsdp_resume.py",
    "security/test_mirror_cli.py", "rollout/test_cluster.py", "demo/test_demo.py", "streams/test_kill.py",
    "harnesses/test_all_clis.py", "node/test_node_inprocess.py", "streams/test_worker.py", "infra/test_cli.py",
    "fuzz/test_gateway_fuzz.py", "mirror/test_multi_dc.py", "harnesses/test_slow_engine.py", "security/test_secure_e2e.py",
    "infra/test_kafka_cluster.py", "tools/test_tools_kafka.py", "trainer/test_kill.py", "fuzz/test_records_fuzz.py",
    "security/test_kafka_acls.py", "trainer/test_ddp.py", "gateway/test_router.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist, HEAVY_FIRST's modules first, in its order; every other module after, as collected (a
    stable sort). In one process the order is left as collected."""
    if not getattr(config.option, "numprocesses", None):
        return
    root = Path(__file__).parent
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

    def key(item) -> int:
        try:
            return rank.get(str(Path(item.fspath).relative_to(root)), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=key)
