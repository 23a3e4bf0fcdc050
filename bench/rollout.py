"""Node pipeline throughput (a SIMULATION): sessions/min and run-slot utilization with and without the READY buffer.

What is simulated: INIT is a ``sleep`` and RUN is a ``sleep`` holding the run slot, so the speed-up this
prints follows from the INIT:RUN ratio it is given (with INIT 3 s and RUN 4 s, at most (3+4)/4 = 1.75x);
it shows the scheduler reaches that bound, not what real sessions gain. The JSON says
``"kind": "simulation"`` and bench/render.py marks every table built from it. A real-session mode
(real harness runs through a node with the engine) does not exist yet.

Polar's claim: prewarming (INIT of the next sessions while the current ones run) keeps the GPU busy. This
runs the real node pipeline (gateway/node/pipeline.py: INIT, READY, RUN and POSTRUN pools, real
processes in the chosen runtime) on N sessions whose INIT takes seconds (a ``prepare`` command that
sleeps, standing in for cloning a repo and installing dependencies) and whose RUN is an agent that keeps
its run slot busy for a fixed time (the ``command`` harness running ``sleep``: with a real model this is
the time the engine is serving the session). The same workload runs with ``ready_target=0`` (a session
is prepared only when a run slot frees, as a plain worker pool would do) and with a READY buffer.
SessionEvents are collected in memory: this measures scheduling, not Kafka.

    .venv/bin/python bench/rollout.py [--quick] [--runtime subprocess|bwrap] [--sessions N]

Both configurations run in interleaved rounds (bench/_rounds.py: without, with, without, with ...), so a
load change hits both. Prints one JSON object: per configuration the median over rounds of the wall time,
sessions/min, run-slot utilization (busy run slot seconds / (run slots x wall)) and the mean READY wait.
"""

from __future__ import annotations

MEASURES = ('gateway/node/', 'gateway/runtimes/', 'schemas/')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rounds import interleaved  # noqa: E402
from gateway.node.config import NodeConfig  # noqa: E402
from gateway.node.pipeline import Pipeline  # noqa: E402
from gateway.node.session import Job  # noqa: E402
from gateway.runtimes import make_runtime  # noqa: E402
from gateway.runtimes.tunnel import serve_unix_to_tcp  # noqa: E402
from schemas import EvaluatorSpec, HarnessSpec, SessionAssigned, TaskRequest, Timeouts, WorkspaceSpec  # noqa: E402


def jobs(n: int, init_s: float, run_s: float) -> list[Job]:
    """n sessions whose INIT sleeps ``init_s`` and whose harness holds its run slot ``run_s``."""
    task = TaskRequest(task_id="bench", instruction="bench", num_samples=n, min_valid=1,
                       workspace=WorkspaceSpec(kind="files", files={"README.md": "bench\n"}), prepare=[f"sleep {init_s}"],
                       harness=HarnessSpec(name="command", command=["sleep", str(run_s)]), evaluator=EvaluatorSpec(kind="none"),
                       timeouts=Timeouts(init_s=init_s * 10 + 30, agent_s=run_s * 10 + 30))
    return [Job(assigned=SessionAssigned(session_id=f"bench.s{i}", group_id="bench", task_id="bench", sample_index=i,
                                         session_key="k", task=task), attempt=0, key="k") for i in range(n)]


async def run_config(n: int, init_s: float, run_s: float, run_workers: int, ready_target: int, runtime: str) -> dict:
    """Feed n sessions to a pipeline as fast as admission allows (as the Kafka intake does) and time it."""
    work = Path(tempfile.mkdtemp(prefix="polar-bench-rollout-"))
    events: list = []

    async def publish(ev):
        events.append(ev)

    async def settle(_run_id):
        return 0

    cfg = NodeConfig(work_dir=work, cache_dir=work, runtime=runtime, node_id="bench", init_workers=max(4, ready_target + run_workers),
                     ready_target=ready_target, run_workers=run_workers, postrun_workers=4)
    # Sandboxes get the usual gateway tunnel; nothing listens behind it (the sleeping harness calls no model).
    sock = work / "gateway.sock"
    relay = await serve_unix_to_tcp(str(sock), "127.0.0.1", 9)
    pipeline = Pipeline(cfg, make_runtime(runtime, sock), 9, publish, settle)
    t0 = time.monotonic()
    pending = jobs(n, init_s, run_s)
    while pending:
        if pipeline.has_room():
            pipeline.admit(pending.pop(0))
        else:
            await asyncio.sleep(0.01)
    await pipeline.drain()
    wall = time.monotonic() - t0
    relay.close()
    shutil.rmtree(work, ignore_errors=True)
    finished = [e for e in events if e.kind == "finished"]
    waits = [e.metrics.get("ready_wait_s", 0.0) for e in finished]
    bad = [f"{e.status}: {e.detail}" for e in finished if e.status != "ok"]
    if bad:
        raise RuntimeError(f"sessions did not finish ok: {bad}")
    return {
        "ready_target": ready_target, "run_workers": run_workers, "sessions": n, "wall_s": round(wall, 2),
        "sessions_per_min": round(n / wall * 60, 2),
        "run_slot_utilization": round(pipeline.run_busy_s / (run_workers * wall), 3),
        "ready_wait_s_mean": round(sum(waits) / len(waits), 2),
    }


