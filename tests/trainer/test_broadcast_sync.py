"""The trainer's broadcast sync under faults (trainer/broadcast.py): an engine SIGKILLed or SIGSTOPped
mid-broadcast costs the trainer at most its deadline, the others finish, and the lost engine comes back
through storage at the right version; plus the FSDP2 path (2 gloo ranks gather, rank 0 broadcasts)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.transfer import tensor_sha256
from trainer.broadcast import WeightTransfer, named_tensors
from trainer.config import ConfigError, TrainConfig
from trainer.weight_sync import PolarEngine, WeightSyncError

ROOT = Path(__file__).parents[2]
DEADLINE_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """``polarstream engine`` in a process of its own (so it can be killed and stopped)."""

    def __init__(self, model_dir, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "POLAR_WEIGHT_TRANSFER_TIMEOUT_S": str(DEADLINE_S)}
        self.proc = subprocess.Popen([sys.executable, "-m", "polarstream", "engine", "--model", str(model_dir),
                                      "--port", str(self.port), "--served-model-name", "tiny"], env=env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("engine process did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def engine_process(tiny_model_dir):
    started: list[EngineProcess] = []

    def make(port=None):
        e = EngineProcess(tiny_model_dir, port)
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()


def perturbed(model_dir, seed):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def info(url):
    return httpx.get(f"{url}/weight_info", timeout=10).json()


def matches(url, model) -> bool:
    baseline = {n: tensor_sha256(t) for n, t in named_tensors(model)}
    r = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=60)
    return r.json()["match"]


def run_sync_killing(wt, model, url, version, victim: EngineProcess, sig):
    """``wt.sync`` in a thread while ``sig`` hits ``victim`` once it is receiving; (report or error, seconds)."""
    import threading

    out: dict = {}

    def go():
        t0 = time.monotonic()
        try:
            out["report"] = wt.sync(model, url, version)
        except WeightSyncError as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not (info(victim.url)["transfer"]["receiving"] and info(victim.url)["transfer"]["buffers"] > 2):
        assert time.monotonic() < deadline and t.is_alive(), "the victim never started receiving"
        time.sleep(0.01)
    os.kill(victim.proc.pid, sig)
    t.join(timeout=120)
    assert not t.is_alive(), "the sync hung"
    return out


def test_engine_killed_mid_broadcast(engine_process, engine_server, tiny_model_dir, tmp_path):
    victim, survivor = engine_process(), engine_server
    model = perturbed(tiny_model_dir, 3)
    wt = WeightTransfer([PolarEngine(victim.url), PolarEngine(survivor.url)], "broadcast", timeout_s=DEADLINE_S,
                        buffer_bytes=64 << 10, throttle_s=0.02)
    try:
        out = run_sync_killing(wt, model, None, 1, victim, signal.SIGKILL)
        report = out["report"]  # the survivor got it: no error
        assert out["seconds"] < 30
        assert report["broadcast"] == [survivor.url] and report["stale"] == [victim.url]
        assert httpx.get(f"{survivor.url}/policy_version").json()["policy_version"] == 1 and matches(survivor.url, model)
        # the engine restarts (same port); the next sync loads it from storage at that sync's version ...
        victim.proc.wait(timeout=10)
        back = engine_process(victim.port)
        model.save_pretrained(tmp_path / "v2")
        wt.throttle_s = 0
        report = wt.sync(model, f"file://{tmp_path / 'v2'}", 2)
        assert report["storage"] == [back.url] and report["broadcast"] == [survivor.url] and not report["stale"]
        assert info(back.url)["policy_version"] == 2 and matches(back.url, model)
        # ... and the one after forms its group again and broadcasts to both
        model = perturbed(tiny_model_dir, 4)
        report = wt.sync(model, None, 3)
        assert sorted(report["broadcast"]) == sorted([back.url, survivor.url])
        assert matches(back.url, model) and matches(survivor.url, model)
    finally:
        wt.close()


def test_engine_stopped_mid_broadcast_costs_only_the_deadline(engine_process, tiny_model_dir):
    victim = engine_process()
    before = info(victim.url)["policy_version"]
    model = perturbed(tiny_model_dir, 5)
    wt = WeightTransfer([PolarEngine(victim.url)], "broadcast", timeout_s=DEADLINE_S, buffer_bytes=64 << 10,
                        throttle_s=0.1)  # ~9 s of transfer: the stop lands mid-way
    try:
        out = run_sync_killing(wt, model, None, 1, victim, signal.SIGSTOP)
        assert isinstance(out.get("error"), WeightSyncError)  # its only engine missed it: the step's sync failed
        assert out["seconds"] < 4 * DEADLINE_S + 15  # the deadline fired; nothing waited forever
        assert wt.stale == {victim.url}
        os.kill(victim.proc.pid, signal.SIGCONT)
        # woken, the engine finds its group gone (or its own deadline passed), drops the staged tensors
        deadline = time.monotonic() + 4 * DEADLINE_S + 10
        while (i := info(victim.url))["transfer"]["receiving"] or i["transfer"]["session"] is not None:
            assert time.monotonic() < deadline, i
            time.sleep(0.1)
        assert i["policy_version"] == before and i["transfer"]["staged"] == 0
    finally:
        wt.close()


def test_auto_falls_back_to_storage_per_engine(engine_server, tiny_model_dir, tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class OldEngine(BaseHTTPRequestHandler):  # answers the storage routes only
        calls: list = []

        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.calls.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), OldEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    old = f"http://127.0.0.1:{server.server_port}"
    model = perturbed(tiny_model_dir, 6)
    wt = WeightTransfer([PolarEngine(engine_server.url), PolarEngine(old)], "auto", timeout_s=10)
    try:
        report = wt.sync(model, "file:///ckpt/v1", 1)
        assert report["broadcast"] == [engine_server.url] and report["storage"] == [old]
        assert OldEngine.calls == ["/pause?mode=wait", "/update_weights", "/resume"]
        assert matches(engine_server.url, model)
    finally:
        wt.close()
        server.shutdown()


def test_config_takes_the_transfer_mode():
    assert TrainConfig().weight_transfer == "storage"  # the default is unchanged
    assert TrainConfig.from_overrides({"weight_transfer": "broadcast"}).weight_transfer == "broadcast"
    with pytest.raises(ConfigError):
        TrainConfig.from_overrides({"weight_transfer": "nccl"})


FSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from trainer.parallel import build_model, place
from engine.transfer import tensor_sha256
from trainer.broadcast import WeightTransfer, named_tensors, tensor_meta
from trainer.weight_sync import PolarEngine
placement = place("auto", timeout_s=120)
model = build_model({model!r}, placement, torch.float32, "auto")
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.02)
meta = tensor_meta(model)
if placement.master:
    wt = WeightTransfer([PolarEngine({url!r})], "broadcast", timeout_s=20, buffer_bytes=1 << 20, verify=True)
    go = wt.prepare(meta)
box = [go if placement.master else None]
dist.broadcast_object_list(box, src=0)
if box[0]:
    tensors = named_tensors(model)
    if placement.master:
        wt.send(tensors)
    else:
        for _ in tensors:
            pass
if placement.master:
    report = wt.finish(None, 11)
    print("REPORT", report["broadcast"], wt.verify_engines(), flush=True)
    wt.close()
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp_ranks_gather_and_rank0_broadcasts(engine_server, tiny_model_dir, tmp_path):
    script = tmp_path / "fsdp_broadcast.py"
    script.write_text(FSDP_SCRIPT.format(root=str(ROOT), model=str(tiny_model_dir), url=engine_server.url))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"REPORT ['{engine_server.url}'] {{'{engine_server.url}': True}}" in run.stdout
    assert httpx.get(f"{engine_server.url}/policy_version").json()["policy_version"] == 11
    # the engine serves the full (gathered) model: every weight +0.02 from the start
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.02)
    assert matches(engine_server.url, base)


def test_a_training_step_broadcasts_to_the_engine(polar_settings, tiny_model_dir, engine_server_factory,
                                                   gateway_factory, tmp_path):
    """train() with weight_transfer=broadcast: the step's weights reach the engine in memory (verified
    by /weight_checker), the gateway is stamped, and train.jsonl has the sync's time."""
    import json

    from tests.plugins.trainer import make_group, publish_groups
    from trainer.train import train

    engine = engine_server_factory(settings=polar_settings)
    gateway = gateway_factory(polar_settings, engine.url)
    publish_groups(polar_settings, [make_group("b", [[30, 31, 32], [40, 41]], [1.0, 0.0])])
    cfg = TrainConfig.from_overrides({
        "model": str(tiny_model_dir), "groups_per_step": 1, "max_steps": 1, "lr": 1e-2, "idle_timeout_s": 2,
        "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
        "engines": [f"polar={engine.url}"], "gateway": gateway.url, "weight_transfer": "broadcast",
        "weight_transfer_verify": True, "weight_transfer_timeout_s": 20})
    train(cfg, polar_settings)
    assert httpx.get(f"{engine.url}/policy_version").json()["policy_version"] == 1
    assert gateway.gw.policy_version == 1 and not gateway.gw.gate.paused
    records = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    sync = [r for r in records if r.get("event") == "sync"]
    assert len(sync) == 1 and sync[0]["mode"] == "broadcast" and sync[0]["broadcast"] == [engine.url]
    assert sync[0]["verified"] == {engine.url: True} and sync[0]["sync_s"] > 0
    assert not [r for r in records if r.get("event") == "sync_error"]
