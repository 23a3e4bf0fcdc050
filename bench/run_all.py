"""Run every benchmark, one at a time, and write one results file and one results page.

    .venv/bin/python bench/run_all.py [--all] [--quick] [--only NAME ...] [--timeout S] [--out JSON] [--doc MD]
                                      [--cluster] [--harnesses] [--driver] [--fsdp] [--weight-sync] [--image-tasks] [--lora]
                                      [--judge-agreement]
    .venv/bin/python bench/run_all.py --render-only      # re-render README.md and docs/*.md from the JSON
                                                         # (and bench/results/offpolicy.json: render.OWN_RESULTS)
    .venv/bin/python bench/run_all.py --staleness        # benchmarks whose measured code changed (exit 1 if any)

Measure once: a full run reruns only the benchmarks whose measured code changed since they last ran (each
declares it, ``MEASURES`` in its script; bench/_provenance.py hashes it) and merges their entries into
the results file; the others keep theirs, each entry with the commit and inputs hash it ran at, so every
figure says its own "measured at". ``--all`` reruns every benchmark; ``--only NAME`` reruns those.
Around each benchmark a host-speed index is measured (bench/_host.py), and CPU-bound figures are also
given per unit of it (HOST_SCALED).

Each ``bench/NAME.py`` runs in its own subprocess (its own process group, so whatever it started dies
with it on a timeout), with ``--quick`` when this runs with ``--quick``. A benchmark that fails, times out,
prints no JSON or is missing is recorded as such, with the tail of its stderr; the run goes on.
The results go to ``bench/results/latest.json`` with the machine of the last run, and
``docs/benchmarks.md`` is rendered from that file (bench/render.py), so the two always agree; so is every
figure between ``<!-- bench:NAME:KEY -->`` markers in README.md and docs/*.md (bench/render.py: MARKER).

Honest by default: benchmarks that compare targets run them in interleaved rounds (bench/_rounds.py);
this runner records the load average around each benchmark and the whole run, the commit and whether the
tree was dirty (bench/_provenance.py), and gives each benchmark a time budget so the full run fits in
30 minutes on a 2-core machine (BUDGET_S, FULL_ARGS).

Which files are benchmarks: every ``bench/*.py`` except this file, ``render.py``, names starting with
``_``, and helpers that take no ``--quick`` flag (``trl_peer.py`` runs inside a peer venv, called by
``trainer.py``). EXPECTED names the benchmarks the issues ask for, so a missing one shows up as missing.
OPT_IN ones run only when their flag is given (``--cluster``: broker_loss and chaos; ``--harnesses``:
harness_sessions; ``--driver``: driver; ``--fsdp``: fsdp; ``--weight-sync``: weight_sync; ``--image-tasks``:
image_tasks; ``--lora``: lora; ``--distill``: distill; ``--judge-agreement``: judge_agreement) or with ``--only NAME``.

The convention a benchmark script follows (the first two are required, the rest optional):

1. Print one JSON object on stdout (logs go to stderr). If stdout holds other lines too, the last
   JSON object in it is taken.
2. Accept ``--quick``: the same measurements on a smaller workload, in under a minute.
3. To put a number beside its anchor (the baseline measured in the same run), add a top-level list::

       "comparisons": [{"area": "Gateway overhead", "metric": "p50 latency, 1 client",
                        "ours": 4.1, "anchor": 0.9, "anchor_name": "engine direct",
                        "unit": "ms", "higher_is_better": false, "note": "optional text"}]

   ``area`` groups rows into one table; ``higher_is_better`` may be null for numbers that should
   match rather than win (a loss value checked against a reference). Scripts that do not provide
   the list get one derived from their known JSON layout (bench/render.py: DERIVERS), and every
   script's numbers are also shown in full as tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._host import REPEATS, host_index  # noqa: E402
from bench._provenance import bench_provenance, changed_for, commit_info, entry_provenance  # noqa: E402
from bench.render import OWN_RESULTS, comparisons_for, render_docs, render_into  # noqa: E402
from infra.process import stop_group  # noqa: E402

EXPECTED = ("publisher", "engine", "gateway", "streams", "trainer", "rollout")
NOT_BENCHMARKS = {"run_all", "render", "gpu_check"}  # gpu_check: the device check (issue 50), run by hand on a GPU
PEERS = Path.home() / ".cache" / "polarstream" / "peers"
PACKAGES = ("torch", "transformers", "confluent-kafka", "faust-streaming", "aiokafka", "fastapi", "uvicorn",
            "httpx", "orjson", "pydantic", "tokenizers")
PEER_PACKAGES = ("rllm-model-gateway", "agentlightning", "trl")
STDERR_TAIL = 3000  # characters of a failed benchmark's stderr kept in the results
# Seconds each benchmark may take (quick, full): the full budgets add up to under 30 minutes and the quick
# ones to under 8, on the 2-core dev machine; a benchmark over its budget is a timeout, not a silently
# longer run. A benchmark not listed gets DEFAULT_BUDGET_S.
# gateway: 110/390 s (was 105/330) since issue 19 added a --processes 2 target and the 80 KB extend and
# fresh-call scenarios; quick can grow only 5 s before the quick budgets pass 8 minutes in all.
# streams: 260 s full (was 150, then 200) since issue 21 added the Kafka-bytes passes (a worker per session
# length); 200 s timed out on a slow hour (engine batch-1 at 116 tok/s, a fifth of a quiet hour's).
BUDGET_S = {"broker_loss": (90, 180), "publisher": (35, 120), "engine": (30, 90), "gateway": (110, 330), "streams": (55, 260),
            "trainer": (70, 330), "rollout": (60, 220), "mirror": (40, 150), "script_window": (50, 150),
            "fuzz": (30, 150), "harness_sessions": (240, 480), "chaos": (240, 1200), "driver": (420, 1800),
            "fsdp": (300, 900), "weight_sync": (150, 420),
            "image_tasks": (420, 1500), "lora": (150, 400), "distill": (1500, 5400),
            "judge_agreement": (300, 1800)}
DEFAULT_BUDGET_S = (30, 60)  # a new benchmark must claim its time in BUDGET_S
# Extra arguments in a full run. fuzz's default 10,000 requests per API is a 22-minute soak (docs/fuzzing.md),
# a correctness run of its own, not a speed figure: inside make bench it runs a shape-keeping 600.
FULL_ARGS = {"fuzz": ["--per-api", "600"]}
# Benchmarks run only when asked for (their flag here, or --only NAME), outside both budgets above:
# broker_loss starts a 3-broker cluster and kills brokers (issue 25), about a minute even with --quick;
# harness_sessions runs the six real agent CLIs through a node (issue 20; installed CLIs and bwrap needed);
# chaos kills 30 random components of a whole pipeline on a 3-broker cluster, then reruns it unharmed (issue
# 25), about 10 minutes; driver runs whole RL experiments at three async levels in rounds (issue 49), 10-25 minutes;
# fsdp trains a 54M-parameter model on 2 FSDP2 ranks and on one process in rounds (issue 50), a few minutes;
# weight_sync starts 4 engine processes (tiny and 54M models) and syncs them in rounds (issue 63), 2-4 minutes
# even with --quick, and the quick budgets above have no room left; image_tasks runs whole arith experiments on
# image tasks in podman containers against the bwrap demo in rounds (issue 62), about 6 minutes even with --quick;
# lora trains the 54M-parameter model with a LoRA adapter and with full weights in rounds (issue 64), 1-3 minutes;
# judge_agreement asks SmolLM2 on a CPU to judge 100 trajectories (issue 77), 15-25 minutes (its own results file).
OPT_IN = {"broker_loss": "--cluster", "harness_sessions": "--harnesses", "chaos": "--cluster", "driver": "--driver",
          "fsdp": "--fsdp", "weight_sync": "--weight-sync", "image_tasks": "--image-tasks",
          "lora": "--lora", "distill": "--distill", "judge_agreement": "--judge-agreement"}
# CPU-bound figures (a /-path into the benchmark's JSON) also given per unit of host speed: the figure divided
# by the mean of the host index measured just before and just after the benchmark (bench/_host.py).
HOST_SCALED = {
    "publisher": ("events_per_s_4kb",),
    "streams": ("worker_calls_per_s", "worker_calls_per_cpu_s", "worker_drain_calls_per_s"),
    "engine": ("batch_1/generated_tokens_per_s", "batch_32/generated_tokens_per_s"),
    "gateway": ("calls_per_s_16_clients", "peer_calls_per_s_16_clients"),
}


def discover(bench_dir: Path, opt_in: bool = False) -> dict[str, Path]:
    """NAME -> script for every benchmark in ``bench_dir`` (see the module docstring for the rule);
    the OPT_IN ones only with ``opt_in``."""
    found = {}
    for path in sorted(bench_dir.glob("*.py")):
        if path.stem in NOT_BENCHMARKS or path.stem.startswith("_") or (path.stem in OPT_IN and not opt_in):
            continue
        if "--quick" in path.read_text(errors="replace"):
            found[path.stem] = path
    return found


def last_json_object(text: str) -> dict | None:
    """The whole of ``text`` as a JSON object, else the last JSON object that starts a line."""
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(text)) if text[i] == "{" and (i == 0 or text[i - 1] == "\n")]
    for i in reversed(starts):
        try:
            obj, _ = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def run_one(name: str, script: Path | None, quick: bool, timeout: float, extra: list[str] | None = None) -> dict:
    """Run one benchmark script; never raises: every outcome becomes a status in the entry."""
    if script is None:
        return {"status": "missing", "script": f"bench/{name}.py", "seconds": 0.0,
                "error": f"bench/{name}.py does not exist yet"}
    cmd = [sys.executable, str(script), *(["--quick"] if quick else []), *(extra or [])]
    entry: dict = {"script": _rel(script), "command": " ".join([Path(sys.executable).name, _rel(script), *cmd[2:]]),
                   "budget_s": timeout, "load_avg": {"before": _load()}}
    started = time.perf_counter()
    # Own process group: a benchmark's broker, engine or gateway processes die with it on a timeout.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside its group still holds the pipes open
            out, err = "", "(output lost: a process it started outlived it and kept its pipes open)"
        entry.update(status="timeout", error=f"no result within {timeout:.0f} s")
    except KeyboardInterrupt:  # its own session does not see the terminal's Ctrl-C: pass it on
        _kill_group(proc)
        raise
    entry["seconds"] = round(time.perf_counter() - started, 1)
    entry["load_avg"]["after"] = _load()
    entry["returncode"] = proc.returncode
    result = last_json_object(out or "")
    if "status" not in entry:
        if proc.returncode != 0:
            entry.update(status="failed", error=f"exited with status {proc.returncode}")
        elif result is None:
            entry.update(status="no_json", error="exited 0 but printed no JSON object on stdout")
        else:
            entry["status"] = "ok"
    if result is not None:
        entry["result"] = result
        entry["comparisons"], problems = comparisons_for(name, result)
        if problems:
            entry["comparison_problems"] = problems
    if entry["status"] != "ok":
        entry["stderr_tail"] = (err or "")[-STDERR_TAIL:]
    return entry


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the benchmark's process group: SIGINT first, so its ``finally`` blocks stop the servers it
    started in sessions of their own; then SIGTERM and SIGKILL for whatever is left."""
    stop_group(proc, ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)))


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def budget(name: str, quick: bool, override: float = 0) -> float:
    return override or BUDGET_S.get(name, DEFAULT_BUDGET_S)[0 if quick else 1]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ machine info


