"""The judge stage in a real worker on the real broker, against a real HTTP judge that fails 20% of its
requests (timeouts, 429s, garbage, 500s; polarstream/tools/rule_judge.py): no failure becomes a reward,
each is masked with its class, every verdict is recorded once, and the judge's own log of arrivals never
shows more requests in a window than the limit."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from polarstream.tools.rule_judge import RuleJudge
from schemas import JudgeVerdict, TaskRequest, TrainingGroup, decode
from streams.judge import JudgeConfig, call_pieces, combine
from streams.synthetic import record_group
from tests.streams.helpers import dedupe, publish, read_topic
from tests.streams.test_judge import max_in_window

WORKER_ARGS = ["--group-deadline", "60", "--missing-calls-grace", "2", "--missing-calls-timeout", "3",
               "--tick-interval", "0.5", "--stats-interval", "1"]
REPLAY_ARGS = ["--group-deadline", "60", "--missing-calls-grace", "2", "--missing-calls-timeout", "3", "--tick-interval", "0.5"]
GROUPS, SAMPLES, RPW, WINDOW = 8, 4, 10, 2.0


@pytest.fixture
def rule_judge(tmp_path):
    server = RuleJudge(0, tmp_path / "judge.jsonl", fail_rate=0.2, stall_s=2.0, seed=1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def judge_yaml(tmp_path, server, tiny_model_dir, **kw) -> tuple[str, JudgeConfig]:
    doc = {"base_url": f"http://127.0.0.1:{server.server_address[1]}/v1", "model": "rule", "rubric": "Rule: shortest",
           "tokenizer": str(tiny_model_dir / "tokenizer.json"), "timeout_s": 1.0, "max_attempts": 1,
           "concurrency": 4, "requests_per_window": RPW, "window_s": WINDOW, **kw}
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), JudgeConfig(**doc)


@dataclass
class LiveRun:
    cfg: JudgeConfig
    judge_yaml: str
    outcome: dict[str, float]  # session -> outcome reward
    verdicts: dict[str, JudgeVerdict]  # session -> its verdict
    groups: dict[str, bytes]  # event id -> the live worker's TrainingGroup bytes
    stats: dict
    log: Path  # the judge's JSON lines
    worker: object


def live_run(settings, streams_worker, server, tiny_model_dir, tmp_path) -> LiveRun:
    """Sessions of GROUPS groups (and their tasks) published, a worker judging them until every group closed."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tokenize = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    records, outcome = [], {}
    for g in range(GROUPS):
        gid = f"jg{g}"
        records.append(TaskRequest(task_id=gid, instruction="fix the tests", num_samples=SAMPLES, min_valid=2,
                                   metadata={"rubric": "Shorter is better."}))
        for s in record_group(gid, [1.0, 0.0, 1.0, 0.0], seed=g, tokenize=tokenize, min_valid=2, turns=2 + g % 3):
            records += s.records
            outcome[s.finished.session_id] = s.finished.reward
    publish(settings, records)
    path, cfg = judge_yaml(tmp_path, server, tiny_model_dir)
    worker = streams_worker("--judge", path, *WORKER_ARGS)

    def verdicts_in(msgs) -> int:
        return len({decode(m.value, JudgeVerdict).trajectory_id for m in msgs})

    judged = read_topic(settings, "judgements", until=lambda m: verdicts_in(m) >= GROUPS * SAMPLES, timeout=180)
    assert verdicts_in(judged) == GROUPS * SAMPLES, worker.log_text()[-3000:]
    verdicts, duplicates = dedupe(judged, JudgeVerdict)
    assert duplicates == 0  # one verdict per trajectory, recorded once
    verdicts = {v.session_id: v for v in (decode(b, JudgeVerdict) for b in verdicts.values())}
    closed = lambda: sum(worker.stats().get(k, 0) for k in ("groups.sent", "groups.dropped_judge"))  # noqa: E731
    deadline = time.monotonic() + 60
    while closed() < GROUPS:
        assert time.monotonic() < deadline and worker.alive(), worker.log_text()[-3000:]
        time.sleep(0.5)
    stats = worker.stats()
    groups, _ = dedupe(read_topic(settings, "groups", until=lambda m: len(m) >= stats["groups.sent"], timeout=30), TrainingGroup)
    return LiveRun(cfg, path, outcome, verdicts, groups, stats, tmp_path / "judge.jsonl", worker)