def median_pass(passes: list[dict]) -> dict:
    """One configuration's numbers as the median over its rounds (the counts are the same in every pass)."""
    out = {k: passes[0][k] for k in ("ready_target", "run_workers", "sessions")}
    for k in ("wall_s", "sessions_per_min", "run_slot_utilization", "ready_wait_s_mean"):
        out[k] = round(statistics.median(p[k] for p in passes), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 sessions, INIT 1.5 s, RUN 2 s, 3 rounds (under a minute)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both configurations")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--init-s", type=float, default=None, help="seconds of INIT (prepare) per session")
    ap.add_argument("--run-s", type=float, default=None, help="seconds a session holds its run slot")
    ap.add_argument("--run-workers", type=int, default=2)
    ap.add_argument("--ready-target", type=int, default=2)
    ap.add_argument("--runtime", default="subprocess", help="subprocess | bwrap")
    args = ap.parse_args()
    # Full: 10 sessions keeps 3 rounds of both configurations near 3 minutes (bench/run_all.py: BUDGET_S).
    n = args.sessions or (6 if args.quick else 10)
    init_s = args.init_s if args.init_s is not None else (1.5 if args.quick else 3.0)
    run_s = args.run_s if args.run_s is not None else (2.0 if args.quick else 4.0)
    configs = {"no_ready_buffer": 0, f"ready_target_{args.ready_target}": args.ready_target}
    # The work is sleeping, so CPU/wall is near 0 by design: no CPU floor.
    rounds = interleaved({name: (lambda rt=rt: asyncio.run(run_config(n, init_s, run_s, args.run_workers, rt, args.runtime)))
                          for name, rt in configs.items()}, args.rounds, cpu_floor=0.0, progress=False)
    results = [median_pass(rounds["targets"][name]["passes"]) for name in configs]
    without, with_buffer = results
    out = {
        "bench": "rollout", "kind": "simulation",
        "kind_note": f"INIT and RUN are sleeps ({init_s} s, {run_s} s): the speed-up is bounded by (INIT+RUN)/RUN = "
                     f"{(init_s + run_s) / run_s:.2f}x by construction; no real harness or engine ran",
        "workload": {"sessions": n, "init_s": init_s, "run_s": run_s, "run_workers": args.run_workers, "runtime": args.runtime,
                     "note": "INIT = prepare `sleep`; RUN = `command` harness holding its slot (stands in for engine time)"},
        "results": results,
        "speedup_sessions_per_min": round(with_buffer["sessions_per_min"] / without["sessions_per_min"], 2),
        "speedup_bound_init_plus_run_over_run": round((init_s + run_s) / run_s, 2),
        "rounds": rounds,
        "comparisons": [
            {"area": "Rollout prewarming", "metric": "run-slot utilization", "ours": round(100 * with_buffer["run_slot_utilization"], 1),
             "anchor": round(100 * without["run_slot_utilization"], 1), "anchor_name": "no READY buffer", "unit": "%",
             "higher_is_better": True, "note": f"simulation: READY target {args.ready_target}, INIT sleep {init_s}s, "
                                                 f"RUN sleep {run_s}s; medians of {args.rounds} interleaved rounds"},
            {"area": "Rollout prewarming", "metric": "sessions per minute", "ours": with_buffer["sessions_per_min"],
             "anchor": without["sessions_per_min"], "anchor_name": "no READY buffer", "unit": "sessions/min",
             "higher_is_better": True},
        ],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
