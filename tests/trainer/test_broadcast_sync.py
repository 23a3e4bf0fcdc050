"""The trainer's broadcast sync under faults (trainer/sync/broadcast.py): an engine SIGKILLed or SIGSTOPped
mid-broadcast costs the trainer at most its deadline, the others finish, and the lost engine comes back
through storage at the right version, from the export written in the background; plus the FSDP path
(2 gloo ranks gather, rank 0 broadcasts and exports) and a training step.

Cost: one engine process per module (``engine_process``: stopped by one test, killed by the next, which
brings the engine back in-process at the same URL), one in-process engine for the rest
(``module_engine_server``), deadlines of 3 s."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.weight_transfer import checksum_key, tensor_sha256
from infra.settings import Settings
from infra.storage import filesystem
from tests.plugins.engine import ENGINE_PROCESS_DEADLINE_S as DEADLINE_S
from trainer import checkpoint
from trainer.sync.broadcast import Packed, WeightTransfer, named_tensors, tensor_meta
from trainer.config import ConfigError, TrainConfig
from trainer.sync.storage import PolarEngine, WeightSyncError

ROOT = Path(__file__).parents[2]


class QuietHandler(BaseHTTPRequestHandler):
    """A stand-in HTTP peer (an old engine, the gateway's admin routes) that logs nothing."""

    def reply_empty_json(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a):
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """``handler`` on a free port of 127.0.0.1, served by a daemon thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    baseline = {checksum_key(n): tensor_sha256(t) for n, t in named_tensors(model)}
    r = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=60)
    return r.json()["match"]


def run_sync_killing(wt, model, url, version, victim, sig):
    """``wt.sync`` in a thread while ``sig`` hits ``victim`` once it is receiving: {report or error,
    seconds (the sync's), after_signal_s (from the signal to the sync's end)}."""
    out: dict = {}
    buffers_before = info(victim.url)["transfer"]["buffers"]  # counted over the engine's life

    def go():
        t0 = time.monotonic()
        try:
            out["report"] = wt.sync(model, url, version)
        except WeightSyncError as e:
            out["error"] = e
        out["end"] = time.monotonic()
        out["seconds"] = out["end"] - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not ((i := info(victim.url)["transfer"])["receiving"] and i["buffers"] > buffers_before + 2):
        assert time.monotonic() < deadline and t.is_alive(), "the victim never started receiving"
        time.sleep(0.01)
    os.kill(victim.proc.pid, sig)
    hit = time.monotonic()
    t.join(timeout=120)
    assert not t.is_alive(), "the sync hung"
    out["after_signal_s"] = out["end"] - hit
    return out


def test_config_takes_the_transfer_mode():
    assert TrainConfig().weight_transfer == "auto"  # broadcast where the engine speaks the protocol, else storage
    assert TrainConfig.from_overrides({"weight_transfer": "broadcast"}).weight_transfer == "broadcast"
    with pytest.raises(ConfigError):
        TrainConfig.from_overrides({"weight_transfer": "nccl"})


def test_engine_stopped_mid_broadcast_costs_only_the_deadline(engine_process, tiny_model_dir):
    victim = engine_process.get()
    before = info(victim.url)["policy_version"]
    model = perturbed(tiny_model_dir, 5)
    wt = WeightTransfer([PolarEngine(victim.url)], "broadcast", timeout_s=DEADLINE_S, buffer_bytes=64 << 10,
                        throttle_s=0.1)  # ~9 s of transfer: the stop lands mid-way
    try:
        out = run_sync_killing(wt, model, None, 1, victim, signal.SIGSTOP)
        assert isinstance(out.get("error"), WeightSyncError)  # its only engine missed it: the step's sync failed
        # the deadline fired, once: what was left is neither sent nor waited for
        assert DEADLINE_S * 0.9 < out["after_signal_s"] < DEADLINE_S + 6, out
        assert wt.stale == {victim.url}
        os.kill(victim.proc.pid, signal.SIGCONT)
        # woken, the engine finds its group gone (or its own deadline passed), drops the staged tensors
        deadline = time.monotonic() + 2 * DEADLINE_S + 10
        while (i := info(victim.url))["transfer"]["receiving"] or i["transfer"]["session"] is not None:
            assert time.monotonic() < deadline, i
            time.sleep(0.1)
        assert i["policy_version"] == before and i["transfer"]["staged"] == 0
    finally:
        wt.close()


def test_engine_killed_mid_broadcast(engine_process, module_engine_server, tiny_model_dir, tmp_path):
    victim, survivor = engine_process.get(), module_engine_server
    model = perturbed(tiny_model_dir, 3)
    # ~5 s of transfer: a loaded machine's polling still sees the victim receive before it ends
    wt = WeightTransfer([PolarEngine(victim.url), PolarEngine(survivor.url)], "broadcast", timeout_s=DEADLINE_S,
                        buffer_bytes=64 << 10, throttle_s=0.06)
    try:
        out = run_sync_killing(wt, model, None, 1, victim, signal.SIGKILL)
        report = out["report"]  # the survivor got it: no error
        assert out["after_signal_s"] < DEADLINE_S + 10, out
        assert report["broadcast"] == [survivor.url] and report["stale"] == [victim.url]
        assert httpx.get(f"{survivor.url}/policy_version").json()["policy_version"] == 1 and matches(survivor.url, model)
        # the engine comes back at its URL (in-process on the same port here: a process start costs ~10 s) ...
        victim.proc.wait(timeout=10)
        back = engine_process.serve_on_port(victim.port)
        # ... and the next sync loads it from storage at that sync's version, from the export written in
        # the background from the sent buffers as train() writes it: the storage load waits for it (written
        # a second late here; without the wait the engine would find nothing at the URL)
        url = f"file://{tmp_path}/weights/v00000002"
        settings = Settings()

        def write_export(packed):
            time.sleep(1.0)
            checkpoint.write_packed_export(url, packed, model, tiny_model_dir, settings, {"policy_version": 2})

        wt.throttle_s = 0
        report = wt.sync(model, url, 2, write_export=write_export)
        assert report["storage"] == [back.url] and report["broadcast"] == [survivor.url] and not report["stale"]
        assert report["export"].done and report["export"].error is None and report["export_wait_s"] > 0
        assert info(back.url)["policy_version"] == 2 and matches(back.url, model)
        # ... and the one after forms its group again and broadcasts to both
        model = perturbed(tiny_model_dir, 4)
        report = wt.sync(model, None, 3)
        assert sorted(report["broadcast"]) == sorted([back.url, survivor.url])
        assert matches(back.url, model) and matches(survivor.url, model)
    finally:
        wt.close()


def logprob_is_the_trainers(url, model) -> bool:
    """The engine's next-token logprob is ``model``'s to 1e-5 (the tied head follows the embedding)."""
    prompt = [5, 6, 7, 8, 9]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "seed": 7, "logprobs": 0,
            "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    with torch.no_grad():
        expected = torch.log_softmax(model.eval()(torch.tensor([prompt])).logits[0, -1].float(), -1)
    return abs(choice["logprobs"]["token_logprobs"][0] - expected[choice["token_ids"][0]].item()) < 1e-5


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_one_group_the_middle_engine_lost_mid_transfer_the_other_two_get_the_weights(
        sig, engine_process, module_engine_server, engine_server, tiny_model_dir, monkeypatch):
    """Three engines in one group (ranks 1, 2, 3, relaying), the middle one killed or frozen mid-transfer: the
    trainer finds it gone (/health), forms the group again without it and sends again to the rank behind it;
    the first and the last serve the trainer's weights, the lost one is stale (storage at the next sync)."""
    monkeypatch.setenv("POLAR_WEIGHT_TRANSFER_TIMEOUT_S", str(2 * DEADLINE_S))  # the in-process engines' deadline
    first, victim, last = module_engine_server, engine_process.get(), engine_server
    model = perturbed(tiny_model_dir, 31)
    # ~5 s of transfer: a loaded machine's polling still sees the victim receive before it ends
    wt = WeightTransfer([PolarEngine(first.url), PolarEngine(victim.url), PolarEngine(last.url)], "broadcast",
                        timeout_s=DEADLINE_S, buffer_bytes=64 << 10, throttle_s=0.06)
    try:
        out = run_sync_killing(wt, model, None, 1, victim, sig)
        report = out["report"]
        assert report["broadcast"] == [first.url, last.url] and report["stale"] == [victim.url], report
        # a lost member is found by its probe: the others do not wait for the deadline
        assert out["after_signal_s"] < DEADLINE_S + 3, out
        # each buffer left the trainer once for the group, and once more for the group formed without the victim
        assert report["bytes_sent"] == 2 * report["bytes_per_engine"], report
        for url in (first.url, last.url):
            assert info(url)["policy_version"] == 1 and matches(url, model) and logprob_is_the_trainers(url, model)
    finally:
        wt.close()
        victim.stop()


def test_auto_falls_back_to_storage_per_engine(module_engine_server, tiny_model_dir, tmp_path):
    url = f"file://{tmp_path}/weights/v00000001"
    manifest = tmp_path / "weights" / "v00000001" / "manifest.json"

    class OldEngine(QuietHandler):  # answers the storage routes only
        calls: list = []
        complete_when_loaded: list = []

        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            self.calls.append(self.path)
            if self.path == "/update_weights":
                assert json.loads(body)["checkpoint_url"] == url
                self.complete_when_loaded.append(manifest.exists())
            self.reply_empty_json()

    server = serve(OldEngine)
    old = f"http://127.0.0.1:{server.server_port}"
    model = perturbed(tiny_model_dir, 6)
    settings = Settings()

    def write_export(packed):  # a slow export: the storage engine is told to load only once it is complete
        time.sleep(1.0)
        checkpoint.write_packed_export(url, packed, model, tiny_model_dir, settings, {"policy_version": 1})

    wt = WeightTransfer([PolarEngine(module_engine_server.url), PolarEngine(old)], "auto", timeout_s=DEADLINE_S)
    try:
        report = wt.sync(model, url, 1, write_export=write_export)
        assert report["broadcast"] == [module_engine_server.url] and report["storage"] == [old]
        assert OldEngine.calls == ["/pause?mode=wait", "/update_weights", "/resume"]
        assert OldEngine.complete_when_loaded == [True]
        assert matches(module_engine_server.url, model)
    finally:
        wt.close()
        server.shutdown()


# Rank 1 of two FSDP2 ranks, in a process started as torchrun would start it (its environment, without its
# agent); rank 0 is the test process (as tests/trainer/test_checkpoint.py places itself): one torch +
# transformers start instead of three. Every rank gathers each tensor; rank 0 alone sends and exports.
RANK1_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from trainer.parallel import build_model, place
from trainer.sync.broadcast import named_tensors
placement = place("auto", timeout_s=120)
model = build_model({model!r}, placement, torch.float32, "auto")
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.02)
box = [None]
dist.broadcast_object_list(box, src=0)
if box[0]:
    for _ in named_tensors(model):
        pass
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp_ranks_gather_and_rank0_broadcasts(module_engine_server, tiny_model_dir, tmp_path, monkeypatch):
    import torch.distributed as dist

    from engine.weights import read_checkpoint
    from trainer.sync.broadcast import tensor_meta
    from trainer.parallel import build_model, place

    url = module_engine_server.url
    export = f"file://{tmp_path}/weights/v00000011"
    script = tmp_path / "rank1.py"
    script.write_text(RANK1_SCRIPT.format(root=str(ROOT), model=str(tiny_model_dir)))
    env = {"TORCHELASTIC_RUN_ID": "test-broadcast", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    rank1 = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, **env, "OMP_NUM_THREADS": "1", "RANK": "1", "LOCAL_RANK": "1"})
    for k, v in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    try:
        placement = place("auto", timeout_s=120)
        assert (placement.rank, placement.world, placement.strategy) == (0, 2, "fsdp")
        try:
            model = build_model(tiny_model_dir, placement, torch.float32, "auto")
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02)
            wt = WeightTransfer([PolarEngine(url)], "broadcast", timeout_s=5, buffer_bytes=1 << 20, verify=True)
            try:
                box = [wt.prepare(tensor_meta(model))]
                dist.broadcast_object_list(box, src=0)
                assert box[0]
                packed = wt.send(named_tensors(model), keep=True)
                report = wt.finish(None, 11)
                checkpoint.write_packed_export(export, packed, model, tiny_model_dir, Settings(), {"policy_version": 11})
                assert report["broadcast"] == [url] and wt.verify_engines() == {url: True}
            finally:
                wt.close()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        out, err = rank1.communicate(timeout=120)
        assert rank1.returncode == 0, err[-3000:]
    finally:
        rank1.kill()
        rank1.wait()
    assert httpx.get(f"{url}/policy_version").json()["policy_version"] == 11
    # the engine serves the full (gathered) model, and the export holds it: every weight +0.02 from the start
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.02)
    assert matches(url, base)
    written = read_checkpoint(export, Settings())
    expected = dict(named_tensors(base))
    assert set(written) == set(expected) and all(torch.equal(written[n], t) for n, t in expected.items())


