"""bench/render.py on a fixture results object: comparisons, verdicts, and a page that matches the JSON."""

from __future__ import annotations

import copy
import json

import pytest

from bench.render import END, START, comparisons_for, flatten, fmt, is_number, render, render_into, verdict
from tests.bench.mdtables import cells, close, number, section, shown_values, tables

GATEWAY = {"mode": "quick", "cores": 2, "peers": {"rllm-model-gateway": "0.1.0", "agentlightning": "not installed: ..."},
           "results": {
               "direct_engine.chat_stream": {"1": {"calls_per_s": 900.5, "p50_ms": 1.1, "p99_ms": 2.5},
                                             "16": {"calls_per_s": 1500.0, "p50_ms": 9.0, "p99_ms": 20.0}},
               "polarstream.chat_stream": {"1": {"calls_per_s": 150.25, "p50_ms": 6.6, "p99_ms": 12.0},
                                           "16": {"calls_per_s": 300.0, "p50_ms": 50.0, "p99_ms": 90.0},
                                           "added_latency_ms": {"p50": 5.5, "p99": 9.5}},
               "rllm-model-gateway.chat_stream": {"1": {"calls_per_s": 100.0, "p50_ms": 9.9, "p99_ms": 15.0},
                                                  "16": {"calls_per_s": 330.0, "p50_ms": 48.0, "p99_ms": 99.0}},
               "agentlightning.chat_json": {"failed": "ConnectError: refused"}}}
STREAMS = {"bench": "streams", "builders": {
    "per_request": {"sequences": 120, "trainable_tokens": 5000, "trainer_tokens": 90000, "longest_sequence": 2000},
    "prefix_merging": {"sequences": 30, "trainable_tokens": 5000, "trainer_tokens": 20000, "longest_sequence": 6000}},
    "assembly": {"per_request": {"calls_per_s": 4000}, "prefix_merging": {"calls_per_s": 5000}, "fold_only_calls_per_s": 9000}}
CUSTOM = {"bench": "custom", "items": [{"size": 1, "x": 0.5}, {"size": 2, "x": 0.25}], "comparisons": [
    {"area": "Widgets", "metric": "speed", "ours": 30, "anchor": 10, "anchor_name": "old widget", "unit": "w/s"},
    {"area": "Widgets", "metric": "latency", "ours": 3.0, "anchor": 1.5, "anchor_name": "old | widget", "unit": "ms",
     "higher_is_better": False, "note": "loaded machine"},
    {"area": "Widgets", "metric": "broken", "ours": "fast", "anchor": 1},
    {"metric": "no area", "ours": 1, "anchor": 1}]}


def make_run() -> dict:
    benches = {}
    for name, result in (("gateway", GATEWAY), ("streams", STREAMS), ("custom", CUSTOM)):
        rows, problems = comparisons_for(name, copy.deepcopy(result))
        benches[name] = {"status": "ok", "seconds": 12.5, "command": f"python bench/{name}.py --quick",
                         "result": copy.deepcopy(result), "comparisons": rows, "comparison_problems": problems}
    benches["broken"] = {"status": "failed", "seconds": 1.0, "returncode": 1, "error": "exited with status 1",
                         "stderr_tail": "Traceback (most recent call last):\nValueError: boom"}
    return {"format": 1, "mode": "quick", "seconds": 40.0, "machine": {"cores": 2, "cpu_model": "Test CPU", "git_commit": "abc"},
            "benchmarks": benches}


def test_verdict_accounts_for_direction():
    assert verdict(30, 10, True) == "ours 3.00× better"
    assert verdict(30, 10, False) == "anchor 3.00× better"
    assert verdict(5, 10, False) == "ours 2.00× better"
    assert verdict(2.0, 2.0, None) == "equal"
    assert verdict(2.0, 2.5, None) == "differ by 0.5"
    assert verdict(0.0, 0.11, False) == "ours better"  # no padding vs some: no factor, still a winner
    assert verdict(0.0, 0.11, True) == "anchor better"


def test_fmt_keeps_three_significant_digits():
    assert [fmt(x) for x in (12345, 1234.56, 123.456, 12.345, 0.012345, 0.0, True, None)] == \
        ["12,345", "1,235", "123.5", "12.35", "0.0123", "0", "true", "—"]
    assert fmt("a|b\nc") == "a\\|b c"


def test_gateway_comparisons_are_derived_against_each_anchor():
    rows, problems = comparisons_for("gateway", GATEWAY)
    assert problems == []
    by = {(r["anchor_name"], r["metric"]): r for r in rows}
    p50 = by[("direct_engine.chat_stream", "p50 latency, 1 client (chat_stream)")]
    assert (p50["ours"], p50["anchor"], p50["ratio"]) == (6.6, 1.1, 6.0)
    assert p50["verdict"] == "anchor 6.00× better" and p50["higher_is_better"] is False
    rllm = by[("rllm-model-gateway.chat_stream", "calls/s, 1 client (chat_stream)")]
    assert rllm["verdict"] == "ours 1.50× better"
    assert not any(r["anchor_name"].startswith("agentlightning") for r in rows)  # its run failed: no numbers
    assert not any("64" in r["metric"] for r in rows)  # no 64-client run in this fixture


