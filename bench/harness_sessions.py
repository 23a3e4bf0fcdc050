"""Scripted multi-turn sessions of every real CLI, through gateway -> Kafka -> both trace builders.

Each of the six CLIs (pi on all four of its APIs: nine sessions) runs one scripted session of ``--turns``
tool-using turns (12; 8 with ``--quick``) on a small repository (``calc.py`` with a bug and its failing
``test_calc.py``): list, read, run the test, fix, re-run, add a test, run it, grep, count, ... then a
final answer. The machinery is tests/harnesses/test_all_clis.py's: one gateway ``Node`` running the
CLIs in its bwrap sandbox, the rollout server, the real tiny CPU engine in scripted mode with
``script_window`` (docs/engine.md), a Kafka broker of its own (or ``--bootstrap``).

The script: each step's tool call is a real shell command, in the CLI's own shell tool, that ends by
printing ``step<k>-by-<tool>`` (built by printf, so the command text itself never holds the marker);
the next call's last user/tool message holds that marker and the engine answers with step k+1. Claude
Code's step 3 is an ``Agent`` (Task) call instead (``--sub-agents N``: N of them in one message, which
Claude Code runs at once; tests/harnesses/test_sub_agents.py runs 2); each sub-agent's own calls run
two scripted shell steps (``sub<k>-by-Bash``) and answer with the step-3 marker, which reaches the main
loop as the Agent tool's result. The row counts the pairs of sub-agent calls that were in flight
together (``sub_agent_overlapping_calls``). opencode's title request is a side call (answered with the
script's fallback text).
Claude Code puts system messages after tool results (its agent list, "file was modified" notes), so the
script matches with ``skip_system`` (docs/engine.md).

The recorded ``CallRecorded`` events are read back from Kafka, and each session's calls go through the
streams' own code path, ``CallTokens.from_record`` then ``streams.builders.assemble``, once with
``per_request`` and once with ``prefix_merging`` (side calls kept as their own traces, the default).
Per ``harness/provider`` row: calls (main, side, failed), main chains (from the fold: one for the main
loop, one per sub-agent), break reasons, trainer tokens (the sum of the traces' token ids) and
sequences (traces) under each builder, their ratio, and the merge rate (main calls that extended a chain
over main calls that were not the start of an agent's chain).

A new main chain is *explained* when it starts a new agent: leading system messages, first other
message (its task), tool names and model (the gateway's chain key, gateway/sessions.py ``tip_key``)
that no earlier chain of the session had (a sub-agent). Any other new main chain is an *unexplained break*: the same agent's next call did not
extend its previous one. Top level: ``min_token_ratio`` (the smallest per-row per_request/prefix_merging
token ratio), ``unexplained_breaks`` (summed over rows), ``turns``, ``wall_s`` and ``load_avg``.

    .venv/bin/python bench/harness_sessions.py [--quick] [--turns N] [--clis claude_code,pi]
                                               [--bootstrap HOST:PORT] [--write-docs] [--dump-calls DIR]

``--write-docs`` writes the JSON to docs/harness-merge-rates.json. The CLIs must be installed
(``polarstream harness install``); bwrap must work.
"""

from __future__ import annotations

MEASURES = ('gateway/', 'engine/', 'streams/', 'tests/harnesses/test_all_clis.py')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harnesses.test_all_clis import HARNESSES, shell_call  # noqa: E402  (after the path insert)

SUB_AGENT_STEP = 3  # Claude Code's step that is an Agent (Task) call
SUB_AGENT_STEPS = 2  # shell steps each sub-agent runs itself before answering
SUB_AGENT_NAMES = "abcd"  # that step starts this many general-purpose sub-agents at once (one message, N Agent calls)
AGENT_TOOL = "Agent"  # Claude Code 2.x's name for the Task tool

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_mul():\n"
        "    assert mul(2, 3) == 6\n\n\nif __name__ == \"__main__\":\n    for name, fn in list(globals().items()):\n"
        "        if name.startswith(\"test_\"):\n            fn()\n    print(\"tests passed\")\n")