def judge_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_judge_failures_are_masked_with_their_class_never_scored(polar_settings, streams_worker, rule_judge,
                                                                tiny_model_dir, tmp_path):
    run = live_run(polar_settings, streams_worker, rule_judge, tiny_model_dir, tmp_path)
    verdicts, stats = run.verdicts, run.stats
    assert len(verdicts) == GROUPS * SAMPLES
    failed = {s: v.failure for s, v in verdicts.items() if v.failure}
    assert {"timeout", "rate_limited", "unparseable", "http_error"} >= set(failed.values()) and failed
    groups = [decode(b, TrainingGroup) for b in run.groups.values()]
    trained = {t.session_id: t for g in groups for t in g.trajectories}
    # No failure is a reward: a failed member is masked with its class, never in a group's trajectories.
    assert not set(trained) & set(failed)
    for g in groups:
        for session in g.masked:
            assert g.masked_reasons[session] == f"judge:{failed[session]}"
    masked = {s for g in groups for s in g.masked}
    assert masked, "no emitted group shows a masked failure: pick another seed"
    dropped = {s for s in failed if s not in masked}  # their groups were dropped: fewer than min_valid left
    assert stats.get("groups.dropped_judge", 0) == len({s.rsplit("-", 1)[0] for s in dropped})
    # Every trained member's reward is its outcome combined with its own verdict's score.
    for session, t in trained.items():
        v = verdicts[session]
        assert t.metrics["judge_score"] == v.score and t.metrics["outcome_reward"] == run.outcome[session]
        assert t.reward == combine(run.outcome[session], v.score, run.cfg)
    assert stats["judge.asked"] == GROUPS * SAMPLES and stats["judge.scored"] == GROUPS * SAMPLES - len(failed)
    for kind in set(failed.values()):
        assert stats[f"judge.{kind}"] == sum(f == kind for f in failed.values())
    # The rate limit, as the judge saw it.
    log = judge_log(run.log)
    assert len(log) == GROUPS * SAMPLES  # max_attempts 1: each trajectory asked once
    assert max_in_window([e["t"] for e in log], WINDOW) <= RPW


