"""The judge's pure parts (strict verdicts, the combination rule, masking, chunks) and its client against
a real HTTP judge (polarstream/tools/rule_judge.py in a thread): retries, failure classes, rate limits."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from polarstream.tools.rule_judge import RuleJudge, score
from schemas import JudgeVerdict, Trace, Trajectory
from streams.judge import JudgeConfig, VerdictError, apply_verdicts, combine, parse_verdict, transcript_chunks, verdict_id
from streams.judge_client import JudgeClient, WindowLimiter


def reply(content, **choice) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content, **choice.pop("message", {})},
                         "finish_reason": "stop", **choice}]}


def config(**kw) -> JudgeConfig:
    return JudgeConfig(**{"base_url": "http://127.0.0.1:1/v1", "model": "rule", "tokenizer": "unused", **kw})


def test_a_verdict_is_exactly_a_score_and_a_reason():
    assert parse_verdict(reply('{"score": 3, "reason": "ok"}')) == (3.0, "ok", [])
    assert parse_verdict(reply(' {"score": -5, "reason": ""}\n')) == (-5.0, "", [])
    assert parse_verdict(reply('{"score": 1, "calls": [2, -5], "reason": "r"}'), calls=2) == (1.0, "r", [2.0, -5.0])
    for content in ('{"score": 1, "reason": "r"}', '{"score": 1, "calls": [2], "reason": "r"}',
                    '{"score": 1, "calls": [2, 9], "reason": "r"}', '{"score": 1, "calls": [2, 1.5], "reason": "r"}'):
        with pytest.raises(VerdictError):
            parse_verdict(reply(content), calls=2)
    for content in ('Score: 4', '```json\n{"score": 4, "reason": "x"}\n```', '{"score": 6, "reason": "x"}',
                    '{"score": 2.5, "reason": "x"}', '{"score": true, "reason": "x"}', '{"score": 2}',
                    '{"score": 2, "reason": "x", "extra": 1}', '[2]', None):
        with pytest.raises(VerdictError) as e:
            parse_verdict(reply(content))
        assert e.value.failure == "unparseable", content
    for r in (reply(None, message={"refusal": "I can't help with that"}), reply("x", finish_reason="content_filter"),
              reply("I'm sorry, but I cannot judge this.")):
        with pytest.raises(VerdictError) as e:
            parse_verdict(r)
        assert e.value.failure == "refusal"
    with pytest.raises(VerdictError, match="not a chat completion"):
        parse_verdict({"error": "x"})


def test_combination_presets():
    assert combine(1.0, 5.0, config()) == pytest.approx(1.2)  # Polar's outcome + 0.2 * score / 5
    assert combine(0.0, -5.0, config(weight=0.5)) == pytest.approx(-0.5)
    assert combine(1.0, 5.0, config(preset="judge_only")) == 1.0  # the outcome plays no part
    assert combine(1.0, -5.0, config(preset="judge_only")) == 0.0
    assert combine(0.0, 0.0, config(preset="judge_only")) == 0.5


def _traj(session: str, reward: float, usable: bool = True) -> Trajectory:
    trace = Trace(call_indices=[0, 1], token_ids=[1, 2, 3, 4, 5, 6, 7], loss_mask=[0, 1, 1, 0, 0, 1, 0],
                  logprobs=[0.0, -0.1, -0.1, 0.0, 0.0, -0.2, 0.0])
    return Trajectory(event_id=f"t-{session}", session_id=session, group_id="g", reward=reward, usable=usable, traces=[trace])


def _verdict(t: Trajectory, score=None, failure=None) -> JudgeVerdict:
    return JudgeVerdict(event_id=verdict_id(t.event_id, "j"), group_id="g", session_id=t.session_id, trajectory_id=t.event_id,
                        judge="j", score=score, failure=failure)


def test_a_failed_verdict_masks_its_member_with_the_reason_never_a_zero():
    members = [_traj("a", 1.0), _traj("b", 0.0), _traj("c", 1.0), _traj("d", 0.0, usable=False)]
    verdicts = {members[0].event_id: _verdict(members[0], 5.0), members[1].event_id: _verdict(members[1], failure="timeout"),
                members[2].event_id: _verdict(members[2], -5.0)}
    judged = apply_verdicts(members, verdicts, config())
    assert [t.usable for t in judged.members] == [True, False, True, False]
    assert judged.masked == {"b": "judge:timeout"}
    assert [t.reward for t in judged.members] == [pytest.approx(1.2), 0.0, pytest.approx(0.8), 0.0]
    assert judged.members[0].metrics == {"outcome_reward": 1.0, "judge_score": 5.0}
    grouped = apply_verdicts(members, verdicts, config(mask="group"))
    assert not any(t.usable for t in grouped.members)
    assert grouped.masked == {"b": "judge:timeout", "a": "judge:timeout (group)", "c": "judge:timeout (group)"}
    with pytest.raises(KeyError, match="no verdict"):
        apply_verdicts(members, {}, config())


def test_chunks_stay_under_the_budget_and_end_at_calls():
    t = _traj("a", 1.0)
    text = lambda ids: ",".join(map(str, ids)) + ";"  # noqa: E731
    assert transcript_chunks(t, text, 100) == [("1,2,3;4,5,6,7;", 0)]  # the trailing 7: the last call's
    assert transcript_chunks(t, text, 4) == [("1,2,3;", 0), ("4,5,6,7;", 0)]
    assert transcript_chunks(t, text, 3) == [("1,2,3;", 0), ("4,5,6;", 0), ("7;", 0)]  # the second call cut
    assert transcript_chunks(t, text, 3, headed=True) == [  # a cut call counts (is headed) where it ends
        ("### Call 1\n1,2,3;\n", 1), ("4,5,6;", 0), ("### Call 2\n7;\n", 1)]
    context = t.model_copy(update={"traces": [Trace(call_indices=[0], token_ids=[8, 9], loss_mask=[0, 0], logprobs=[0.0, 0.0])]})
    assert transcript_chunks(context, text, 100, headed=True) == [("8,9;", 0)]  # shown, but no call of its own


def _merged() -> Trajectory:
    """A prefix-merged trace of four calls: the second resampled (replaced: its reply is context only),
    the last two with nothing between their replies (one run: one call here)."""
    #         sys  r1 r1 tool  r2(replaced) tool  r3 r3 r3  r4  tail
    mask = [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0]
    trace = Trace(call_indices=[0, 1, 2, 3], token_ids=list(range(10, 10 + len(mask))), loss_mask=mask,
                  logprobs=[-0.5 * m for m in mask])
    side = Trace(call_indices=[4], token_ids=[100, 101, 102], loss_mask=[0, 1, 1], logprobs=[0.0, -0.1, -0.1], side_call=True)
    return Trajectory(event_id="tm", session_id="m", group_id="g", reward=1.0, traces=[side, trace])


def test_a_call_score_lands_on_exactly_that_calls_tokens():
    from schemas import TrainingGroup
    from streams.judge import call_pieces, process_advantages

    t = _merged()
    merged, side = t.traces[1], t.traces[0]
    assert call_pieces(merged) == [(0, 2, 4), (4, 8, 12)]
    group = TrainingGroup(group_id="g", trajectories=[t, _traj("b", 0.0)], advantages=[0.5, -0.5])
    # calls in trace order (the merged trace starts at call 0, the side call's at 4): merged's two, then the side's
    out = process_advantages(group, {"tm": [5.0, -5.0, 2.5]}, weight=0.2)
    got = {tr.call_indices[0]: tr.token_advantages for tr in out.trajectories[0].traces}
    assert got[0] == [0.0, 0.0, 0.7, 0.7, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3, 0.0]
    assert got[4] == [0.0, 0.6, 0.6]
    for tr in out.trajectories[0].traces:  # every trained token has one, nothing else moves
        assert [a != 0 for a in tr.token_advantages] == [m == 1 for m in tr.loss_mask]
    assert out.trajectories[1].traces[0].token_advantages == [] and out.advantages == group.advantages
    with pytest.raises(ValueError, match="2 process scores for 3 calls"):
        process_advantages(group, {"tm": [5.0, -5.0]}, weight=0.2)
    # and the trainer trains each of those tokens with its own advantage
    from trainer.packing import pack, samples_from_group

    samples, _ = samples_from_group(out, max_len=0)
    by_trace = {s.input_ids[0]: s for s in samples}
    assert by_trace[10].token_advantages == (0.7, 0.7, 0.3, 0.3, 0.3, 0.3)
    assert by_trace[100].token_advantages == (0.6, 0.6) and by_trace[1].token_advantages == ()  # member b: its own
    got = sorted(a for mb in pack(samples, budget=64) for a in mb.advantages.tolist())
    assert got == pytest.approx(sorted([0.7, 0.7, 0.3, 0.3, 0.3, 0.3, 0.6, 0.6] + [-0.5] * 3))


def test_the_window_limiter_holds_a_request_from_its_start_to_a_window_after_its_end():
    now = [0.0]
    lim = WindowLimiter(requests=3, tokens=100, window_s=10.0, clock=lambda: now[0])
    held = []
    for t in (0, 1, 2):
        now[0] = t
        assert lim.wait_for(10) == 0
        held.append([t, None, 10])
        lim.held.append(held[-1])
    assert lim.wait_for(10) == lim.poll_s  # all in flight: only an answer can free room
    held[0][1], held[1][1], held[2][1] = 0.5, 4.0, 2.5
    assert lim.wait_for(10) == pytest.approx(8.5)  # the first ended at 0.5: out of the window at 10.5
    now[0] = 10.5
    assert lim.wait_for(10) == 0
    lim.held.append([10.5, None, 10])
    now[0] = 11.0
    assert lim.wait_for(10) == pytest.approx(1.5)  # then the one that ended at 2.5 (started at 2)
    lim.requests = 10
    # 30 tokens held: for 75 more, 5 must go (the one that ended at 2.5), for 85, 15 (and the one at 4)
    assert lim.wait_for(75) == pytest.approx(1.5) and lim.wait_for(85) == pytest.approx(3.0)
    assert lim.wait_for(95) == lim.poll_s  # more than the ended ones free: the one in flight must end
    assert lim.wait_for(70) == 0
    lim.held.clear()
    assert lim.wait_for(500) == 0  # larger than the budget: goes alone


@pytest.fixture
def rule_judge(tmp_path):
    servers = []

    def start(**kw) -> tuple[str, object]:
        log = tmp_path / f"judge{len(servers)}.jsonl"
        server = RuleJudge(0, log, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", log

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def arrivals(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def max_in_window(times: list[float], window: float) -> int:
    times, most, lo = sorted(times), 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


def test_the_client_retries_injected_failures_within_its_limits(rule_judge):
    """A judge failing 20% of requests (timeouts, 429s, garbage, 500s): with retries every trajectory gets
    its verdict, the one the rule gives; the server's own log never shows more than the limit in a window."""
    url, log = rule_judge(fail_rate=0.2, stall_s=1.5, seed=3)
    cfg = config(base_url=url, timeout_s=0.5, max_attempts=6, backoff_s=0.05, concurrency=4,
                 requests_per_window=16, window_s=1.0)
    members = [_traj(f"s{i}", 1.0).model_copy(update={"event_id": f"t{i}", "traces": [
        Trace(call_indices=[0], token_ids=list(range(1, 2 + i * 40)), loss_mask=[0] * (1 + i * 40),
              logprobs=[0.0] * (1 + i * 40))]}) for i in range(32)]

    async def run():
        client = JudgeClient(cfg, lambda ids: "x" * len(ids), lambda text: len(text) // 4)
        try:
            return await asyncio.gather(*(client.judge(t, "Rule: shortest") for t in members))
        finally:
            await client.close()

    verdicts = asyncio.run(run())
    seen = arrivals(log)
    assert {e["outcome"] for e in seen} >= {"timeout", "rate_limited", "garbage", "server_error", "ok"}
    assert all(v.failure is None for v in verdicts), [v.detail for v in verdicts if v.failure]
    for t, v in zip(members, verdicts):
        text = "x" * len(t.traces[0].token_ids)
        assert v.score == score("Rule: shortest", "Transcript:\n\n" + text)[0] and v.trajectory_id == t.event_id
    assert sum(v.attempts for v in verdicts) == len(seen)  # every attempt reached the server once
    assert max_in_window([e["t"] for e in seen], 1.0) <= 16


def test_each_failure_class_is_named(rule_judge):
    url, _ = rule_judge(fail_rate=1.0, stall_s=1.0)
    cfg = config(base_url=url, timeout_s=0.3, max_attempts=1, requests_per_window=1000)
    members = [_traj(f"s{i}", 1.0).model_copy(update={"event_id": f"t{i}"}) for i in range(24)]

    async def run():
        client = JudgeClient(cfg, lambda ids: str(ids), lambda text: 1)
        try:
            return await asyncio.gather(*(client.judge(t, f"Rule: answer={i}") for i, t in enumerate(members)))
        finally:
            await client.close()

    failures = {v.failure for v in asyncio.run(run())}
    assert failures == {"timeout", "rate_limited", "unparseable", "http_error"}


def test_the_rule_judges_rules():
    task = "## Task\nCompute 3 + 4 and write only the result to answer.txt using the write_file tool.\n"
    call = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "%s"}}\n</tool_call>'
    assert score(task + "Rule: arith", call % "7")[0] == 5
    assert score(task + "Rule: arith", (call % "7") + (call % "8"))[0] == -5  # the last write counts
    assert score(task + "Rule: arith", "I think it is 7.")[0] == -5
    assert score("Rule: arith", "user: Compute 3 + 4 and write ...\n" + call % "7")[0] == 5  # the task in the transcript
    escaped = '{"name": "write_file", "arguments": "{\\"path\\": \\"answer.txt\\", \\"content\\": \\"7\\"}"}'
    assert score(task + "Rule: arith", escaped)[0] == 5
    assert score("Rule: answer=42", call % "42")[0] == 5 and score("Rule: answer=42", "")[0] == -3
    assert score("Rule: shortest", "x" * 400)[0] == 3 and score("Rule: shortest", "x" * 4000)[0] == -5
    assert score("no rule here", "x")[0] == 0