FILES = {"calc.py": CALC, "test_calc.py": TEST, "README.md": "A tiny calculator.\n"}
# The session's commands in order: list, read, run the test (fails), fix, re-run (passes), add a test,
# run it, then more of the same kind; a session of N turns runs the first N.
STEPS = [
    "ls -la",
    "cat calc.py",
    "cat test_calc.py",
    "python3 test_calc.py",
    "sed -i 's/return a - b/return a + b/' calc.py && cat calc.py",
    "python3 test_calc.py",
    "printf '\\n\\ndef test_add_negative():\\n    assert add(-2, 3) == 1\\n' >> test_calc.py && tail -n 3 test_calc.py",
    "python3 test_calc.py",
    "grep -n 'def ' calc.py test_calc.py",
    "wc -l calc.py test_calc.py README.md",
    "python3 -c 'import calc; print(calc.add(20, 22), calc.mul(6, 7))'",
    "python3 test_calc.py",
    "ls -la",
    "cat calc.py",
    "python3 test_calc.py",
    "git status --short 2>/dev/null || ls",
]


def marker(kind: str, k: int, tool: str) -> str:
    return f"{kind}{k:02d}-by-{tool}"


def step_command(kind: str, k: int, tool: str, command: str) -> str:
    """``command``, then the marker printed by printf (the command text never contains the marker)."""
    return f"{command}; printf '{kind}%02d-by-%s\\n' {k} {tool}"


def script(turns: int, sub_agents: int = 1) -> dict:
    """The engine script for sessions of ``turns`` tool-using turns, for every CLI's shell tool at once."""
    if not 2 <= turns <= len(STEPS):
        raise SystemExit(f"--turns must be between 2 and {len(STEPS)}")
    tools = sorted({tool for _, tool in HARNESSES} | {"Bash"})
    out: list[dict] = []
    for tool in tools:
        # the latest marker first (a later step's output may still show an earlier marker in its context)
        for k in range(turns, 0, -1):
            if k == turns:
                out.append({"match": marker("step", k, tool), "text": f"All {turns} steps done; the tests pass."})
            elif tool == "Bash" and k + 1 == SUB_AGENT_STEP:  # sub-agents of one kind, in parallel
                out.append({"match": marker("step", k, tool), "tool_calls": [{"name": AGENT_TOOL, "arguments": {
                    "description": f"check the tests ({part})", "subagent_type": "general-purpose",
                    "prompt": f"Sub-agent task subtask-{part}-for-{tool}: read the tests and run them with {tool}, "
                              "then report."}} for part in SUB_AGENT_NAMES[:sub_agents]]})
            else:
                out.append({"match": marker("step", k, tool),
                            "tool_calls": [shell_call(tool, step_command("step", k + 1, tool, STEPS[k]))]})
        # the first step: the instruction names the tool
        out.append({"match": f"session using {tool}\\.",
                    "tool_calls": [shell_call(tool, step_command("step", 1, tool, STEPS[0]))]})
        if tool == "Bash":  # the sub-agent: two shell steps, then the answer the main loop continues from
            out.append({"match": marker("sub", SUB_AGENT_STEPS, tool),
                        "text": f"Sub-agent finished: {marker('step', SUB_AGENT_STEP, tool)}"})
            for k in range(SUB_AGENT_STEPS - 1, 0, -1):
                out.append({"match": marker("sub", k, tool),
                            "tool_calls": [shell_call(tool, step_command("sub", k + 1, tool, STEPS[2 + k]))]})
            out.append({"match": f"subtask-[{SUB_AGENT_NAMES}]-for-{tool}",
                        "tool_calls": [shell_call(tool, step_command("sub", 1, tool, "cat test_calc.py"))]})
    # skip_system: Claude Code puts system messages (agent list, "file was modified") after tool results
    return {"turns": out, "fallback": {"text": "Done."}, "skip_system": True}  # fallback: titles, routers


# ------------------------------------------------------------------------------------ analysis


def agent_key(call) -> tuple:
    """The recorded request's agent: leading system messages, the first other message (its task), tool
    names and model (the gateway's chain key, ``tip_key``). Read from a chain's first call, whose
    request holds the whole history."""
    msgs = call.request.get("messages", [])
    n = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
    task = (msgs[n].get("role"), str(msgs[n].get("content"))) if n < len(msgs) else None
    return (tuple(str(m.get("content")) for m in msgs[:n]), task,
            tuple(t.get("name") for t in call.request.get("tools", [])), call.model)


def overlapping_pairs(chains: list[list]) -> int:
    """Pairs of calls from different chains that were in flight at the same time (gateway timings)."""
    spans = [[(c.timings.received_at, c.timings.received_at + c.timings.total_ms / 1000) for c in ch] for ch in chains]
    return sum(a0 < b1 and b0 < a1 for i, xs in enumerate(spans) for ys in spans[i + 1:] for a0, a1 in xs for b0, b1 in ys)