def test_streams_comparisons_put_prefix_merging_beside_per_request():
    rows, _ = comparisons_for("streams", STREAMS)
    by = {r["metric"]: r for r in rows}
    assert by["sequences to train"]["verdict"] == "ours 4.00× better"
    assert by["trainable (sampled) tokens"]["verdict"] == "equal"
    assert by["assembly speed (fold + build + verify)"]["ratio"] == 1.25


def test_script_comparisons_are_checked_not_trusted():
    rows, problems = comparisons_for("custom", CUSTOM)
    assert [r["metric"] for r in rows] == ["speed", "latency"]
    assert all(r["source"] == "script" for r in rows)
    assert rows[0]["higher_is_better"] is True  # the default
    assert problems == ["comparisons[2]: ours and anchor must be numbers", "comparisons[3]: needs area, metric, ours and anchor"]
    assert comparisons_for("custom", {"comparisons": {"a": 1}})[1] == ["comparisons: expected a list, got dict"]
    assert comparisons_for("unknown", {"x": 1}) == ([], [])


def test_page_comparison_tables_match_the_json():
    run = make_run()
    md = render(run)
    ours_vs = section(md, "### Ours vs anchor")
    expected = [c for e in run["benchmarks"].values() for c in e.get("comparisons", [])]
    shown = [r for _, header, rows in tables(ours_vs) for r in rows if header[0] == "metric"]
    assert len(shown) == len(expected) > 10
    for c, (metric, unit, ours, anchor_name, anchor, ratio, verdict_) in zip(expected, shown):
        assert metric == c["metric"] and anchor_name == c["anchor_name"] and unit == c["unit"]
        assert close(ours, c["ours"]) and close(anchor, c["anchor"]) and verdict_ == c["verdict"]
        assert close(ratio, c["ours"] / c["anchor"])
    assert "#### Widgets" in ours_vs and "- loaded machine (bench/custom.py)" in ours_vs


def test_page_shows_every_number_each_benchmark_printed():
    run = make_run()
    md = render(run)
    for name in ("gateway", "streams", "custom"):
        shown = shown_values(section(md, f"#### {name}: ok"))
        leaves = [(".".join(p), v) for p, v in flatten(run["benchmarks"][name]["result"])]
        assert len(shown) == len(leaves)  # each leaf once, comparisons list excluded
        for key, value in leaves:
            assert key in shown, key
            if is_number(value):
                assert close(shown[key], value), (key, shown[key], value)
    assert "comparisons problem: comparisons[2]" in section(md, "#### custom: ok")
    assert cells("| a | b \\| c |") == ["a", "b | c"]


def test_failed_benchmark_shows_its_stderr():
    md = render(make_run())
    failed = section(md, "#### broken: failed")
    assert "exited with status 1" in failed and "ValueError: boom" in failed
    status = {r[0]: r[1] for _, h, rows in tables(section(md, "### Benchmarks run")) for r in rows}
    assert status == {"gateway": "ok", "streams": "ok", "custom": "ok", "broken": "failed"}


