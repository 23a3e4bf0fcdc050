"""The merge-rate report: pure tests on built CallRecorded sessions, and the command on the real Kafka."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.harnesses.report import full_prompts, markdown_table, merge_report, session_stats
from schemas import CallRecorded, ChainInfo, PromptDelta
from tests.plugins.rollout import settings_env


def call(i, prompt=None, delta=None, completion=(9,), *, sid="s", harness="pi", provider="openai.chat", side=False,
         error="", extends=None, reason="", event_id=None):
    return CallRecorded(session_id=sid, call_index=i, provider=provider, harness=harness, side_call=side, error=error,
                        prompt_ids=None if delta else list(prompt), prompt_delta=delta, completion_ids=list(completion),
                        completion_logprobs=[-0.5] * len(completion), chain=ChainInfo(extends_call_index=extends, break_reason=reason),
                        **({"event_id": event_id} if event_id else {}))


def chain_of_three():
    """main 0 -> side 1 -> failed 2 -> main 3 (extends 0) -> main 4 (extends 3), deltas against their bases."""
    return [
        call(0, [1, 2, 3], completion=[4, 5], reason="first_call"),
        call(1, delta=PromptDelta(base_call_index=0, base_len=2, suffix_ids=[7]), completion=[8], side=True, reason="side_call"),
        call(2, delta=PromptDelta(base_call_index=0, base_len=5, suffix_ids=[6] * 50), completion=[], error="400 x: too long",
             extends=0),
        call(3, delta=PromptDelta(base_call_index=0, base_len=5, suffix_ids=[6]), completion=[10, 11], extends=0),
        call(4, delta=PromptDelta(base_call_index=3, base_len=8, suffix_ids=[12]), completion=[13], extends=3),
    ]


def test_full_prompts_resolve_deltas_against_full_sequences():
    p = full_prompts(chain_of_three())
    assert p[1] == [1, 2, 7] and p[3] == [1, 2, 3, 4, 5, 6] and p[4] == [1, 2, 3, 4, 5, 6, 10, 11, 12]
    assert len(p[2]) == 55
    orphan = call(1, delta=PromptDelta(base_call_index=0, base_len=1, suffix_ids=[2]))  # its base is absent
    assert full_prompts([orphan]) == {}


def test_side_and_failed_calls_are_not_continuations():
    s = session_stats(chain_of_three())
    assert (s["calls"], s["main_calls"], s["side_calls"], s["failed_calls"]) == (5, 3, 1, 1)
    assert (s["continuations"], s["merged"], s["gateway_merged"], dict(s["breaks"])) == (2, 2, 2, {})


def test_a_rewritten_history_is_a_break_with_the_gateways_reason():
    calls = [call(0, [1, 2], completion=[3], reason="first_call"),
             call(1, [1, 2, 99, 5], completion=[6], reason="assistant_turn_changed"),  # our [3] was rewritten
             call(2, [1, 2, 99, 5, 6, 7], completion=[8], extends=1),
             call(3, [5, 5], completion=[1])]  # no reason given: a gateway bug shows as "unexplained"
    s = session_stats(calls)
    assert (s["continuations"], s["merged"]) == (3, 1)
    assert dict(s["breaks"]) == {"assistant_turn_changed": 1, "unexplained": 1}
    # the tokens disagree with a claim of extension: gateway_agrees turns false
    lying = [call(0, [1, 2], completion=[3]), call(1, [1, 2, 4], completion=[5], extends=0)]
    row = merge_report(lying)["pi/openai.chat"]
    assert (row["merged"], row["gateway_merged"], row["gateway_agrees"], row["merge_rate"]) == (0, 1, False, 0.0)


def test_report_groups_by_harness_and_api_and_dedupes_redeliveries():
    a = chain_of_three()
    b = [call(0, [1], completion=[2], sid="t", harness="codex", provider="openai.responses", event_id="e0"),
         call(1, [1, 2, 3], completion=[4], sid="t", harness="codex", provider="openai.responses", extends=0, event_id="e1")]
    c = [call(0, [1], completion=[2], sid="u", harness="", provider="anthropic.messages")]  # alone: no continuation
    report = merge_report([*a, *b, b[1], *c])  # b[1] delivered twice
    assert list(report) == ["codex/openai.responses", "pi/openai.chat", "unknown/anthropic.messages"]
    assert report["codex/openai.responses"] | {"breaks": {}} == {
        "sessions": 1, "calls": 2, "main_calls": 2, "side_calls": 0, "failed_calls": 0, "parse_errors": 0, "continuations": 1,
        "merged": 1, "gateway_merged": 1, "unresolved": 0, "breaks": {}, "merge_rate": 1.0, "gateway_agrees": True}
    assert report["pi/openai.chat"]["merge_rate"] == 1.0 and report["pi/openai.chat"]["failed_calls"] == 1
    assert report["unknown/anthropic.messages"]["merge_rate"] is None
    table = markdown_table(report)
    assert "| pi/openai.chat | 1 | 5 (3 + 1 + 1) | 2 | 2 | 1.00 | none |" in table
    assert "| unknown/anthropic.messages | 1 | 1 (1 + 0 + 0) | 0 | 0 | - | none |" in table
    json.dumps(report)  # the JSON the command writes


@pytest.mark.integration
def test_merge_report_command_reads_the_calls_topic(polar_settings, tmp_path):
    from tests.streams.helpers import publish

    publish(polar_settings, chain_of_three())
    out = tmp_path / "rates.json"
    cmd = [sys.executable, "-c", "from polarstream.cli import main; main()", "harness", "merge-report", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=settings_env(polar_settings),
                         cwd=Path(__file__).parents[2], timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert json.loads(res.stdout) == report
    assert report["pi/openai.chat"]["merge_rate"] == 1.0 and report["pi/openai.chat"]["calls"] == 5
    md = subprocess.run([*cmd[:-2], "--markdown"], capture_output=True, text=True, env=settings_env(polar_settings),
                        cwd=Path(__file__).parents[2], timeout=120)
    assert md.returncode == 0 and "| pi/openai.chat | 1 | 5 (3 + 1 + 1) |" in md.stdout, md.stderr
