"""Real Claude Code running two Task sub-agents at once through a gateway node (bench/harness_sessions.py's
script and analysis, four turns): the sub-agents' calls are in flight together (one lock per chain, not
per session), and the main loop and each sub-agent extend their own chain, with no unexplained break."""

from __future__ import annotations

import asyncio

import pytest

from bench.harness_sessions import SUB_AGENT_STEP, run_sessions, summarize
from gateway.harnesses.report import read_calls
from tests.harnesses.test_all_clis import HARNESSES

pytestmark = [pytest.mark.integration, pytest.mark.harness]


async def test_parallel_task_sub_agents_generate_together_and_each_merges(polar_settings, harness_cache, tmp_path):
    claude_code = [h for h in HARNESSES if h[0]["name"] == "claude_code"]
    tasks = await run_sessions(polar_settings, tmp_path, SUB_AGENT_STEP + 1, claude_code, agent_s=240, sub_agents=2)
    calls = await asyncio.to_thread(read_calls, polar_settings)
    (row,) = summarize(calls, tasks).values()
    assert row["status"] == "ok", row
    assert (row["chains"], row["sub_agent_chains"], row["unexplained_breaks"]) == (3, 2, 0), row
    assert row["merge_rate"] == 1.0 and row["failed_calls"] == 0, row
    assert row["sub_agent_overlapping_calls"] >= 1, row  # serialized per session, no two would overlap
    # every call recorded once, 0..n-1 in publish order, whatever chain it belongs to
    mine = sorted({c.call_index for c in calls if c.harness == "claude_code"})
    assert mine == list(range(row["calls"]))