def test_render_into_keeps_the_hand_written_text(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro by hand\n\n{START}\nold numbers\n{END}\n\n## Profiles\n\nnotes by hand\n")
    run = make_run()
    render_into(doc, run)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro by hand\n\n" + START) and text.endswith(END + "\n\n## Profiles\n\nnotes by hand\n")
    assert "old numbers" not in text and text.count(START) == 1
    render_into(doc, run)
    assert doc.read_text() == text  # idempotent
    fresh = tmp_path / "new" / "page.md"
    render_into(fresh, run)
    assert fresh.read_text().startswith("# Benchmarks\n") and END in fresh.read_text()


@pytest.mark.parametrize("value", [0.5, 1.004, 99.99, 123.44, 98765.4, 12])
def test_close_reads_back_what_fmt_writes(value):
    assert close(fmt(value), value) and number(fmt(value)) == pytest.approx(value, rel=0.006, abs=0.006)
    assert not close(fmt(value * 1.05 + 0.1), value)
    json.dumps(value)


def test_a_layout_the_deriver_did_not_foresee_is_a_problem_not_a_crash():
    rows, problems = comparisons_for("gateway", {"results": [{"target": "a list, not a dict"}]})
    assert rows == [] and problems[0].startswith("deriving comparisons from bench/gateway.py's JSON failed: ")


def test_a_peer_measured_non_streaming_sits_beside_our_non_streaming_numbers():
    res = copy.deepcopy(GATEWAY)
    res["results"]["agentlightning.chat_json"] = {"1": {"calls_per_s": 50.0, "p50_ms": 20.0, "p99_ms": 30.0}}
    res["results"]["polarstream.chat_json"] = {"1": {"calls_per_s": 100.0, "p50_ms": 10.0, "p99_ms": 15.0}}
    rows, problems = comparisons_for("gateway", res)
    agl = [r for r in rows if r["anchor_name"] == "agentlightning.chat_json"]
    assert problems == [] and agl and all("(chat_json)" in r["metric"] and "chat_stream" not in r["metric"] for r in agl)
    assert {r["metric"]: r["ours"] for r in agl}["calls/s, 1 client (chat_json)"] == 100.0
    del res["results"]["polarstream.chat_json"]  # ours not measured in that mode: the row says both modes
    agl = [r for r in comparisons_for("gateway", res)[0] if r["anchor_name"] == "agentlightning.chat_json"]
    assert agl[0]["metric"].endswith("(ours chat_stream, anchor chat_json)")


def test_simulations_are_labelled_in_every_comparison_area():
    result = {"kind": "simulation", "comparisons": [{"area": "Rollout prewarming", "metric": "m", "ours": 2, "anchor": 1}]}
    rows, _ = comparisons_for("rollout", result)
    assert rows[0]["area"] == "Rollout prewarming [simulation]"
    assert comparisons_for("rollout", dict(result, kind="measurement"))[0][0]["area"] == "Rollout prewarming"


def test_rounds_dirty_tree_and_staleness_are_on_the_page():
    from bench._rounds import interleaved

    run = make_run()
    block = interleaved({"per_request": lambda: {"calls": 3}, "prefix_merging": lambda: None}, 3, progress=False)
    run["benchmarks"]["streams"]["result"]["assembly"]["rounds"] = block
    run["machine"].update(git_dirty=True, git_dirty_files=["gateway/app.py"])
    md = render(run, {n: {"known": True, "packages": ["gateway/"], "files": ["gateway/app.py"]} for n in run["benchmarks"]})
    assert "**DIRTY: gateway, streams, custom, broken measured with uncommitted changes**" in md
    assert md.count("streams: measured at") >= 3 and md.count("changed since: `gateway/`") >= 4  # comparisons, rounds, numbers
    rounds = section(md, "#### streams: assembly.rounds")
    (_, header, rows), = tables(rounds)
    assert header[:3] == ["target", "passes", "wall s min"] and [r[0] for r in rows] == ["per_request", "prefix_merging"]
    assert rows[0][1] == "3" and close(rows[0][3], block["targets"]["per_request"]["wall_s"]["median"])
    numbers = section(md, "#### streams: ok")
    assert "passes" not in numbers  # each pass stays in the JSON; the page shows the summary


def test_gateway_scenarios_and_two_processes_are_compared():
    res = copy.deepcopy(GATEWAY)
    res["results"]["polarstream.chat_stream"]["extend_80kb"] = {"p50_ms": 6.0, "p99_ms": 9.0}
    res["results"]["direct_engine.chat_stream"]["extend_80kb"] = {"p50_ms": 2.0, "p99_ms": 4.0}
    res["results"]["polarstream_2proc.chat_stream"] = {"16": {"calls_per_s": 450.0, "p50_ms": 30.0, "p99_ms": 60.0}}
    rows, problems = comparisons_for("gateway", res)
    assert problems == []
    by = {(r["area"], r["metric"], r["anchor_name"]): r for r in rows}
    extend = by[("Gateway: an 80 KB call that extends its session, 1 client", "p50 latency (polarstream.chat_stream)",
                 "direct_engine.chat_stream")]
    assert (extend["ours"], extend["anchor"]) == (6.0, 2.0)
    scale = by[("Gateway: 2 processes behind the session router vs 1 (chat_stream)", "calls/s, 16 clients",
                "polarstream.chat_stream")]
    assert (scale["ours"], scale["anchor"], scale["verdict"]) == (450.0, 300.0, "ours 1.50× better")
    assert not [r for r in rows if r["anchor_name"].startswith("polarstream_2proc")]  # ours, never an anchor


def test_vllm_like_targets_are_compared_only_with_each_other():
    res = copy.deepcopy(GATEWAY)
    res["results"]["direct_engine@vllm_like.chat_stream"] = {"16": {"calls_per_s": 60.0, "p50_ms": 200.0, "p99_ms": 300.0}}
    res["results"]["polarstream@vllm_like.chat_stream"] = {"16": {"calls_per_s": 120.0, "p50_ms": 90.0, "p99_ms": 150.0}}
    res["results"]["rllm-model-gateway@vllm_like.chat_stream"] = {"16": {"calls_per_s": 50.0, "p50_ms": 250.0, "p99_ms": 400.0}}
    res.update(vllm_like_gateway_p50_ms_80kb=12.0, vllm_like_peer_p50_ms_80kb=40.0)
    rows, problems = comparisons_for("gateway", res)
    assert problems == []
    like = [r for r in rows if "@vllm_like" in r["anchor_name"]]
    assert {(r["metric"], r["ours"], r["anchor"]) for r in like} == {
        ("p50 latency of the 80 KB extending call, 1 client", 12.0, 40.0), ("calls/s, 16 clients", 120.0, 50.0)}
    assert all(r["anchor_name"] == "rllm-model-gateway@vllm_like.chat_stream" for r in like)
    # no row puts a vLLM-like figure beside one measured against the plain stub
    plain = [r for r in rows if "@vllm_like" not in r["anchor_name"]]
    assert 120.0 not in {r["ours"] for r in plain} and 60.0 not in {r["anchor"] for r in plain}