def machine_info() -> dict:
    """Where and with what the numbers were measured."""
    info: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "load_avg_1m": _load(),
        "python": platform.python_version(),
        **commit_info(ROOT),
        "java": (_cmd(["java", "-version"], stderr=True) or "").split("\n")[0],
    }
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        import confluent_kafka

        versions["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        versions["librdkafka"] = None
    try:
        from infra.maven import pom_property

        versions["kafka_broker"] = pom_property("kafka.version")
    except Exception:  # an unreadable pom must not cost the whole run its results
        versions["kafka_broker"] = None
    info["versions"] = versions
    info["peer_versions"] = peer_versions()
    return info


def peer_versions(peers: Path = PEERS) -> dict:
    """Versions of the anchor packages installed in the peer venvs (never in .venv), by dist-info name."""
    found: dict = {pkg: None for pkg in PEER_PACKAGES}
    for dist in peers.glob("*/lib/python*/site-packages/*.dist-info"):
        name, _, version = dist.name[: -len(".dist-info")].rpartition("-")
        pkg = name.replace("_", "-").lower()
        if pkg in found:
            found[pkg] = f"{version} ({dist.parents[3].name} venv, {dist.parents[1].name})"
    return found


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _cmd(cmd: list[str], stderr: bool = False) -> str | None:
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (p.stderr if stderr else p.stdout).strip() or None


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (each under a minute)")
    ap.add_argument("--all", action="store_true", help="rerun every benchmark, not only those whose measured code changed")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME", help="run only these benchmarks")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per benchmark (default: its budget in BUDGET_S)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/latest.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    ap.add_argument("--bench-dir", type=Path, default=ROOT / "bench", help="where the benchmark scripts are")
    ap.add_argument("--render-only", action="store_true", help="only re-render README.md and docs/*.md from --out")
    ap.add_argument("--staleness", action="store_true",
                    help="list measured code changed since --out's commit; exit 1 when anything changed")
    ap.add_argument("--strict", action="store_true", help="exit 1 unless every benchmark succeeded")
    ap.add_argument("--cluster", action="store_true", help="also run broker_loss and chaos (a 3-broker cluster; brokers, or anything, killed)")
    ap.add_argument("--harnesses", action="store_true",
                    help="also run harness_sessions (every real CLI, scripted multi-turn sessions through a node)")
    ap.add_argument("--driver", action="store_true",
                    help="also run driver (whole arith experiments at async levels 0, 1 and 2, in interleaved rounds)")
    ap.add_argument("--fsdp", action="store_true",
                    help="also run fsdp (a 54M-parameter model on 2 FSDP2 ranks against one process, in interleaved rounds)")
    ap.add_argument("--weight-sync", action="store_true",
                    help="also run weight_sync (in-memory broadcast against storage to engine processes, in interleaved rounds)")
    ap.add_argument("--image-tasks", action="store_true",
                    help="also run image_tasks (arith runs on image tasks in podman containers against the bwrap demo, in interleaved rounds)")
    ap.add_argument("--distill", action="store_true",
                    help="also run distill (issue 78: the RL demo, distillation from its policy without a reward, and "
                         "SFT on its log: whole demo runs, interleaved)")
    ap.add_argument("--lora", action="store_true",
                    help="also run lora (the 54M-parameter model: a LoRA adapter against full fine-tuning, in interleaved rounds)")
    ap.add_argument("--judge-agreement", action="store_true",
                    help="also run judge_agreement (issue 77: SmolLM2 on our engine against the rule judge, 100 trajectories)")
    args = ap.parse_args(argv)
    if args.staleness:
        return staleness(json.loads(args.out.read_text()))
    if args.render_only and not args.out.exists():
        print(f"error: no results file at {_rel(args.out)}; run bench/run_all.py first", file=sys.stderr)
        return 1
    if args.render_only:
        changed = render_docs(json.loads(args.out.read_text()), ROOT, results_doc=args.doc)
        sources = ", ".join([_rel(args.out), *OWN_RESULTS.values()])
        print(f"rendered from {sources}: " + (", ".join(_rel(p) for p in changed) or "every page already current"))
        return 0

    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    found = discover(args.bench_dir, opt_in=True)
    # Only the project's own bench/ is expected to hold every EXPECTED benchmark.
    expected = set(EXPECTED) if args.bench_dir.resolve() == (ROOT / "bench") else set()
    wanted = {n for n, flag in OPT_IN.items() if getattr(args, flag.lstrip("-").replace("-", "_"))}
    names = args.only or [n for n in EXPECTED if n in expected] + sorted(set(found) - expected - (set(OPT_IN) - wanted))
    previous = load_previous(args.out, "quick" if args.quick else "full")
    provs = {n: bench_provenance(found[n], ROOT) for n in names if n in found}
    todo = names if args.all or args.only else [n for n in names if needs_run(n, provs.get(n), previous)]
    run = {"format": 3, "mode": "quick" if args.quick else "full", "machine": machine_info(),
           "budget_s": sum(budget(n, args.quick, args.timeout) for n in todo), "benchmarks": dict(previous.get("benchmarks", {})),
           "ran": todo, "load_avg": {"before": _load()}}
    for n in names:
        if n not in todo:
            console.print(f"[dim]    kept {n}: its code is unchanged since {provs[n]['git_commit'] if n in provs else '?'} "
                          f"(inputs {provs.get(n, {}).get('inputs_hash')})[/]")
    started = time.perf_counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("benchmarks", total=len(todo))
        for name in todo:
            progress.update(task, description=f"bench/{name}.py{' --quick' if args.quick else ''}")
            extra = [] if args.quick else FULL_ARGS.get(name, [])
            # a quick run is a smoke run (its figures are never committed): three repetitions, not seven
            repeats = 3 if args.quick else REPEATS
            before = host_index(repeats) if name in found else None
            entry = run_one(name, found.get(name), args.quick, budget(name, args.quick, args.timeout), extra)
            if before is not None:
                entry["host_index"] = {"before": before, "after": host_index(repeats)}
                entry["mode"] = run["mode"]
                entry["provenance"] = {**provs[name], "date": run["machine"]["date"], "host": run["machine"]["hostname"]}
                add_host_scaled(name, entry)
            run["benchmarks"][name] = keep_good(entry, (previous.get("benchmarks") or {}).get(name))
            colour = "green" if entry["status"] == "ok" else "red"
            progress.console.print(f"[{colour}]{entry['status']:>8}[/] {name} ({entry['seconds']} s)"
                                   + (f": {entry['error']}" if entry.get("error") else ""))
            progress.advance(task)
    run["seconds"] = round(time.perf_counter() - started, 1)
    run["load_avg"]["after"] = _load()
    run["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run, indent=1) + "\n")
    # The project's own results file feeds every page; a results file elsewhere (a trial run) only its --doc.
    if args.out.resolve() == (ROOT / "bench/results/latest.json").resolve():
        render_docs(run, ROOT, results_doc=args.doc)
    else:
        render_into(args.doc, run)
    if run["machine"].get("git_dirty"):
        console.print(f"[yellow]measured with uncommitted changes ({run['machine']['git_dirty_count']} files): the results say "
                      "DIRTY; the committed latest.json must come from a clean tree[/]")
    ok = sum(run["benchmarks"][n]["status"] == "ok" for n in todo)
    console.print(f"{ok}/{len(todo)} benchmarks ok in {run['seconds']} s ({len(names) - len(todo)} kept: code unchanged); "
                  f"wrote {_rel(args.out)} and {_rel(args.doc)}")
    return 1 if args.strict and ok < len(todo) else 0


def load_previous(path: Path, mode: str) -> dict:
    """The results file to merge into: the one at ``path`` when it is of the same mode, else none."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if run.get("mode") != mode:
        return {}
    for entry in (run.get("benchmarks") or {}).values():  # recorded before entries had their own: the run's
        if entry.get("status") != "missing":
            entry["provenance"] = entry_provenance(entry, run)
    return run


def keep_good(entry: dict, before: dict | None) -> dict:
    """A rerun that failed does not erase the figures of the last good run: they stay, with the commit they
    were measured at (so they read as stale), and the failure is kept beside them as ``last_attempt``.
    A rerun that succeeded but could not measure a figure (a peer that would not install: null) keeps that
    figure's last measured value, with its commit and date under ``result["kept"]``."""
    if not before or before.get("status") != "ok":
        return entry
    if entry.get("status") == "ok":
        return keep_measured(entry, before)
    failed = {k: entry[k] for k in ("status", "error", "seconds", "provenance", "stderr_tail") if k in entry}
    return {**before, "last_attempt": failed}


def keep_measured(entry: dict, before: dict) -> dict:
    """``entry`` with each top-level figure it left null taken from ``before`` where that one was measured."""
    now, then = entry.get("result"), before.get("result")
    if not isinstance(now, dict) or not isinstance(then, dict):
        return entry
    prov = before.get("provenance") or {}
    kept = {k: {"value": then[k], **((then.get("kept") or {}).get(k) or {"git_commit": prov.get("git_commit"),
                                                                         "date": prov.get("date")})}
            for k, v in now.items() if v is None and isinstance(then.get(k), (int, float)) and not isinstance(then.get(k), bool)}
    if not kept:
        return entry
    result = {**now, **{k: v["value"] for k, v in kept.items()}, "kept": kept}
    return {**entry, "result": result}


def needs_run(name: str, prov: dict | None, previous: dict) -> bool:
    """Whether a benchmark must run: no good entry yet, or its inputs hash differs from the one it ran on."""
    entry = (previous.get("benchmarks") or {}).get(name)
    if prov is None or not entry or entry.get("status") != "ok":
        return True
    return (entry.get("provenance") or {}).get("inputs_hash") != prov["inputs_hash"]


def add_host_scaled(name: str, entry: dict) -> None:
    """``entry["per_host_index"]``: each HOST_SCALED figure divided by the mean host index around the run."""
    from bench.render import dig

    h = entry.get("host_index") or {}
    index = [x["index"] for x in (h.get("before"), h.get("after")) if x and x.get("index")]
    if not index or not isinstance(entry.get("result"), dict):
        return
    mean = sum(index) / len(index)
    scaled = {}
    for key in HOST_SCALED.get(name, ()):
        value = dig(entry["result"], *key.split("/"))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled[key] = round(value / mean, 1)
    if scaled:
        entry["per_host_index"] = {"host_index_mean": round(mean, 3), **scaled}


def staleness(run: dict, root: Path = ROOT) -> int:
    """Print, per benchmark, the commit it measured and its measured code changed since; 1 when any changed."""
    stale_any = False
    for name, entry in (run.get("benchmarks") or {}).items():
        prov = entry_provenance(entry, run)
        st = changed_for(name, entry, run, root)
        dirty = " (measured with uncommitted changes: dirty)" if prov.get("git_dirty") else ""
        if not st["known"] and st["stale"]:
            print(f"{name}: measured at {prov.get('git_commit')}{dirty}: commit not in this repository; treat it as stale")
        else:
            print(f"{name}: measured at {prov.get('git_commit')}{dirty}; changed since: {', '.join(st['packages']) or 'nothing'}")
            for f in st["files"]:
                print(f"  {f}")
        stale_any |= st["stale"]
    return 1 if stale_any else 0


if __name__ == "__main__":
    sys.exit(main())