def test_replay_reuses_recorded_verdicts_and_rejudges_on_request(polar_settings, streams_worker, rule_judge,
                                                                  tiny_model_dir, tmp_path):
    """With the run's judge, a replay asks nothing and gives the live groups bit for bit; with
    --judge-failed-only it asks exactly the failed rows again; with a second rubric, other advantages."""
    from typer.testing import CliRunner

    from polarstream.cli import app

    run = live_run(polar_settings, streams_worker, rule_judge, tiny_model_dir, tmp_path)
    env = {"POLAR_KAFKA_BOOTSTRAP": polar_settings.kafka_bootstrap, "POLAR_DATA_DIR": str(polar_settings.data_dir),
           "POLAR_TOPIC_PREFIX": polar_settings.topic_prefix}

    def replay(name: str, *args: str) -> tuple[dict, dict[str, TrainingGroup], list[dict]]:
        before = len(judge_log(run.log))
        res = CliRunner().invoke(app, ["replay", "--to-prefix", name, "--quiet", *REPLAY_ARGS, *args], env=env,
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        target = polar_settings.model_copy(update={"topic_prefix": out["target_prefix"]})
        msgs = read_topic(target, "groups", until=lambda m: len(m) >= out["written"]["groups"], timeout=30)
        groups = {g.group_id: g for g in (decode(m.value, TrainingGroup) for m in msgs)}
        return out, groups, judge_log(run.log)[before:]

    live = {decode(b, TrainingGroup).group_id: decode(b, TrainingGroup) for b in run.groups.values()}
    same, groups, asked = replay("same", "--judge", run.judge_yaml)
    assert not asked and same["counters"]["judge.reused"] > 0  # every verdict was recorded: none asked again
    assert {g.event_id for g in groups.values()} == {g.event_id for g in live.values()}
    for gid, g in live.items():
        assert groups[gid].advantages == g.advantages and groups[gid].masked_reasons == g.masked_reasons

    failed = {s for s, v in run.verdicts.items() if v.failure}
    retried, groups, asked = replay("retry", "--judge", run.judge_yaml, "--judge-failed-only")
    assert len(asked) == len(failed) and retried["written"]["judgements"] == len(failed)

    second = tmp_path / "second.yaml"
    second.write_text(Path(run.judge_yaml).read_text().replace("Rule: shortest", "Rule: answer=42"))
    other, groups, asked = replay("other", "--rejudge", str(second))
    assert len(asked) >= GROUPS * SAMPLES  # every trajectory judged anew (and the failures' retries, if any)
    changed = [gid for gid, g in groups.items() if gid in live and g.advantages != live[gid].advantages]
    assert changed, "a second rubric must change some advantages"

    # Process scores on the prefix-merged traces: each call's score on exactly its sampled tokens.
    process = tmp_path / "process.yaml"
    process.write_text(Path(run.judge_yaml).read_text() + "process: true\nprocess_weight: 0.5\n")
    _, groups, asked = replay("proc", "--rejudge", str(process))
    assert len(asked) >= GROUPS * SAMPLES
    with_process = 0
    for g in groups.values():
        for t, adv in zip(g.trajectories, g.advantages):
            for tr in t.traces:
                if not tr.token_advantages:
                    continue
                with_process += 1
                assert all(a == 0 for a, m in zip(tr.token_advantages, tr.loss_mask) if not m)  # never trained
                for _, a, b in call_pieces(tr):  # one call's tokens: its member's advantage + 0.5 * its score / 5
                    assert len(set(tr.token_advantages[a:b])) == 1 and abs(tr.token_advantages[a] - adv) <= 0.5 + 1e-9
    assert with_process, "no trace got per-token advantages"


def test_a_worker_that_lost_its_state_reads_the_recorded_verdicts_instead_of_asking(
        polar_settings, streams_worker, rule_judge, tiny_model_dir, tmp_path):
    """The worker's tables and offsets deleted after a judged run: a new worker re-derives every group from
    the topics, asks the judge nothing (every verdict, failures too, is read back from polar.judgements)
    and re-emits each group byte for byte."""
    from confluent_kafka.admin import AdminClient

    from streams.topology import app_id_for

    run = live_run(polar_settings, streams_worker, rule_judge, tiny_model_dir, tmp_path)
    assert run.worker.stop() == 0
    asked = len(judge_log(run.log))
    admin, app_id = AdminClient(polar_settings.kafka_config()), app_id_for(polar_settings)
    internal = [t for t in admin.list_topics(timeout=10).topics if t.startswith(app_id)]
    for fut in [*admin.delete_topics(internal, operation_timeout=30).values(),
                *admin.delete_consumer_groups([app_id], request_timeout=30).values()]:
        fut.result()
    deadline = time.monotonic() + 30
    while any(t.startswith(app_id) for t in admin.list_topics(timeout=10).topics):
        assert time.monotonic() < deadline, "the worker's internal topics were not deleted"
        time.sleep(0.5)

    (polar_settings.data_dir / "streams" / f"{app_id}.stats.json").unlink()  # the first worker's counters
    again = streams_worker("--judge", run.judge_yaml, *WORKER_ARGS)
    closed = lambda: sum(again.stats().get(k, 0) for k in ("groups.sent", "groups.dropped_judge"))  # noqa: E731
    deadline = time.monotonic() + 120
    while closed() < GROUPS:
        assert time.monotonic() < deadline and again.alive(), again.log_text()[-3000:]
        time.sleep(0.5)
    stats = again.stats()
    assert len(judge_log(run.log)) == asked and not stats.get("judge.asked")
    assert stats["judge.reused"] == GROUPS * SAMPLES
    assert stats["groups.sent"] == run.stats["groups.sent"]
    msgs = read_topic(polar_settings, "groups", until=lambda m: len(m) >= 2 * run.stats["groups.sent"], timeout=30)
    groups, duplicates = dedupe(msgs, TrainingGroup)  # a re-emission with other bytes fails here
    assert groups == run.groups and duplicates == run.stats["groups.sent"]