def test_an_experiment_names_its_judge_in_one_line(tmp_path):
    from polarstream.driver.experiment import ExperimentError, load_experiment

    exp = load_experiment(__import__("pathlib").Path(__file__).parents[2] / "examples" / "judge_arith.yaml")
    assert exp.judge["preset"] == "judge_only" and exp.judge["rubric"] == "Rule: arith"
    bad = tmp_path / "bad.yaml"
    bad.write_text("judge:\n  base_url: http://x/v1\n  preset: judge-only\n")
    with pytest.raises(ExperimentError, match="judge.preset: Input should be 'outcome_plus' or 'judge_only'"):
        load_experiment(bad)
    bad.write_text("judge:\n  base_url: http://x/v1\n  api_key: sk-1\n")
    with pytest.raises(ExperimentError, match="judge.api_key: give the key as POLAR_JUDGE_API_KEY"):
        load_experiment(bad)


def test_a_steps_result_counts_its_members_masked_by_reason():
    from polarstream.driver.results import step_result
    from schemas import TrainingGroup

    groups = [TrainingGroup(group_id=g, trajectories=[_traj("a", 1.0)], advantages=[0.0], masked=list(reasons),
                            masked_reasons=reasons)
              for g, reasons in (("g1", {"b": "judge:timeout", "c": "judge:refusal"}), ("g2", {"d": "judge:timeout"}))]
    assert step_result(0, groups, 1.0, 1).masked_reasons == {"judge:refusal": 1, "judge:timeout": 2}


def test_the_runs_judge_reaches_its_streams_worker_as_a_file_it_loads(tmp_path):
    """configure.py carries the experiment's judge: to RunConfig; components.judge_file writes the worker's
    --judge YAML with the policy's tokenizer, which the worker's loader reads back, endpoint and key from
    the settings where the file names none."""
    import yaml

    from infra.settings import Settings
    from polarstream.driver.components import judge_file
    from polarstream.driver.config import RunConfig
    from streams.cli import load_judge

    cfg = RunConfig(run_dir=tmp_path, judge={"rubric": "Rule: arith", "preset": "judge_only"})
    path = judge_file(cfg, tmp_path / "model")
    assert yaml.safe_load(path.read_text()) == {"tokenizer": str(tmp_path / "model" / "tokenizer.json"),
                                                "rubric": "Rule: arith", "preset": "judge_only"}
    settings = Settings(judge_base_url="http://judge:1/v1", judge_model="m", judge_api_key="sk-secret")
    loaded = load_judge(path, settings)
    assert (loaded.base_url, loaded.model, loaded.api_key.get_secret_value()) == ("http://judge:1/v1", "m", "sk-secret")
    assert "sk-secret" not in repr(loaded) and "sk-secret" not in loaded.fingerprint()