def session_row(calls: list) -> dict:
    """One session's calls through both builders (the streams' code path) and its fold's chains."""
    from streams.assembly import CallTokens, fold_calls
    from streams.builders import assemble

    by_index: dict = {}
    for c in calls:
        by_index.setdefault(c.call_index, c)
    ordered = [by_index[i] for i in sorted(by_index)]
    tokens = [CallTokens.from_record(c) for c in ordered]
    main = [c for c in ordered if not c.side_call and not c.error]
    row: dict = {"calls": len(ordered), "main_calls": len(main), "side_calls": sum(c.side_call and not c.error for c in ordered),
                 "failed_calls": sum(bool(c.error) for c in ordered), "tool_turns": sum(bool(c.output.tool_calls) for c in main),
                 "gateway_merged": sum(c.chain.extends_call_index is not None and c.chain.break_reason != "retry" for c in main)}
    fold = fold_calls(tokens)
    main_chains = [ch for ch in fold.chains if not ch.side_call]
    seen: set = set()
    breaks: Counter = Counter()
    unexplained = 0
    sub_agents = 0
    for i, ch in enumerate(main_chains):
        key = agent_key(by_index[ch.members[0].call_index])
        if i:
            breaks[ch.break_reason] += 1
            if key in seen:
                unexplained += 1
            else:
                sub_agents += 1
        seen.add(key)
    # calls of the sub-agents' chains (all but the first) in flight together: they generate in parallel
    agents = [[by_index[m.call_index] for m in ch.members] for ch in main_chains[1:]]
    row.update(chains=len(main_chains), sub_agent_chains=sub_agents, sub_agent_overlapping_calls=overlapping_pairs(agents),
               breaks=dict(sorted(breaks.items())),
               unexplained_breaks=unexplained, dropped=dict(Counter(fold.dropped.values())))
    continuations = row["main_calls"] - len(main_chains) + unexplained
    row["merge_rate"] = round(fold.merged / continuations, 4) if continuations else None
    for builder in ("per_request", "prefix_merging"):
        a = assemble(tokens, builder)
        row[builder] = {"tokens": sum(len(t.token_ids) for t in a.traces), "sequences": len(a.traces),
                        "trainable_tokens": sum(sum(t.loss_mask) for t in a.traces)}
    pm = row["prefix_merging"]["tokens"]
    row["token_ratio"] = round(row["per_request"]["tokens"] / pm, 2) if pm else None
    return row


def summarize(calls: list, tasks: dict[str, dict]) -> dict[str, dict]:
    """Rows keyed ``harness/provider`` (one session each), in task order."""
    from gateway.harnesses.report import label

    by_task: dict[str, list] = defaultdict(list)
    seen: set = set()
    for c in calls:
        if c.event_id not in seen:
            seen.add(c.event_id)
            by_task[c.task_id].append(c)
    rows = {}
    for task_id, info in tasks.items():
        mine = by_task.get(task_id, [])
        if not mine:
            rows[f"{info['harness']}/?"] = {"calls": 0, **info}
            continue
        rows[label(mine)] = {**session_row(mine), **info}
    return rows


# ------------------------------------------------------------------------------------ the run