def test_a_training_step_broadcasts_to_the_engine(polar_settings, tiny_model_dir, module_engine_server,
                                                   gateway_factory, tmp_path):
    """train() with weight_transfer=broadcast: the step's weights reach the engine in memory (verified
    by /weight_checker), the gateway is stamped, train.jsonl has the sync's time, and the step's export
    is written in the background, complete, beside it."""
    from engine.weights import read_checkpoint
    from tests.plugins.trainer import make_group, publish_groups
    from trainer.train import train

    engine = module_engine_server
    gateway = gateway_factory(polar_settings, engine.url)
    publish_groups(polar_settings, [make_group("b", [[30, 31, 32], [40, 41]], [1.0, 0.0])])
    cfg = TrainConfig.from_overrides({
        "model": str(tiny_model_dir), "groups_per_step": 1, "max_steps": 1, "lr": 1e-2, "idle_timeout_s": 2,
        "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
        "engines": [f"polar={engine.url}"], "gateway": gateway.url, "weight_transfer": "broadcast",
        "weight_transfer_verify": True, "weight_transfer_timeout_s": DEADLINE_S,
        "checkpoint_every": 5})  # step 1 syncs between checkpoints: its export goes in the background
    train(cfg, polar_settings)
    assert httpx.get(f"{engine.url}/policy_version").json()["policy_version"] == 1
    assert gateway.gw.policy_version == 1 and not gateway.gw.gate.paused
    records = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    sync = [r for r in records if r.get("event") == "sync"]
    assert len(sync) == 1 and sync[0]["mode"] == "broadcast" and sync[0]["broadcast"] == [engine.url]
    assert sync[0]["verify_s"] >= 0 and not sync[0].get("errors")  # verified (before the stamp) and matched
    assert sync[0]["sync_s"] > 0 and sync[0]["export"] == "background"
    assert not [r for r in records if r.get("event") in ("sync_error", "export_error")]
    exported = [r for r in records if r.get("event") == "export"]
    export_url = checkpoint.weights_dir(polar_settings.checkpoint_url, 1)
    assert [r["url"] for r in exported] == [export_url]
    # complete (its manifest lists every file at its size) and what the engine serves
    fs, path = filesystem(export_url, polar_settings)
    assert checkpoint._read_manifest(fs, path) is not None
    fs_state = read_checkpoint(export_url, polar_settings)
    served = httpx.post(f"{engine.url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
    assert {n: tensor_sha256(t) for n, t in fs_state.items()} == {n: served[checksum_key(n)] for n in fs_state}
    assert checkpoint.newest_export(polar_settings.checkpoint_url, polar_settings) == 1


def test_send_buffers_live_across_syncs_and_a_set_lent_to_an_export_is_reused_once_given_back():
    wt = WeightTransfer([], "broadcast")
    try:
        ring = wt._buffers([8, 4, 6], keep=False)  # double buffering: buffer j and j + 2 share memory
        assert ring(0).data_ptr() == ring(2).data_ptr() != ring(1).data_ptr()
        assert [ring(j).numel() for j in range(3)] == [8, 4, 6]
        assert wt._buffers([8, 4, 6], keep=False)(0).data_ptr() == ring(0).data_ptr()  # the next sync's
        lent = wt._buffers([8, 4], keep=True)
        busy = wt._buffers([8, 4], keep=True)  # the first set's export is still being written: a fresh set
        assert busy(0).data_ptr() != lent(0).data_ptr() and busy(1).numel() == 4
        wt.release([Packed(busy(0), [])])  # not the lent set: changes nothing
        assert wt._buffers([8, 4], keep=True)(0).data_ptr() != lent(0).data_ptr()
        wt.release([Packed(lent(0), []), Packed(lent(1), [])])
        assert wt._buffers([8, 4], keep=True)(0).data_ptr() == lent(0).data_ptr()
    finally:
        wt.close()


def test_verified_before_stamped_a_mismatch_reloads_from_storage(engine_server, tiny_model_dir, tmp_path):
    """With ``verify``, the engines' digests are compared with the sent tensors' (vLLM's ``/weight_checker``
    compare) after the swap and before the gateway stamps the version. Bytes that arrive changed (here: one
    staged tensor altered inside the engine between the transfer and the finish, the fault injected) mark the
    engine stale and it loads the step's export from storage, still before the stamp: when the gateway is
    stamped, the engine serves the sent weights."""
    from trainer.sync.broadcast import BackgroundExport
    from trainer.sync.storage import Gateway

    url, engine = engine_server.url, engine_server.url
    model = perturbed(tiny_model_dir, 21)
    at_stamp: list = []

    class GatewayAdmin(QuietHandler):  # records the admin calls; at the stamp, what the engine serves
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.startswith("/admin/policy_version"):
                at_stamp.append(matches(engine, model))
            self.reply_empty_json()

    server = serve(GatewayAdmin)
    gateway = Gateway(f"http://127.0.0.1:{server.server_port}", "token")
    receiver = engine_server._server.config.app.state.receiver
    wt = WeightTransfer([PolarEngine(url)], "broadcast", timeout_s=DEADLINE_S, verify=True)
    try:
        for version, corrupt in ((1, False), (2, True)):
            export_url = f"file://{tmp_path}/weights/v{version:08d}"
            assert wt.prepare(tensor_meta(model))
            packed = wt.send(named_tensors(model), keep=True)
            if corrupt:
                wt._pending[url].thread.join(30)  # the engine holds every tensor (its /update_weights returned)
                with torch.no_grad():
                    next(iter(receiver._staging.values())).view(-1)[0] += 1.0
            export = BackgroundExport(export_url, lambda: checkpoint.write_packed_export(
                export_url, packed, model, tiny_model_dir, Settings(), {"policy_version": version}),
                after=lambda: wt.release(packed))
            report = wt.finish(export_url, version, gateway, url_ready=export.wait)
            if not corrupt:
                assert report["broadcast"] == [url] and report["storage"] == [] and report["verify_s"] >= 0
            else:
                assert report["broadcast"] == [] and report["storage"] == [url] and report["stale"] == []
                assert "weight_checker: 1 tensors differ" in report["errors"][url]
        assert at_stamp == [True, True]  # both stamps found the engine serving the sent weights
        assert httpx.get(f"{url}/policy_version").json()["policy_version"] == 2
    finally:
        wt.close()
        server.shutdown()
