"""Replay, eval and export on the real broker, against a run recorded by the live stream worker.

One recorded run per module: sessions tokenized with the tiny model's real tokenizer (token-in/
token-out, delta-encoded like the gateway records them), published in two batches with noise, and
turned into trajectories and groups by a real ``polarstream streams worker`` process. The tools are
then run through the ``polarstream`` command beside that worker.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field

import pytest
from typer.testing import CliRunner

from infra.topics import delete_topics, ensure_topics
from polarstream.cli import app
from schemas import CallRecorded, DeltaError, SessionEvent, TrainingGroup, Trajectory, decode, resolve_prompt
from streams.synthetic import Recorded, SessionSpec, record_group, record_session
from tests.streams.helpers import WorkerProcess, dedupe, publish, publish_raw, read_topic

# gm-s0 lost a call and the calls topic never gets 2 s past its finished event, so it waits the full
# timeout: 12 s, well after gm's 4 s deadline. gm emits without it, its trajectory comes late (live and
# in a replay alike), and the fixture waits for it so that every test sees all 20 trajectories.
DEADLINES = ["--group-deadline", "4", "--missing-calls-grace", "2", "--missing-calls-timeout", "12", "--tick-interval", "0.5"]
WORKER_ARGS = [*DEADLINES, "--stats-interval", "1"]
BATCH_A, BATCH_B = ("g0", "g1", "gf"), ("gt", "gd", "gm")


@pytest.fixture(scope="module")
def chat_tokenize(tiny_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def scenario(tok) -> tuple[list, list, dict[str, list[Recorded]]]:
    """(batch A records, batch B records, group_id -> sessions as published)."""
    g0 = record_group("g0", [1.0, 0.0, 0.0, 1.0], seed=1, tokenize=tok, min_valid=2)
    for i, twist in ((1, "side_call_at"), (2, "compaction_at"), (3, "retokenize_at")):
        g0[i] = record_session(SessionSpec(f"g0-s{i}", "g0", i, num_samples=4, min_valid=2, reward=g0[i].finished.reward,
                                           **{twist: 2 if i < 3 else 3}), 1, tok)
    sessions = {
        "g0": g0,
        "g1": record_group("g1", [0.0, 0.5, 1.0, 1.0], seed=2, tokenize=tok, min_valid=2),
        "gf": record_group("gf", [1.0, None, 0.0, 0.0], seed=3, tokenize=tok, statuses=["ok", "infra_error", "ok", "ok"], min_valid=2),
        "gt": record_group("gt", [1.0, None, 0.0], seed=4, tokenize=tok, statuses=["ok", "timeout", "ok"], min_valid=2),
        "gd": record_group("gd", [1.0, 0.0, 0.0], seed=5, tokenize=tok, min_valid=2)[:2],  # one never finishes
        "gm": record_group("gm", [1.0, 0.0, 1.0], seed=6, tokenize=tok, min_valid=2),
    }
    sessions["gm"][0].calls.pop(2)  # lost: its finished event says 4 calls
    rng = random.Random(7)
    batches = []
    for names in (BATCH_A, BATCH_B):
        records = [r for g in names for s in sessions[g] for r in s.records]
        rng.shuffle(records)
        batches.append(records)
    batches[1] += [*batches[1][:4], SessionEvent(session_id="gt-s0", group_id="gt", kind="started"),
                   record_session(SessionSpec("orphan", "go", turns=1), 8, tok).calls[0]]
    return batches[0], batches[1], sessions


@dataclass
class Run:
    settings: object
    worker: WorkerProcess
    sessions: dict[str, list[Recorded]]
    groups: dict[str, bytes]  # event_id -> bytes, as the live worker emitted them
    trajectories: dict[str, bytes]
    mid_time: float  # between the two batches
    watermarks: dict
    tmp: object
    prefixes: list[str] = field(default_factory=list)

    def cli(self, *args: str, prefix: str | None = None):
        env = {"POLAR_KAFKA_BOOTSTRAP": self.settings.kafka_bootstrap, "POLAR_DATA_DIR": str(self.settings.data_dir),
               "POLAR_TOPIC_PREFIX": self.settings.topic_prefix if prefix is None else prefix,
               "POLAR_S3_ENDPOINT": self.settings.s3_endpoint_url}
        return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

    def replay(self, name: str, *args: str, quiet: bool = True) -> dict:
        self.prefixes.append(f"{name}.{self.settings.topic_prefix}")
        res = self.cli("replay", "--to-prefix", name, *(["--quiet"] if quiet else []), *DEADLINES, *args)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    def at(self, prefix: str):
        return self.settings.model_copy(update={"topic_prefix": prefix})

    def live_groups(self, names) -> dict[str, bytes]:
        return {k: v for k, v in self.groups.items() if decode(v, TrainingGroup).group_id in names}


def watermarks(settings) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    from infra.settings import TOPICS

    c = Consumer(settings.kafka_config(**{"group.id": "watermarks"}))
    try:
        out = {}
        for t in TOPICS:
            full = settings.topic(t)
            for p in c.list_topics(full, timeout=10).topics[full].partitions:
                out[(t, p)] = c.get_watermark_offsets(TopicPartition(full, p), timeout=10)
        return out
    finally:
        c.close()


@pytest.fixture(scope="module")
def run(infra, tmp_path_factory, chat_tokenize):
    tmp = tmp_path_factory.mktemp("tools")
    settings = infra.settings.model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:10]}.", "data_dir": tmp / "polar"})
    ensure_topics(settings)
    batch_a, batch_b, sessions = scenario(chat_tokenize)
    publish(settings.model_copy(update={"record_format": "json"}), batch_a)  # as an earlier build wrote them
    time.sleep(1.0)
    mid = time.time()
    time.sleep(0.5)
    publish_raw(settings, "calls", b"gm-s1", b"\x00 not json")
    publish(settings, batch_b)  # packed (the default): the worker, replay and the tools read both
    worker = WorkerProcess(settings, tmp / "worker.log", WORKER_ARGS).start()
    prefixes = [settings.topic_prefix]  # replays add theirs; all are deleted at the end
    try:
        msgs = read_topic(settings, "groups", until=lambda m: len({x.key for x in m}) >= 6, timeout=120, idle=1.0)
        groups, dups = dedupe(msgs, TrainingGroup)
        assert len(groups) == 6 and dups == 0, worker.log_text()[-3000:]
        msgs = read_topic(settings, "trajectories", until=lambda m: len(m) >= 20, timeout=60)
        trajectories, _ = dedupe(msgs, Trajectory)
        assert len(trajectories) == 20, worker.log_text()[-3000:]
        yield Run(settings, worker, sessions, groups, trajectories, mid, watermarks(settings), tmp, prefixes)
    finally:
        worker.stop()
        for prefix in prefixes:
            try:
                delete_topics(settings.model_copy(update={"topic_prefix": prefix}), timeout=10)
            except Exception:  # cleanup only
                pass


@pytest.fixture(scope="module")
def full_replay(run):
    return run.replay("rp")


def test_replay_reproduces_the_live_groups_byte_for_byte(run, full_replay):
    target = run.at(full_replay["target_prefix"])
    assert full_replay["topics"]["groups"] == f"rp.{run.settings.topic_prefix}polar.groups"
    groups, dups = dedupe(read_topic(target, "groups", until=lambda m: len(m) >= 6, timeout=30), TrainingGroup)
    assert groups == run.groups and dups == 0
    trajs, dups = dedupe(read_topic(target, "trajectories", until=lambda m: len(m) >= 20, timeout=30), Trajectory)
    assert trajs == run.trajectories and dups == 0
    assert full_replay["written"]["groups"] == 6 and full_replay["written"]["trajectories"] == 20
    c = full_replay["counters"]
    assert c["calls.undecodable"] == 1 and c["session_events.started.ignored"] == 1
    assert c["sessions.dropped_no_finished"] == 1 and c["sessions.missing_calls"] == 1
    # gm emitted at its deadline without gm-s0, whose trajectory came after it (see DEADLINES)
    (gm,) = [g for g in map(lambda b: decode(b, TrainingGroup), groups.values()) if g.group_id == "gm"]
    assert [t.session_id for t in gm.trajectories] == ["gm-s1", "gm-s2"] and gm.masked == []
    assert c["members.late"] == 1
    assert full_replay["pending"] == {"sessions_open": 0, "groups_open": 0}


def test_replay_is_deterministic(run, full_replay):
    again = run.replay("rp2")
    assert again["digest"] == full_replay["digest"] and again["written"] == full_replay["written"]
    first = read_topic(run.at(full_replay["target_prefix"]), "groups", until=lambda m: len(m) >= 6, timeout=30)
    second = read_topic(run.at(again["target_prefix"]), "groups", until=lambda m: len(m) >= 6, timeout=30)
    order = lambda msgs: sorted((m.partition, m.offset, m.key, m.value) for m in msgs)  # noqa: E731
    assert order(first) == order(second)  # same records, same partitions, same order within each


def hand_counts(sessions: dict[str, list[Recorded]]) -> tuple[int, int, int]:
    """(calls, sum of prompt+completion tokens, sampled tokens) over every call whose prompt resolves
    (gm-s0's call 3 is delta-encoded against its lost call 2: it cannot be rebuilt, so it has no trace)."""
    calls = tokens = sampled = 0
    for group in sessions.values():
        for s in group:
            full: dict[int, list[int]] = {}
            for call in s.calls:
                try:
                    full[call.call_index] = resolve_prompt(call, full) + call.completion_ids
                except DeltaError:
                    continue
                calls, tokens, sampled = calls + 1, tokens + len(full[call.call_index]), sampled + len(call.completion_ids)
    return calls, tokens, sampled


def test_per_request_ablation_yields_more_traces_and_training_tokens(run, full_replay):
    ablation = run.replay("pr", "--builder", "per_request")
    calls, tokens, sampled = hand_counts(run.sessions)
    merged, per_request = full_replay["written"], ablation["written"]
    # 20 sessions, each one chain, plus one chain per twist in g0 (side call, compaction, re-tokenization).
    assert merged["traces"] == 23
    # 20 sessions x 4 turns, + g0-s1's side call, - gm-s0's lost call and the call it was the base of
    assert per_request["traces"] == calls == 79
    assert per_request["tokens"] == tokens > merged["tokens"]
    assert per_request["trainable_tokens"] == merged["trainable_tokens"] == sampled
    got, _ = dedupe(read_topic(run.at(ablation["target_prefix"]), "groups", until=lambda m: len(m) >= 6, timeout=30), TrainingGroup)
    live = {g.group_id: g for g in map(lambda b: decode(b, TrainingGroup), run.groups.values())}
    for g in map(lambda b: decode(b, TrainingGroup), got.values()):
        assert all(t.builder == "per_request" for t in g.trajectories)
        assert g.advantages == live[g.group_id].advantages  # same rewards, same advantages


def test_replay_windows_by_time_then_by_offsets(run, tmp_path):
    first = run.replay("ra", "--to-time", f"{run.mid_time:.3f}", quiet=False)  # with its progress bar
    got, _ = dedupe(read_topic(run.at(first["target_prefix"]), "groups", until=lambda m: len(m) >= 3, timeout=30, idle=0.5), TrainingGroup)
    assert got == run.live_groups(BATCH_A)
    offsets = tmp_path / "end.json"
    offsets.write_text(json.dumps(first["end_offsets"]))
    second = run.replay("rb", "--from-offsets", str(offsets))
    assert second["start_offsets"] == first["end_offsets"]
    got, _ = dedupe(read_topic(run.at(second["target_prefix"]), "groups", until=lambda m: len(m) >= 3, timeout=30, idle=0.5), TrainingGroup)
    assert got == run.live_groups(BATCH_B)


def test_replays_leave_the_live_namespace_and_consumers_alone(run, full_replay):
    from confluent_kafka.admin import AdminClient

    assert watermarks(run.settings) == run.watermarks  # nothing written into the source topics
    groups = AdminClient(run.settings.kafka_config()).list_consumer_groups(request_timeout=10).result()
    assert not [g.group_id for g in groups.valid if g.group_id.startswith(("polar-replay", "polar-read", "polar-plan"))]
    assert run.worker.alive()
    stats = run.worker.stats()
    assert stats.get("calls.undecodable") == 1  # the worker saw its input once, undisturbed


def test_bad_input_gets_a_clear_error_and_changes_nothing(run, full_replay, tmp_path):
    target = run.at(full_replay["target_prefix"])
    before = watermarks(target)
    res = run.cli("replay", "--to-prefix", "rp", "--quiet")
    assert res.exit_code == 1 and "polar.trajectories already holds 20 records" in res.output and "--allow-existing" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"calls": {"9": 0}}))
    res = run.cli("replay", "--to-prefix", "rx", "--from-offsets", str(bad))
    assert res.exit_code == 2 and "has partitions [0, 1, 2, 3], not [9]" in res.output
    res = run.cli("replay", "--to-prefix", "no way!", "--quiet")
    assert res.exit_code == 2 and "--to-prefix 'no way!'" in res.output
    res = run.cli("replay", "--to-prefix", "rx", "--from-time", "0", "--from-offsets", str(bad))
    assert res.exit_code == 2 and "not both" in res.output
    res = run.cli("replay", "--to-prefix", "rx", "--builder", "sideways")
    assert res.exit_code == 2 and "--builder" in res.output
    assert watermarks(target) == before