def log(msg: str) -> None:
    print(f"[harness_sessions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def run_sessions(settings, work: Path, turns: int, harnesses: list, agent_s: float,
                       sub_agents: int = 1) -> dict[str, dict]:
    import httpx
    import yaml

    from engine.local import start_engine_server
    from gateway.config import GatewayConfig
    from gateway.node.config import NodeConfig
    from gateway.node.node import Node
    from infra.models import ensure_model
    from infra.settings import CACHE_DIR
    from tests.plugins.rollout import start_rollout_server

    model_dir = ensure_model("tiny")
    (work / "script.yaml").write_text(yaml.safe_dump(script(turns, sub_agents)))
    engine = start_engine_server(model_dir, script=work / "script.yaml", script_window=256)
    rollout = start_rollout_server(settings)
    cfg = NodeConfig(work_dir=work / "node", cache_dir=CACHE_DIR, runtime="bwrap", node_id="bench", run_workers=3,
                     ready_target=2)
    node = Node(settings, cfg, GatewayConfig(engine_urls=[engine.url], model=str(model_dir)))
    tasks: dict[str, dict] = {}
    try:
        await node.start()
        log(f"engine, rollout server and node up; {len(harnesses)} sessions of {turns} turns")
        async with httpx.AsyncClient(base_url=rollout.url, timeout=30) as client:
            for i, (spec, tool) in enumerate(harnesses):
                task_id = f"hs{i}"
                task = {"task_id": task_id, "instruction": f"Fix calc.py so its tests pass; this is a scripted "
                        f"session using {tool}.", "num_samples": 1, "min_valid": 1, "harness": spec,
                        "workspace": {"kind": "files", "files": FILES}, "timeouts": {"agent_s": agent_s},
                        "evaluator": {"kind": "command", "command": "python3 test_calc.py"}}
                r = await client.post("/tasks", json=task)
                assert r.status_code == 202, r.text
                tasks[task_id] = {"harness": spec["name"]}
            started, done = time.monotonic(), set()
            while len(done) < len(tasks) and time.monotonic() - started < agent_s + 120:
                await asyncio.sleep(2)
                for task_id in set(tasks) - done:
                    st = (await client.get(f"/tasks/{task_id}")).json()
                    if st.get("finished"):
                        done.add(task_id)
                        sample = next(iter((st.get("samples") or {}).values()), {})
                        tasks[task_id].update(status=sample.get("status"), reward=sample.get("reward"),
                                              session_s=round(time.monotonic() - started, 1))
                        if sample.get("status") != "ok":
                            tasks[task_id]["detail"] = (sample.get("detail") or "")[-300:]
                        log(f"{task_id} {tasks[task_id]['harness']} finished: {sample.get('status')} "
                            f"reward {sample.get('reward')} after {time.monotonic() - started:.0f} s ({len(done)}/{len(tasks)})")
    finally:
        await node.stop(drain=False)
        rollout.stop()
        engine.stop()
    return tasks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 turns per session instead of 12")
    ap.add_argument("--turns", type=int, default=0, help="tool-using turns per session (default 12, --quick 8)")
    ap.add_argument("--clis", default="", help="comma-separated harness names (default: all six)")
    ap.add_argument("--bootstrap", default="", help="a running Kafka (default: a broker of our own)")
    ap.add_argument("--sub-agents", type=int, default=1, choices=range(1, len(SUB_AGENT_NAMES) + 1),
                    help="Task sub-agents Claude Code's step 3 starts at once (1, as issue 20 specifies)")
    ap.add_argument("--agent-s", type=float, default=900, help="each session's agent timeout")
    ap.add_argument("--write-docs", action="store_true", help="also write docs/harness-merge-rates.json")
    ap.add_argument("--dump-calls", type=Path, help="write every recorded call as JSON lines here (debugging)")
    args = ap.parse_args(argv)
    turns = args.turns or (8 if args.quick else 12)
    harnesses = [h for h in HARNESSES if not args.clis or h[0]["name"] in args.clis.split(",")]
    load_before = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()

    from bench._procs import kafka_for_bench
    from gateway.harnesses.report import read_calls

    work = Path(tempfile.mkdtemp(prefix="polar-harness-sessions-"))
    settings, kafka = kafka_for_bench(args.bootstrap, work / "kafka", "hsess")
    try:
        tasks = asyncio.run(run_sessions(settings, work, turns, harnesses, args.agent_s, args.sub_agents))
        calls = read_calls(settings)
    finally:
        if kafka is not None:
            kafka.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.dump_calls:
        args.dump_calls.mkdir(parents=True, exist_ok=True)
        (args.dump_calls / "calls.jsonl").write_text("".join(c.model_dump_json() + "\n" for c in calls))
    rows = summarize(calls, tasks)
    ratios = [r["token_ratio"] for r in rows.values() if r.get("token_ratio")]
    out = {"min_token_ratio": min(ratios) if len(ratios) == len(rows) and ratios else None,
           "unexplained_breaks": sum(r.get("unexplained_breaks", 0) for r in rows.values()),
           "turns": turns, "sessions_ok": sum(r.get("status") == "ok" for r in rows.values()), "sessions": len(rows),
           "harnesses": rows, "wall_s": round(time.perf_counter() - t0, 1),
           "load_avg": {"before": load_before, "after": round(os.getloadavg()[0], 2)}}
    text = json.dumps(out, indent=2)
    if args.write_docs:
        (ROOT / "docs/harness-merge-rates.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
