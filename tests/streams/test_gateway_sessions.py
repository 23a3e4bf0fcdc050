"""Sessions recorded by the real gateway (OpenAI SDK -> gateway -> tiny engine -> Kafka) through a worker.

Two samples of one group each run a three-call tool conversation through the gateway, which records
them token-in/token-out (later prompts as deltas). With their finished events published, the worker
must merge each session into one trace that is exactly the last prompt followed by its sampled ids,
with every sampled id and logprob in place, and emit the group the pure functions compute, byte for byte.
"""

from __future__ import annotations

from schemas import TrainingGroup, decode, encode, resolve_prompt
from streams.assembly import CallTokens
from streams.builders import verify_trace
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.trajectory import build_trajectory
from tests.plugins.gateway import finished_events, read_calls, run_tool_session
from tests.streams.helpers import dedupe, publish, read_topic


def test_gateway_recorded_sessions_merge_into_one_faithful_trace(polar_settings, scripted_engine, gateway_factory,
                                                                  streams_worker):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    for i in range(2):
        run_tool_session(gw, f"gw-s{i}", i, "gw-group", "gw-task")
    calls = read_calls(polar_settings, 6)
    by_session = {sid: [c for c in calls if c.session_id == sid] for sid in ("gw-s0", "gw-s1")}
    assert [len(v) for v in by_session.values()] == [3, 3]
    finished = finished_events(by_session, "gw-group", "gw-task")
    publish(polar_settings, finished)

    streams_worker("--builder", "prefix_merging", "--tick-interval", "0.5")
    got, _ = dedupe(read_topic(polar_settings, "groups", until=lambda m: len(m) >= 1, timeout=90, idle=1.0), TrainingGroup)
    (raw,) = got.values()
    group = decode(raw, TrainingGroup)

    cfg = StreamsConfig(builder="prefix_merging")
    trajs = [build_trajectory(f, [CallTokens.from_record(c) for c in by_session[f.session_id]], cfg) for f in finished]
    assert raw == encode(build_group("gw-group", trajs, cfg), packed=True)  # the worker = the pure functions, byte for byte
    assert group.advantages[0] > 0 > group.advantages[1] and group.masked == []
    for traj in group.trajectories:
        session_calls = sorted(by_session[traj.session_id], key=lambda c: c.call_index)
        (trace,) = traj.traces  # the gateway's token-in/token-out prompts merge into one chain
        assert trace.call_indices == [0, 1, 2] and trace.break_reason == "first_call"
        full: dict[int, list[int]] = {}
        for c in session_calls:
            full[c.call_index] = resolve_prompt(c, full) + c.completion_ids
        assert trace.token_ids == full[2]  # last prompt + its sampled ids
        assert sum(trace.loss_mask) == sum(len(c.completion_ids) for c in session_calls)
        assert verify_trace(trace, {c.call_index: CallTokens.from_record(c) for c in session_calls}) == ""
