"""Two regions mirrored into one center by MirrorMaker 2: the central groups are exactly the expected ones.

Every group has samples in both regions (samples 0-1 recorded in eu, the others in us or at the center
itself), so a group can only be complete at the center when both regions' mirrors delivered. The expected groups are derived
offline with the streams' own pure functions from the recorded sessions; the live worker at the center
must emit those, byte for byte after deduplication by event_id, whatever the mirrors re-sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from infra.mirror import flow_metrics, flows_of, parse_properties
from infra.settings import Settings
from schemas import CallRecorded, PolicyVersion, SessionEvent, TrainingGroup, decode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.synthetic import record_group
from streams.trajectory import build_trajectory
from tests.streams.helpers import WorkerProcess, dedupe, publish, read_topic

from .conftest import CENTER

pytestmark = pytest.mark.integration

ARGS = ["--tick-interval", "0.5", "--stats-interval", "1", "--session-timeout", "6"]


def recorded(groups: int, tag: str):
    """The sessions of ``groups`` groups of 4 samples each."""
    return [record_group(f"{tag}{g}", [float(g % 2), 1.0, 0.0, 0.5], seed=g, turns=3, side_call_at=1)
            for g in range(groups)]


def records_in(data, cluster: str, placement) -> list:
    """The records of every session that ``placement`` (cluster per sample index) puts in ``cluster``."""
    return [r for sessions in data for i, s in enumerate(sessions) if placement[i] == cluster for r in s.records]


def expected_group(sessions, config: StreamsConfig) -> TrainingGroup:
    """What a single-cluster run makes of these sessions (pure functions, no Kafka)."""
    members = [build_trajectory(s.finished, [CallTokens.from_record(c) for c in s.calls], config) for s in sessions]
    return build_group(sessions[0].finished.group_id, members, config)


def read_at_least(settings, topic: str, n: int):
    """A topic from the start once it holds ``n`` messages, plus a second for stragglers."""
    return read_topic(settings, topic, until=lambda m: len(m) >= n, timeout=30, idle=1.0)


def distinct_keys(n):
    return lambda msgs: len({m.key for m in msgs}) >= n


def assert_exact(msgs, data) -> int:
    """Deduplicated central groups equal the expected ones; returns the raw duplicate count."""
    got, dups = dedupe(msgs, TrainingGroup)
    want = {g.event_id: g for g in (expected_group(s, StreamsConfig()) for s in data)}
    assert set(got) == set(want), f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}"
    for event_id, raw in got.items():
        assert decode(raw, TrainingGroup) == want[event_id]
    return dups


def mirror_flows(mm):
    """The flows the mirror's properties file describes."""
    return flows_of(parse_properties(mm.config_file.read_text()))