def test_eval_matches_the_hand_computation(run, tmp_path):
    res = run.cli("eval", "--out", str(tmp_path / "report"), "--k", "2", "--k", "4")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["source"]["trajectories"] == 20
    (cell,) = report["cells"]
    assert (cell["harness"], cell["policy_version"], cell["task_set"]) == ("unknown", 0, "default")
    # (n, c) per task at threshold 1.0: g0 (4,2) g1 (4,2: 0.5 does not pass) gf (3,1: the infra error is
    # excluded) gt (3,1: the timeout fails) gd (2,1) gm (3,2: gm-s0 lost a call, but its outcome counts)
    assert cell["per_task"] == {"g0": {"n": 4, "c": 2}, "g1": {"n": 4, "c": 2}, "gf": {"n": 3, "c": 1},
                                "gt": {"n": 3, "c": 1}, "gd": {"n": 2, "c": 1}, "gm": {"n": 3, "c": 2}}
    assert cell["pass@1"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 3 + 1 / 3 + 1 / 2 + 2 / 3) / 6)
    # pass@2 = 1 - C(n-c,2)/C(n,2): 5/6, 5/6, 2/3, 2/3, 1, 1
    assert cell["pass@2"] == pytest.approx((5 / 6 + 5 / 6 + 2 / 3 + 2 / 3 + 1 + 1) / 6)
    assert cell["pass@4"] == 1.0 and cell["tasks@4"] == 2
    # 20 finished sessions (6 groups of 4, 4, 4, 3, 2 and 3; the orphan never finishes), one of them
    # gf-s1's infra error: 19 samples, 1 excluded
    assert cell["samples"] == 19 and cell["excluded"] == 1
    assert cell["mean_reward"] == pytest.approx((2 + 2.5 + 1 + 1 + 1 + 2) / 19)
    assert cell["timeouts"] == 1
    assert cell["mean_turns"] == pytest.approx((19 * 4 - 1) / 19)  # gm-s0 has 3 calls
    # g0-s2's compaction, g0-s3's re-tokenized turn, gm-s0's call 3 (encoded against its lost call 2)
    assert cell["merge_breaks"] == {"compaction": 1, "delta_unresolved": 1, "retokenized": 1}
    assert cell["masked_from_training"] == {"missing_calls": 1, "status_infra_error": 1}
    assert {p.name for p in (tmp_path / "report").iterdir()} == {"eval.json", "eval.png", "eval.html"}


