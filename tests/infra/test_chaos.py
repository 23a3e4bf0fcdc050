"""bench/chaos.py --quick with a fixed seed: one SIGKILL of each kind of component (a gateway node, the
streams worker, the trainer -- inside a weight sync --, the Kafka broker, the S3 server) while tasks run through the real pipeline,
and the run then checked against an uninterrupted one. It starts its own broker, S3 server, engine and
pipelines, so it needs nothing from the test session but Java and the cached jars."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_all import last_json_object

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def post_mortem(run: Path) -> str:
    """The lines of each component's log that tell where a run stopped (its logs go with the tmp dir)."""
    telling = re.compile(r"polarstream\.(node|rollout)|Worker ready|No event received|recovery read nothing|"
                         r"Traceback|Error:|=====|\[chaos")
    out = []
    for log in sorted(run.glob("*/*.log")) + sorted(run.glob("*/trainer.out")):
        lines = [ln[:200] for ln in log.read_text(errors="replace").splitlines()
                 if telling.search(ln) and "librdkafka" not in ln and "produce response" not in ln]
        out += [f"--- {log.relative_to(run)} ({len(lines)} telling lines, the last 12):", *lines[-12:]]
    return "\n".join(out)[-8000:]


# ~200 s alone; 396 s beside the suite's other workers on a new machine, and 480 s was not enough with three
# chaos runs at once (load 16): most of it is starting a broker, S3 and two pipelines of six processes.
RUN_S = 900


@pytest.mark.timeout(RUN_S + 60)
def test_quick_chaos_run_loses_nothing_and_trains_what_an_uninterrupted_run_trains(tmp_path):
    run = tmp_path / "run"
    try:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--seed", "0", "--keep", str(run)],
                           capture_output=True, text=True, timeout=RUN_S, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"no result after {RUN_S} s\n{(e.stderr or b'').decode(errors='replace')[-2000:]}\n{post_mortem(run)}")
    out = last_json_object(p.stdout)
    assert p.returncode == 0 and out is not None, p.stderr[-3000:] + "\n" + post_mortem(run)
    chaos, ref = out["runs"]["chaos"], out["runs"]["reference"]
    why = f"{json.dumps({k: v for k, v in out.items() if k != 'runs'}, indent=1)}\n{p.stderr[-3000:]}\n{post_mortem(run)}"

    assert out["kills"] == 5 and set(out["kills_by_component"]) == {"node", "worker", "trainer", "broker", "s3"}, why
    assert all(k["recover_s"] is not None for k in out["kill_log"]), why  # each one came back
    assert chaos["acked_calls"] > 0 and out["acked_calls_lost"] == 0 and chaos["acked_calls_duplicated"] == 0, why
    assert out["groups_trained_twice"] == 0 and out["groups_skipped"] == 0 and chaos["tasks_with_two_groups"] == 0, why
    assert out["hashes_equal"] and out["tasks_hash_differs"] == [] and ref["tasks"] == chaos["tasks"] >= 3, why
    assert chaos["consumed_to_end"] and ref["consumed_to_end"], why
    assert out["trained_sessions_with_holes"] == 0 == ref["trained_sessions_with_holes"], why
    assert chaos["trainer_starts"] >= 2, why  # the trainer was killed and resumed from its S3 checkpoint
    # ... killed inside a weight sync (a broadcast to the chaos run's own engine); that engine kept serving,
    # and ends serving the last step's version, synced again by the restarted trainer
    sync = out["sync"]
    assert sync["mid_transfer"] and sync["syncs"].get("broadcast", 0) > 0, why
    assert sync["last_step_version"] is not None and sync["version_served"] == sync["last_step_version"], why
    print("\nchaos:", json.dumps({k: out[k] for k in ("kills_by_component", "recovery_s", "restarts_unplanned", "sync", "wall_s", "load_avg_1m")}))
    # how long each run's last checkpoint landed after the step it saves was logged: what the audit once
    # read inside of, reporting consumed_to_end false on a loaded machine (issue 60)
    print("checkpoint lag (s):", json.dumps({name: r["checkpoint_lag_s"] for name, r in out["runs"].items()}))
