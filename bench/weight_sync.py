"""Weight sync to running engines: in-memory broadcast (trainer/sync/broadcast.py) against storage (issue 63).

    .venv/bin/python bench/weight_sync.py [--quick] [--rounds R]

For the tiny model and a ~54M-parameter Qwen3-shaped one (bench/fsdp.py's ``FSDP_MODEL``, tied head), with 1
and 2 engines (``polarstream engine`` processes), in interleaved rounds (broadcast, storage, broadcast, ...),
each sync what train() does at a step between checkpoints:

- ``broadcast``: ``WeightTransfer.sync`` (group formed once before the rounds, as in a run): start,
  update_info, packed gloo broadcasts (64 MiB buffers), finish (the swap); the step's export is then
  written from the sent buffers in a background thread (``write_export``), as train() writes it.
- ``storage``: the HF export the engines read (``export_hf`` to a ``file://`` directory), then
  ``sync_weights`` (pause, ``/update_weights`` with the URL, resume). ``storage_load_only`` beside it is
  ``sync_weights`` alone (a step that checkpoints anyway pays the export).

"Sync seconds" (``sync_s``) is what the trainer's step loop is blocked for, from the start of the sync to
its return: broadcast: packing, broadcasting, the engines' swap (not the background export, which overlaps
the next step: ``export_bg_s``, its own wall seconds, waited for before the next pass so no pass overlaps
another); storage: writing the export and the engines' pause, load and resume. What the engines lose is
``engine_pause_s``: the seconds they serve nothing (broadcast: pause, swap and resume, as the engine reports
it; storage: from pause to resume, the load included). While a broadcast arrives they keep serving (their
CPU does receive the bytes).

- ``verified``: ``broadcast`` with ``verify`` (the sent tensors' sha256 compared with the engines' digests,
  vLLM's ``/weight_checker`` compare, before the stamp): ``verify_cost_vs_sync_54m`` is its median sync seconds
  over the plain broadcast's, minus 1 (the check is on by default only below 0.10).

- ``egress``: what the trainer sends per sync with 1, 2 and 4 engines in the one group (goal: 1x the model for
  every count, trainer/sync/broadcast.py), measured, not computed: this process's ``wchar`` (/proc/self/io) over
  one ``WeightTransfer.sync`` without an export (gloo writes its sockets with ``writev``, which ``wchar``
  counts: with gloo's own broadcast it read 2x and 3x for 2 and 4 engines; httpx's ``send`` calls are not
  counted; the engines are other processes), over the model's bytes.
  ``trainer_egress_x_model`` (per engine count; on the 54M model, the tiny one with ``--quick``) and
  ``trainer_egress_x_model_max``.

Each pass perturbs the weights first, so every sync moves new values. Top-level keys: ``sync_s_broadcast_54m``,
``sync_s_storage_54m`` (median seconds, 1 engine), ``sync_broadcast_vs_storage_54m`` (their ratio, goal
<= 0.5), ``sync_broadcast_vs_storage_load_only_54m``, ``export_bg_s_54m``, ``sync_bytes_moved`` (bytes per
sync, 54M, 1 engine: broadcast sent and its export written; storage written + read), and
``engine_pause_s_{broadcast,storage}_54m``; each case also has min and median and the load average.
Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

MEASURES = ("trainer/sync/broadcast.py", "trainer/sync/storage.py", "engine/transfer.py", "engine/app.py",
            "engine/weights.py", "trainer/export.py", "trainer/checkpoint.py", "bench/weight_sync.py")

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._rounds import interleaved, load_avg  # noqa: E402
from bench.fsdp import FSDP_MODEL  # noqa: E402


def log(msg: str) -> None:
    print(f"[weight_sync] {msg}", file=sys.stderr, flush=True)


def build_54m(out: Path, tokenizer_from: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**FSDP_MODEL)).save_pretrained(out)
    for f in tokenizer_from.iterdir():  # the engine needs a tokenizer; the sync does not use it
        if f.is_file() and (f.name.startswith("tokenizer") or f.name.endswith((".jinja", "vocab.json", "merges.txt"))
                            or f.name == "special_tokens_map.json"):
            shutil.copy2(f, out / f.name)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engines(model_dir: Path, n: int) -> list[tuple[subprocess.Popen, str]]:
    """``n`` engine processes on ``model_dir``, booting side by side."""
    import httpx

    procs = []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "polarstream", "engine", "--model", str(model_dir), "--port",
                                 str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        procs.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + 240
    for proc, url in procs:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_engines(procs)
                raise RuntimeError(f"engine on {model_dir} did not start")
            time.sleep(0.2)
    return procs


def stop_engines(procs) -> None:
    for p, _ in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)


def wchar() -> int:
    """Bytes this process has written through write/writev (sockets included), from /proc/self/io."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def egress(model_dir: Path, procs: list, counts: tuple[int, ...]) -> dict:
    """The trainer's bytes written per sync with each count of engines in the group, measured by ``wchar``."""
    from transformers import AutoModelForCausalLM

    from trainer.sync.broadcast import WeightTransfer
    from trainer.sync.storage import PolarEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = {}
    for n in counts:
        wt = WeightTransfer([PolarEngine(url) for _, url in procs[:n]], "broadcast", timeout_s=120,
                            buffer_bytes=64 << 20)
        try:
            wt.sync(model, None, 1)  # forms the group (once per run, as the trainer does)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)
            w0 = wchar()
            report = wt.sync(model, None, 2)
            written = wchar() - w0
        finally:
            wt.close()
        assert len(report["broadcast"]) == n, report
        out[str(n)] = {"trainer_wchar_bytes": written, "model_bytes": report["bytes_per_engine"],
                       "x_model": round(written / report["bytes_per_engine"], 4),
                       "reported_bytes_sent": report["bytes_sent"]}
        log(f"egress, {n} engine(s): {written:,} bytes written, {out[str(n)]['x_model']}x the model")
    return out