def test_export_of_replayed_groups_to_s3_round_trips(run, full_replay):
    pq = pytest.importorskip("pyarrow.parquet")
    from collections import Counter

    import pyarrow as pa

    from infra.storage import read_bytes
    from polarstream.tools.export import Filters, trace_rows

    url = f"s3://{run.settings.s3_bucket}/tests/{uuid.uuid4().hex[:8]}/groups.parquet"
    res = run.cli("export", "--format", "parquet", "--source", "groups", "--out", url, prefix=full_replay["target_prefix"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    rows = pq.read_table(pa.BufferReader(read_bytes(url, run.settings))).to_pylist()
    want = [r for g in map(lambda b: decode(b, TrainingGroup), run.groups.values())
            for t, a in zip(g.trajectories, g.advantages) for r in trace_rows(t, Filters(), Counter(), a)]
    key = lambda r: (r["trajectory_id"], r["trace_index"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(want, key=key)  # token ids, masks, logprobs, advantages
    assert summary["rows"] == len(rows) and summary["skipped_traces"] == {"side_call": 1}


def test_export_jsonl_with_a_reward_filter(run, tmp_path):
    out = tmp_path / "sft.jsonl"
    res = run.cli("export", "--format", "jsonl", "--out", str(out), "--min-reward", "1")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # usable trajectories with reward 1: g0-s0, g0-s3 (two traces: re-tokenized), g1-s2, g1-s3, gf-s0, gt-s0,
    # gd-s0, gm-s2 (gm-s0 has reward 1 but lost a call: masked)
    assert sorted({r["session_id"] for r in rows}) == ["g0-s0", "g0-s3", "g1-s2", "g1-s3", "gd-s0", "gf-s0", "gm-s2", "gt-s0"]
    assert len(rows) == 9 and all(r["reward"] >= 1 and r["advantage"] is None for r in rows)
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == len(r["logprobs"]) == r["num_tokens"]


def test_cat_prints_records_of_either_encoding_as_json_lines(run):
    """Batch A went out as JSON, batch B packed: ``polarstream cat`` prints both alike, and says which
    message is not a record (the one undecodable call) instead of stopping at it."""
    res = run.cli("cat", "calls")
    assert res.exit_code == 1 and "not a record" in res.output
    printed = {p["event_id"]: p for p in map(json.loads, res.stdout.splitlines())}
    published = {c.event_id: c for group in run.sessions.values() for s in group for c in s.calls}
    assert set(published) < set(printed)  # and the orphan call
    assert all(CallRecorded.model_validate(printed[e]) == c for e, c in published.items())
    assert {bool(c.prompt_delta) for c in published.values()} == {True, False}  # both prompt forms shown
    res = run.cli("cat", "groups", "--limit", "2")
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 2
    assert {TrainingGroup.model_validate(json.loads(line)).event_id for line in res.stdout.splitlines()} <= set(run.groups)
    res = run.cli("cat", "nope")
    assert res.exit_code == 2 and "unknown topic" in res.output


def test_eval_follow_keeps_the_report_current(polar_settings, tmp_path):
    import threading

    from polarstream.tools.eval_run import run_eval
    from tests.tools.samples import traj

    publish(polar_settings.model_copy(update={"record_format": "json"}), [traj("a", 0, 1.0), traj("a", 1, 0.0)])  # then packed
    reports, stop = [], threading.Event()
    follower = threading.Thread(target=run_eval, kwargs=dict(
        settings=polar_settings, ks=(2,), out_dir=tmp_path, follow=True, refresh_s=0.2, duration_s=60,
        on_update=reports.append, stop=stop))
    follower.start()
    try:
        deadline = time.monotonic() + 30
        while not reports and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reports and reports[0]["cells"][0]["samples"] == 2
        # While it follows: a new sample, a repeat of it, a retry that supersedes sample 1, a new version.
        publish(polar_settings, [traj("a", 2, 1.0), traj("a", 2, 1.0), traj("a", 1, 1.0, attempt=1),
                                 traj("b", 0, 1.0, version=1)])
        while time.monotonic() < deadline and not (len(reports[-1]["cells"]) == 2 and reports[-1]["cells"][0]["passed"] == 3):
            time.sleep(0.1)
    finally:
        stop.set()
        follower.join(30)
    last = reports[-1]
    v0, v1 = last["cells"]
    assert (v0["samples"], v0["passed"], v0["pass@1"], v0["pass@2"]) == (3, 3, 1.0, 1.0)
    assert v1["policy_version"] == 1 and v1["samples"] == 1
    assert last["source"]["duplicates"] == 1 and last["source"]["superseded"] == 1
    assert json.loads((tmp_path / "eval.json").read_text()) == json.loads(json.dumps(last))  # files follow too
