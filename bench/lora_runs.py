"""Two LoRA runs on one engine, through the driver (issue 64): what each run's topics and train log show.

Run A (``polarstream run A.yaml --only engine,node,streams,trainer,rollout``) serves the engine; run B
(``--only node,streams,trainer,rollout``) is attached to it (its ``engine_url`` is A's), and each run is
driven by its own ``polarstream run X.yaml --driver-only`` (``attach``: its rollout server, the engine and its
gateway node, whose stamp is a LoRA run's served version). Both are tiny (the tiny model, rank-4 and rank-8
adapters, 2 steps of 2 groups of 2 samples, one turn each), at once, on a Kafka and S3 server of their own.
B's trainer is SIGKILLed once its version 1 is synced; B's ``--only`` process starts it again.

Checked from what was recorded, and printed as JSON (``--out`` also writes it):
- ``runs``: each run's id and topic prefix (different), the adapter it served per policy version on its calls
  topic (``served_model`` by ``policy_version``: version N's calls go to ``<run id>-vN``, version 0's to the base),
  how its syncs went (train.jsonl's ``sync`` events: ``broadcast`` / ``storage``, errors);
- ``own_groups_only``: every group each trainer trained (train.jsonl ``groups``) is on its own run's groups
  topic, none on the other's;
- ``resume``: B's trainer started twice, resumed at the checkpoint of version 1 and handed the engine that
  version's adapter again (its ``resync`` event); the adapters B's calls went to after the restart, by version
  (none when B's last step had sampled before the restarted trainer started);
- ``engine_adapters``: the adapters the shared engine serves at the end (each run's last version only).

A gateway is not shared here: a gateway node runs its own run's sessions (its intake reads its run's
``sessions`` topic and mints keys naming that run), so through the driver each run brings its node. Two
runs on one gateway are shown at the gateway (tests/gateway/test_lora_routing.py).

    .venv/bin/python bench/lora_runs.py [--out bench/results/lora-runs.json]

Not a benchmark (it takes no quick flag, so bench/run_all.py leaves it out): a demonstration whose output is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages

STEPS, GROUPS, SAMPLES = 2, 2, 2
RUNS = {"a": {"rank": 4, "alpha": 8, "seed": 5}, "b": {"rank": 8, "alpha": 16, "seed": 6}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tasks(root: Path) -> None:
    from polarstream.demo import arith
    from schemas import HarnessSpec

    train, _ = arith.split(0)
    rows = [arith.task_request(q, a, task_id=f"train-{i}", num_samples=SAMPLES, harness=HarnessSpec(name="builtin"))
            .model_dump_json() for i, (q, a) in enumerate(train[:6])]
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")


def experiment(root: Path, name: str, urls: dict[str, str]) -> Path:
    from infra.models import ensure_model

    r = RUNS[name]
    exp = {"name": f"lora-{name}", "run_id": f"lora-{name}", "model": str(ensure_model("tiny")), "train": "train.jsonl", "eval": "",
           "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "subprocess", "group_size": SAMPLES,
           "groups_per_step": GROUPS, "max_steps": STEPS, "seed": r["seed"], "step_timeout_s": 240,
           "lora": {"rank": r["rank"], "alpha": r["alpha"]}, **urls}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3:6]} exited ({proc.returncode}) before {url} answered:\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s:\n{tail(log)}")


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def events(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "trainer" / "train.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def read_records(settings, topic: str, cls) -> list:
    """Every record of ``topic`` (logical name) of ``settings``' run, first copy of each event id."""
    from confluent_kafka import Consumer, TopicPartition

    from schemas import decode

    name = settings.topic(topic)
    c = Consumer(settings.kafka_config(**{"group.id": f"lora-runs-{os.getpid()}-{time.monotonic_ns()}",
                                          "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    try:
        parts = c.list_topics(name, timeout=10).topics[name].partitions
        tps = [TopicPartition(name, p, 0) for p in parts]
        ends = {p: c.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1] for p in parts}
        c.assign(tps)
        got, seen, deadline = {}, defaultdict(int), time.monotonic() + 60
        while any(seen[p] < ends[p] for p in parts) and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            seen[m.partition()] = m.offset() + 1
            rec = decode(m.value(), cls)
            got.setdefault(rec.event_id, rec)
        return list(got.values())
    finally:
        c.close()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="polar-lora-runs-"))
    root.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("kafka", "controller", "s3", "engine", "gw_a", "gw_b", "ro_a", "ro_b")}
    env = {**os.environ, "POLAR_KAFKA_BOOTSTRAP": f"127.0.0.1:{ports['kafka']}", "POLAR_KAFKA_PORT": str(ports["kafka"]),
           "POLAR_KAFKA_CONTROLLER_PORT": str(ports["controller"]), "POLAR_S3_PORT": str(ports["s3"]),
           "POLAR_DATA_DIR": str(root / "data"), "POLAR_TOPIC_PREFIX": "", "POLAR_STORAGE_URL": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # this checkout's code
    os.environ.update({k: v for k, v in env.items() if k.startswith("POLAR_")})  # this process reads the topics too
    from infra.settings import Settings

    polar = [sys.executable, "-m", "polarstream"]
    try:
        subprocess.run([*polar, "infra", "up"], env=env, check=True, stdout=subprocess.DEVNULL)
        out = run_both(root, env, ports, polar)
        out.update(analyze(root, Settings))
    finally:
        subprocess.run([*polar, "infra", "down"], env=env, stdout=subprocess.DEVNULL, check=False)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def run_both(root: Path, env: dict[str, str], ports: dict[str, int], polar: list[str]) -> dict:
    """Start both runs' components and drivers, kill B's trainer once, wait for both; stop everything."""
    engine = f"http://127.0.0.1:{ports['engine']}"
    url = {n: {"engine_url": engine, "gateway_url": f"http://127.0.0.1:{ports['gw_' + n]}",
               "rollout_url": f"http://127.0.0.1:{ports['ro_' + n]}"} for n in RUNS}
    write_tasks(root)
    procs: list[subprocess.Popen] = []

    def start(name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
        log = root / f"{name}-{'only' if '--only' in extra else 'driver'}.log"
        p = subprocess.Popen([*polar, "run", str(experiment(root, name, url[name])), "--run-dir", str(root / f"run-{name}"),
                              *extra], env=env, cwd=root, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        return p, log

    from bench._provenance import commit_info

    t0 = time.monotonic()
    out: dict = {"steps": STEPS, "groups_per_step": GROUPS, "samples": SAMPLES, **commit_info(ROOT),
                 "load_avg_at_start": os.getloadavg()[0]}
    try:
        a_only, a_log = start("a", "--only", "engine,node,streams,trainer,rollout")
        wait_http(f"{engine}/health", a_only, a_log)
        wait_http(f"{url['a']['gateway_url']}/health", a_only, a_log)
        b_only, b_log = start("b", "--only", "node,streams,trainer,rollout")
        wait_http(f"{url['b']['gateway_url']}/health", b_only, b_log)
        wait_http(f"{url['b']['rollout_url']}/health", b_only, b_log)
        wait_http(f"{url['a']['rollout_url']}/health", a_only, a_log)
        drivers = {n: start(n, "--driver-only") for n in RUNS}
        # B's trainer killed once version 1 is synced; its --only process starts it again
        deadline, killed = time.monotonic() + 600, False
        while time.monotonic() < deadline and not killed:
            if any(e.get("event") == "sync" and e.get("policy_version") == 1 for e in events(root / "run-b")):
                pid = json.loads((root / "run-b" / "components.json").read_text())["children"]["trainer"]["pid"]
                os.killpg(pid, signal.SIGKILL)
                killed = True
            elif drivers["b"][0].poll() is not None:
                break
            time.sleep(0.2)
        out["killed_b_trainer_after_version_1"] = killed
        for n, (p, log) in drivers.items():
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            out.setdefault("drivers", {})[n] = {"exit": rc, **({"log_tail": tail(log).splitlines()} if rc != 0 else {})}
        out["engine_adapters"] = sorted(m["id"] for m in httpx.get(f"{engine}/v1/models", timeout=10).json()["data"]
                                        if m.get("parent"))
    finally:
        for p in reversed(procs):
            stop(p)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def analyze(root: Path, settings_cls) -> dict:
    """The checks of the module docstring, from each run's topics and train.jsonl."""
    from schemas import CallRecorded, TrainingGroup

    runs, groups, trained = {}, {}, {}
    for n in RUNS:
        run_id = f"lora-{n}"
        s = settings_cls(topic_prefix=f"{run_id}.")
        calls = read_records(s, "calls", CallRecorded)
        served: dict[int, set[str]] = defaultdict(set)
        for c in calls:
            served[c.policy_version].add(c.served_model)
        groups[n] = {g.event_id for g in read_records(s, "groups", TrainingGroup)}
        ev = events(root / f"run-{n}")
        trained[n] = [g for e in ev if e.get("event") == "step" for g in e.get("groups", [])]
        syncs = [{k: e.get(k) for k in ("policy_version", "mode", "adapter", "broadcast", "storage", "errors", "unload_errors")
                  if e.get(k) is not None} for e in ev if e.get("event") == "sync"]
        restarts = [e["time"] for e in ev if e.get("event") == "start"][1:]
        after = defaultdict(set)  # calls the gateway received after the trainer's restart, by version
        for c in calls:
            if restarts and c.timings.received_at > restarts[0]:
                after[c.policy_version].add(c.served_model)
        runs[n] = {"run_id": run_id, "topic_prefix": s.topic_prefix, "calls": len(calls),
                   "served_model_by_version": {v: sorted(m) for v, m in sorted(served.items())},
                   "calls_on_own_adapter": all(m == {f"{run_id}-v{v}"} for v, m in served.items() if v > 0),
                   "trained_steps": sum(e.get("event") == "step" for e in ev), "syncs": syncs,
                   "sync_errors": [e.get("error", "")[:200] for e in ev if e.get("event") == "sync_error"],
                   "starts": [e.get("step") for e in ev if e.get("event") == "start"],
                   "resyncs": [e for e in ev if e.get("event") == "resync"],
                   "served_model_by_version_after_restart": {v: sorted(m) for v, m in sorted(after.items())}}
    other = {"a": "b", "b": "a"}
    own = {n: bool(trained[n]) and set(trained[n]) <= groups[n] and not set(trained[n]) & groups[other[n]] for n in RUNS}
    b = runs["b"]
    resumed = [r for r in b["resyncs"] if r.get("adapter")]
    return {"runs": runs, "own_groups_only": own,
            "different_prefixes": runs["a"]["topic_prefix"] != runs["b"]["topic_prefix"],
            "resume": {"b_trainer_starts_at_steps": b["starts"], "resynced_adapter_versions": [r["policy_version"] for r in resumed],
                       "calls_after_the_restart": b["served_model_by_version_after_restart"]}}


if __name__ == "__main__":
    main()