def wait_lag_zero(mm, timeout: float = 30.0) -> list[dict]:
    """Flow metrics once every flow of ``mm`` reports no lag."""
    flows = mirror_flows(mm)
    deadline = time.monotonic() + timeout
    while True:
        metrics = [flow_metrics(f, window_s=0) for f in flows]
        if all(m.get("lag") == 0 for m in metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def cli_json(*args: str, data_dir, prefix: str) -> dict:
    env = {**os.environ, "POLAR_DATA_DIR": str(data_dir), "POLAR_TOPIC_PREFIX": prefix}
    res = subprocess.run([sys.executable, "-c", "from polarstream.cli import main; main()", "infra", *args],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def start(dcs, prefix, tmp_path, center, flush_ms=None):
    """Both regions' mirrors and a stream worker at the center, the three JVM/Python starts overlapping."""
    flush_ms = flush_ms or {}
    mirrors = {r: dcs.mirror(r, prefix, tmp_path / "mirror", flush_ms.get(r, 1000)) for r in ("eu", "us")}
    worker = WorkerProcess(center.model_copy(update={"data_dir": tmp_path / "worker"}), tmp_path / "worker.log", ARGS)
    try:
        for mm in mirrors.values():
            mm.launch()
        worker.start()
        for mm in mirrors.values():
            mm.wait_ready(120)
    except BaseException:
        stop(mirrors, worker)
        raise
    return mirrors, worker


def stop(mirrors, worker) -> None:
    worker.stop()
    for mm in mirrors.values():
        mm.stop()


def test_two_regions_one_center_exact_groups(dcs, tmp_path, record_property):
    prefix = dcs.fresh_prefix()
    us, center = dcs.settings("us", prefix), dcs.settings(CENTER, prefix)
    # eu's recorder is configured as a gateway node would be: by its home cluster alone.
    eu = Settings(data_dir=dcs.base.data_dir, home_cluster="eu", topic_prefix=prefix)
    assert eu.kafka_bootstrap == dcs.clusters["eu"].kafka.bootstrap
    data = recorded(6, "a")
    placement = ("eu", "eu", "us", CENTER)  # the center records sessions of its own too
    mirrors, worker = start(dcs, prefix, tmp_path, center)
    try:
        # us records as an earlier build did (JSON), eu and the center packed: mirrored bytes, read alike
        for name, settings in (("eu", eu), ("us", us.model_copy(update={"record_format": "json"})), (CENTER, center)):
            publish(settings, records_in(data, name, placement))
        # Policy versions flow the other way: published at the center, they reach both regions.
        policy = PolicyVersion(model="m", version=1, checkpoint_url="s3://polarstream/ckpt/1")
        publish(center, [policy])

        msgs = read_topic(center, "groups", until=distinct_keys(len(data)), timeout=150, idle=2.0)
        assert len({m.key for m in msgs}) == len(data), worker.log_text()[-3000:]
        record_property("raw_duplicate_groups", assert_exact(msgs, data))
        for region in (eu, us):
            got = read_topic(region, "policy", until=lambda m: len(m) >= 1, timeout=60)
            assert [decode(m.value, PolicyVersion) for m in got] == [policy]

        # Every call and session event arrived at the center, and status shows the flows caught up.
        calls, _ = dedupe(read_topic(center, "calls", until=lambda m: len(m) >= 6 * 4 * 4, timeout=30), CallRecorded)
        assert len(calls) == sum(len(s.calls) for ss in data for s in ss)
        metrics = wait_lag_zero(mirrors["eu"])
        up = next(m for m in metrics if m["source"] == "eu")
        assert up["lag"] == 0 and up["topics"][eu.topic("calls")]["mirrored"] == sum(len(s.calls) for ss in data for s in ss[:2])

        # The same numbers through the command line, as metrics (JSON).
        st = cli_json("status", "--json", "--window", "0.5", data_dir=tmp_path / "mirror", prefix=prefix)
        assert {m["name"]: m["running"] for m in st["mirrors"]} == {"eu-center": True, "us-center": True}
        flows = {(f["source"], f["target"]): f for m in st["mirrors"] for f in m["flows"]}
        assert set(flows) == {("eu", "center"), ("center", "eu"), ("us", "center"), ("center", "us")}
        assert flows["eu", "center"]["lag"] == 0 and flows["center", "us"]["topics"][us.topic("policy")]["mirrored"] == 1
        st = cli_json("status", "--cluster", "us", "--json", data_dir=dcs.base.data_dir, prefix=prefix)
        assert st["kafka"]["up"] and st["kafka"]["bootstrap"] == us.kafka_bootstrap
    finally:
        stop(mirrors, worker)


def test_region_cut_off_then_mirror_and_broker_restarted(dcs, tmp_path, record_property):
    prefix = dcs.fresh_prefix()
    eu, us, center = (dcs.settings(n, prefix) for n in ("eu", "us", CENTER))
    data = recorded(9, "b")
    placement = ("eu", "eu", "us", "us")
    thirds = [data[:3], data[3:6], data[6:]]
    # eu's mirror commits its progress only every 2 minutes, so the crash below surely loses some
    # uncommitted progress: after the restart MM2 re-sends what the center already has.
    mirrors, worker = start(dcs, prefix, tmp_path, center, flush_ms={"eu": 120_000})
    try:
        publish(eu, records_in(thirds[0], "eu", placement))
        publish(us, records_in(thirds[0], "us", placement))
        read_topic(center, "groups", until=distinct_keys(1), timeout=150)

        # Cut eu off: its mirror dies as in a crash (uncommitted progress is re-sent later).
        mirrors["eu"].stop(force=True)
        publish(eu, records_in(thirds[1], "eu", placement))
        publish(us, records_in(thirds[1], "us", placement))
        time.sleep(2)
        up = next(f for f in mirror_flows(mirrors["eu"]) if f.source == "eu")
        cut = flow_metrics(up, window_s=1.0)
        assert cut["lag"] >= len(records_in(thirds[1], "eu", placement)), cut
        assert cut["events_per_s"] == 0, cut
        # us delivered its halves, but no group of the second third can complete without eu.
        partial = {m.key for m in read_topic(center, "groups", timeout=2)}
        assert not partial & {ss[0].finished.group_id.encode() for ss in thirds[1]}

        mirrors["eu"].start(120)
        dcs.clusters["eu"].kafka.restart(force=True)  # and the region's broker crashes once
        publish(eu, records_in(thirds[2], "eu", placement))
        publish(us, records_in(thirds[2], "us", placement))

        msgs = read_topic(center, "groups", until=distinct_keys(len(data)), timeout=180, idle=1.5)
        assert len({m.key for m in msgs}) == len(data), worker.log_text()[-3000:]
        record_property("raw_duplicate_groups", assert_exact(msgs, data))
        n_calls, n_finished = sum(len(s.calls) for ss in data for s in ss), 4 * len(data)
        # Complete groups mean every record is in; the idle second catches stragglers beyond that.
        calls, dup_calls = dedupe(read_at_least(center, "calls", n_calls), CallRecorded)
        finished, dup_finished = dedupe(read_at_least(center, "session-events", n_finished), SessionEvent)
        assert (len(calls), len(finished)) == (n_calls, n_finished)
        # The re-sent first third really reached the center twice: the exact groups above are the
        # streams' dedupe at work (a re-sent call of an emitted session is 'late' and dropped).
        assert dup_calls > 0 and dup_finished > 0, (dup_calls, dup_finished)
        record_property("raw_duplicate_calls", dup_calls)
        record_property("raw_duplicate_session_events", dup_finished)
    finally:
        stop(mirrors, worker)