def case(model_dir: Path, procs: list, rounds: int, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from infra.settings import Settings
    from trainer.sync.broadcast import WeightTransfer
    from trainer.checkpoint import write_packed_export
    from trainer.export import export_hf
    from trainer.sync.storage import PolarEngine, sync_weights

    n_engines = len(procs)
    engines = [PolarEngine(url) for _, url in procs]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    wt = WeightTransfer(engines, "broadcast", timeout_s=120, buffer_bytes=64 << 20)
    settings = Settings()
    version = [0]

    def nudge():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4)
        version[0] += 1
        return version[0]

    wt.sync(model, None, nudge())  # forms the groups (once per run, as the trainer does)
    last: dict = {}

    def broadcast(verify: bool = False) -> dict:
        v = nudge()
        wt.verify = verify
        out = tmp / f"export-{v}"
        url = f"file://{out}"
        t0 = time.perf_counter()
        report = wt.sync(model, url, v, write_export=lambda packed: write_packed_export(
            url, packed, model, model_dir, settings, {"policy_version": v}))
        s = time.perf_counter() - t0
        export = report["export"]
        export.wait()  # outside the timing: it overlaps the next training step in a run
        assert sorted(report["broadcast"]) == sorted(e.base_url for e in engines), report
        written = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
        shutil.rmtree(out, ignore_errors=True)
        last["broadcast"] = report
        return {"sync_s": s, "engine_pause_s": max(report.get("engine_pause_s", {}).values()),
                "export_bg_s": export.seconds, "send_s": report["send_s"], "bytes": report["bytes_sent"],
                "export_bytes": written, "verify_s": report.get("verify_s", 0.0)}

    def storage() -> dict:
        v = nudge()
        out = tmp / f"export-{v}"
        t0 = time.perf_counter()
        written = export_hf(model, f"file://{out}", model_dir, settings)
        t1 = time.perf_counter()
        sync_weights(engines, f"file://{out}", v)
        t2 = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        weights = sum(b for f, b in written.items() if f.endswith(".safetensors"))
        return {"sync_s": t2 - t0, "load_only_s": t2 - t1, "export_s": t1 - t0, "engine_pause_s": t2 - t1,
                "bytes": weights * (1 + n_engines)}

    try:
        res = interleaved({"broadcast": broadcast, "verified": lambda: broadcast(verify=True), "storage": storage},
                          rounds=rounds, progress=False,
                          cpu_pids=lambda: [p.pid for p, _ in procs])
    finally:
        wt.close()
    med = lambda name, key: statistics.median(p[key] for p in res["targets"][name]["passes"])  # noqa: E731
    mn = lambda name, key: min(p[key] for p in res["targets"][name]["passes"])  # noqa: E731
    both = lambda name, key: {"min": round(mn(name, key), 4), "median": round(med(name, key), 4)}  # noqa: E731
    b_last, s_last = res["targets"]["broadcast"]["passes"][-1], res["targets"]["storage"]["passes"][-1]
    return {"params": params, "engines": n_engines, "rounds": rounds, "load_avg": res["load_avg"],
            "broadcast_s": both("broadcast", "sync_s"), "storage_s": both("storage", "sync_s"),
            "storage_load_only_s": both("storage", "load_only_s"), "storage_export_s": both("storage", "export_s"),
            "broadcast_send_s": both("broadcast", "send_s"), "export_bg_s": both("broadcast", "export_bg_s"),
            "engine_pause_s": {"broadcast": both("broadcast", "engine_pause_s"),
                               "storage": both("storage", "engine_pause_s")},
            "bytes": {"broadcast_sent": b_last["bytes"], "broadcast_export_written": b_last["export_bytes"],
                      "storage_written_and_read": s_last["bytes"]},
            "ratio_median": med("broadcast", "sync_s") / med("storage", "sync_s"),
            "ratio_min": mn("broadcast", "sync_s") / mn("storage", "sync_s"),
            "ratio_load_only_median": med("broadcast", "sync_s") / med("storage", "load_only_s"),
            "broadcast_buffers": last["broadcast"]["buffers"],
            # verified before stamped (trainer/sync/broadcast.py verify): the sha256 of every tensor on both sides
            "verified_s": both("verified", "sync_s"), "verify_compare_s": both("verified", "verify_s"),
            "verify_cost_vs_sync": med("verified", "sync_s") / med("broadcast", "sync_s") - 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 rounds; 54M with 1 engine only")
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    torch.set_num_threads(1)
    from infra.models import ensure_model

    tiny = Path(ensure_model("tiny"))
    out: dict = {"load_avg_before": load_avg(), "cases": {}}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polar-wsync-bench-") as t:
        tmp = Path(t)
        big = build_54m(tmp / "m54", tiny)
        # one set of engine processes per model, the 1-engine case on the first of them; the egress of one
        # group of 1, 2 and 4 engines on the 54M model (the tiny one's in --quick)
        egress_on = "tiny" if args.quick else "54m"
        for name, d, counts in [("tiny", tiny, (1, 2)), ("54m", big, (1,) if args.quick else (1, 2))]:
            procs = start_engines(d, 4 if name == egress_on else max(counts))
            try:
                for n in counts:
                    log(f"{name}, {n} engine(s), {rounds} rounds")
                    out["cases"][f"{name}_{n}"] = case(d, procs[:n], rounds, tmp)
                if name == egress_on:
                    out["egress"] = {"model": name, "engines": egress(d, procs, (1, 2, 4))}
            finally:
                stop_engines(procs)
    c = out["cases"]["54m_1"]
    out.update({
        "sync_s_broadcast_54m": c["broadcast_s"]["median"],
        "sync_s_storage_54m": c["storage_s"]["median"],
        "sync_s_storage_load_only_54m": c["storage_load_only_s"]["median"],
        "sync_broadcast_vs_storage_54m": round(c["ratio_median"], 3),
        "sync_broadcast_vs_storage_min_54m": round(c["ratio_min"], 3),
        "sync_broadcast_vs_storage_load_only_54m": round(c["ratio_load_only_median"], 3),
        "export_bg_s_54m": c["export_bg_s"]["median"],
        "sync_bytes_moved": c["bytes"],
        "engine_pause_s_broadcast_54m": c["engine_pause_s"]["broadcast"]["median"],
        "engine_pause_s_storage_54m": c["engine_pause_s"]["storage"]["median"],
        "sync_s_verified_54m": c["verified_s"]["median"],
        "verify_cost_vs_sync_54m": round(c["verify_cost_vs_sync"], 3),  # on by default below 0.10
        "trainer_egress_x_model": {n: e["x_model"] for n, e in out["egress"]["engines"].items()},
        "trainer_egress_x_model_max": max(e["x_model"] for e in out["egress"]["engines"].values()),
        "seconds": round(time.monotonic() - t_start, 1),
        "load_avg_after": load_avg(),
    })
    out["comparisons"] = [
        {"area": "Weight sync", "metric": f"sync seconds, {k.replace('_', ' model, ')} engine(s)", "ours": round(v["broadcast_s"]["median"], 4),
         "anchor": round(v["storage_s"]["median"], 4), "anchor_name": "storage (export + load)", "unit": "s",
         "higher_is_better": False} for k, v in out["cases"].items()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
