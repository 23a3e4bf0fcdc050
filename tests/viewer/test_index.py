"""The viewer's index and lanes, from recorded-looking sessions (streams/synthetic.py): no Kafka."""

from __future__ import annotations

from polarstream.viewer.index import RunIndex
from polarstream.viewer.lanes import chain_spans, session_lanes
from schemas import SessionEvent, encode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.synthetic import record_group, record_session, SessionSpec
from streams.trajectory import build_trajectory


def indexed(recs, with_group: bool = True) -> RunIndex:
    """An index fed with the sessions' calls and finished events, their trajectories and the group."""
    cfg, idx, trajs = StreamsConfig(), RunIndex("p."), []
    for r in recs:
        for i, c in enumerate(r.calls):
            idx.feed("calls", encode(c, packed=i % 2 == 1))  # both encodings, as on a topic of old and new records
        idx.feed("session-events", encode(r.finished))
        trajs.append(build_trajectory(r.finished, [CallTokens.from_record(c) for c in r.calls], cfg))
        idx.feed("trajectories", encode(trajs[-1], packed=len(trajs) % 2 == 1))
    if with_group:
        idx.feed("groups", encode(build_group(recs[0].finished.group_id, trajs, cfg), packed=True))
    return idx


def test_records_are_indexed_once_by_event_id_and_bad_bytes_are_counted():
    recs = record_group("g", [1.0, 0.0])
    idx = indexed(recs)
    seq = idx.seq
    assert not idx.feed("calls", encode(recs[0].calls[0]))  # a redelivery changes nothing
    assert not idx.feed("calls", b"{not json")
    assert (idx.seq, idx.undecodable) == (seq, 1)
    s = idx.sessions["g-s0"]
    assert sorted(s.calls) == list(range(4)) and (s.status, s.reward, s.group_id) == ("ok", 1.0, "g")
    assert [x.session_id for x in idx.group_sessions("g")] == ["g-s0", "g-s1"]
    assert idx.group_ids() == ["g"]
    (cell,) = idx.cells()
    assert (cell["samples"], cell["mean_reward"], cell["pass@1"], cell["pass@2"]) == (2, 0.5, 0.5, 1.0)
    assert sorted(r for _, r in idx.rewards) == [0.0, 1.0]


def test_masked_member_says_why_from_its_trajectory_or_its_finished_event():
    idx = indexed(record_group("g", [1.0, 0.0, None], statuses=["ok", "ok", "infra_error"]))
    assert idx.groups["g"].masked == ["g-s2"]
    assert idx.masked_reason("g-s2").startswith("status infra_error")
    idx.feed("session-events", encode(SessionEvent(session_id="lost", group_id="g", kind="finished",
                                                   status="failed", detail="harness crashed")))
    assert idx.masked_reason("lost") == "status failed: harness crashed"
    assert idx.masked_reason("never-seen") == "no trajectory or finished event read"


def test_a_member_masked_by_its_judge_says_the_failures_class():
    recs = record_group("j", [1.0, 0.0, 1.0])
    cfg, idx, trajs = StreamsConfig(), RunIndex("p."), []
    for r in recs:
        idx.feed("session-events", encode(r.finished))
        trajs.append(build_trajectory(r.finished, [CallTokens.from_record(c) for c in r.calls], cfg))
        idx.feed("trajectories", encode(trajs[-1]))
    trajs[1] = trajs[1].model_copy(update={"usable": False})  # as the judge stage masks it
    idx.feed("groups", encode(build_group("j", trajs, cfg, {"j-s1": "judge:timeout"})))
    assert idx.masked_reason("j-s1") == "judge:timeout" and idx.masked_reason("j-s0").startswith("status ok")


def test_lanes_follow_assembly_side_calls_and_breaks_start_their_own_lane():
    r = record_session(SessionSpec("s", "g", turns=4, side_call_at=1, compaction_at=3))
    lanes = session_lanes(reversed(r.calls))  # any order in, call order out
    assert [row.call.call_index for row in lanes.rows] == list(range(5))
    assert [(row.lane, row.starts_lane, row.note) for row in lanes.rows] == [
        (0, True, "first_call"), (1, True, "side_call"), (0, False, ""), (0, False, ""), (2, True, "compaction")]
    assert lanes.breaks == ["compaction"]  # the side call is not a break of the conversation


def test_a_call_without_a_trace_has_no_lane_and_says_why():
    r = record_session(SessionSpec("s", "g", turns=3))
    failed = r.calls[1].model_copy(update={"error": "500 api_error: engine down", "completion_ids": [],
                                           "completion_logprobs": []})
    lanes = session_lanes([r.calls[0], failed])
    assert (lanes.rows[1].lane, lanes.rows[1].note) == (None, "error")


def test_chain_spans_cover_the_tokens_with_sampled_logprobs_and_scrubbed_ranges():
    r = record_session(SessionSpec("s", "g", turns=3))
    calls = {c.call_index: c for c in r.calls}
    calls[0] = calls[0].model_copy(update={"scrubbed_spans": [[2, 5]]})
    (chain,) = session_lanes(calls.values()).chains
    spans = chain_spans(chain, calls)
    assert [t for sp in spans for t in sp.ids] == chain.tokens  # nothing lost, nothing doubled
    sampled = [sp for sp in spans if sp.sampled]
    assert [sp.call_index for sp in sampled] == [0, 1, 2]
    assert [sp.logprobs for sp in sampled] == [c.completion_logprobs for c in r.calls]
    assert [sp.ids for sp in sampled] == [c.completion_ids for c in r.calls]
    scrubbed = [sp for sp in spans if sp.scrubbed]
    assert [(sp.start, len(sp.ids), sp.sampled) for sp in scrubbed] == [(2, 3, False)]
