"""Weight sync: the real engine and gateway after a training step; vLLM's route sequence; failures."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.plugins.trainer import make_group, publish_groups
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.train import train
from trainer.sync.storage import PolarEngine, VllmEngine, WeightSyncError, sync_weights


def _completion_logprob(engine_url, prompt):
    r = httpx.post(f"{engine_url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 1.0, "seed": 7, "logprobs": 0,
                                                         "return_token_ids": True}, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


def test_training_step_reaches_the_engine_and_the_gateway(polar_settings, tiny_model_dir, engine_server_factory,
                                                         gateway_factory, tmp_path):
    trainer_model_dir = tiny_model_dir  # the engine serves the model the trainer trains
    engine = engine_server_factory(settings=polar_settings)
    gateway = gateway_factory(polar_settings, engine.url)
    publish_groups(polar_settings, [make_group("w", [[30, 31, 32], [40, 41]], [1.0, 0.0])])
    cfg = TrainConfig.from_overrides({
        "model": str(trainer_model_dir), "groups_per_step": 1, "max_steps": 1, "lr": 1e-2, "idle_timeout_s": 2,
        "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
        "engines": [f"polar={engine.url}"], "gateway": gateway.url})
    summary = train(cfg, polar_settings)

    assert httpx.get(f"{engine.url}/policy_version").json()["policy_version"] == 1
    assert httpx.get(f"{engine.url}/is_paused").json()["is_paused"] is False
    assert gateway.gw.policy_version == 1 and not gateway.gw.gate.paused
    # the engine now samples from exactly the checkpointed weights
    prompt = [5, 6, 7, 8, 9]
    token, logprob = _completion_logprob(engine.url, prompt)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.download(summary["checkpoint"], tmp_path / "c", polar_settings))
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)[token].item()
    base = AutoModelForCausalLM.from_pretrained(trainer_model_dir)
    with torch.no_grad():
        before = torch.log_softmax(base(torch.tensor([prompt])).logits[0, -1].float(), -1)[token].item()
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert abs(expected - before) > 1e-4  # and they are new weights

    # A trainer resumed while the engine and the gateway still serve its version leaves them alone; once
    # one of them serves another (the gateway's stamp set back here, as a restarted gateway's would be),
    # the next resume hands them the checkpoint again.
    def resyncs() -> list[dict]:
        lines = (tmp_path / "run" / "train.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("event") == "resync"]

    train(cfg, polar_settings)
    assert resyncs() == [{"event": "resync", "step": 1, "policy_version": 1, "skipped": "already served"}]
    httpx.post(f"{gateway.url}/admin/policy_version", json={"version": 0},
               headers={"authorization": f"Bearer {polar_settings.admin_token}"}).raise_for_status()
    train(cfg, polar_settings)
    assert resyncs()[-1] == {"event": "resync", "step": 1, "policy_version": 1} and gateway.gw.policy_version == 1


class _Recorder(BaseHTTPRequestHandler):
    calls: list = []
    fail_on: str = ""

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.calls.append((self.path, json.loads(body) if body else None))
        status = 500 if self.fail_on and self.path.startswith(self.fail_on) else 200
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    handler = type("H", (_Recorder,), {"calls": [], "fail_on": ""})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_vllm_sequence_uses_its_documented_rl_routes(recorder):
    handler, url = recorder
    sync_weights([VllmEngine(url)], "file:///ckpt/step-00000003", 3)
    assert handler.calls == [
        ("/pause?mode=wait", None),
        ("/collective_rpc",
         {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-00000003"}, "timeout": 600.0}),
        ("/reset_prefix_cache", None),
        ("/update_weight_version", {"new_version": "3"}),
        ("/resume", None),
    ]
    with pytest.raises(WeightSyncError, match="not file://"):
        VllmEngine(url).load("s3://bucket/ckpt", 4)


def test_failed_load_still_resumes_every_engine(recorder):
    handler, url = recorder
    handler.fail_on = "/update_weights"
    with pytest.raises(WeightSyncError, match="HTTP 500"):
        sync_weights([PolarEngine(url), PolarEngine(url)], "s3://b/ckpt", 2)
    paths = [p for p, _ in handler.calls]
    assert paths == ["/pause?mode=wait", "/pause?mode=wait", "/update_weights", "/resume", "/resume"]
    assert handler.calls[2][1] == {"checkpoint_url": "s3://b/ckpt", "version": 2}


def test_a_lora_sync_loads_the_new_adapter_stamps_it_then_unloads_the_old(recorder):
    """Issue 64's order: every engine loads the new version's adapter beside the old one (no engine pauses),
    the gateway drains, is stamped with the version and the adapter's name, resumes; then the old adapter goes."""
    from trainer.sync.storage import Gateway, sync_adapter

    handler, url = recorder
    errors = sync_adapter([PolarEngine(url), VllmEngine(url)], "file:///ckpt/adapters/v00000003", 3, "run-v3",
                          Gateway(url, "token", run="exp1."), previous="run-v2")
    assert errors == []
    load = {"lora_name": "run-v3", "lora_path": "/ckpt/adapters/v00000003", "load_inplace": True}
    assert [(p.split("?")[0], b) for p, b in handler.calls] == [
        ("/v1/load_lora_adapter", load), ("/v1/load_lora_adapter", load),
        ("/admin/pause", None), ("/admin/policy_version", {"version": 3, "lora_name": "run-v3", "run": "exp1."}), ("/admin/resume", None),
        ("/v1/unload_lora_adapter", {"lora_name": "run-v2"}), ("/v1/unload_lora_adapter", {"lora_name": "run-v2"}),
    ]
    # a load that fails leaves the gateway on the old adapter, and the old adapter loaded
    handler.calls.clear()
    handler.fail_on = "/v1/load_lora_adapter"
    with pytest.raises(WeightSyncError, match="HTTP 500"):
        sync_adapter([PolarEngine(url)], "file:///a/v4", 4, "run-v4", Gateway(url, "token"), previous="run-v3")
    assert [p for p, _ in handler.calls] == ["/v1/load_lora_adapter"]
    # ... and one that fails on a second engine (here: nothing listens) unloads it from the first again: the
    # next sync loads another name, so a half-loaded adapter would hold that engine's LoRA slot for good
    handler.calls.clear()
    handler.fail_on = ""
    with pytest.raises(WeightSyncError, match="127.0.0.1:1"):
        sync_adapter([PolarEngine(url), PolarEngine("http://127.0.0.1:1")], "file:///a/v4", 4, "run-v4",
                     Gateway(url, "token"), previous="run-v3")
    assert handler.calls == [("/v1/load_lora_adapter", {"lora_name": "run-v4", "lora_path": "/a/v4", "load_inplace": True}),
                             ("/v1/unload_lora_adapter", {"lora_name": "run-v4"})]
    # an unload that fails does not fail the sync: the new adapter serves; the error is returned (and logged)
    handler.calls.clear()
    handler.fail_on = "/v1/unload_lora_adapter"
    errors = sync_adapter([PolarEngine(url)], "file:///a/v4", 4, "run-v4", None, previous="run-v3")
    assert len(errors) == 1 and "HTTP 500" in errors[0]


def test_vllm_gets_an_s3_adapter_as_a_local_directory(recorder, polar_settings, tmp_path):
    """vLLM loads adapters from local directories only: an adapter in object storage is copied to one, whole,
    before ``/v1/load_lora_adapter`` names it (never an s3:// path); our engine reads s3:// itself."""
    from infra.storage import join, write_bytes

    handler, url = recorder
    adapter = join(polar_settings.storage_url, "adapters", "v00000005")
    files = {"adapter_config.json": b'{"r": 8, "peft_type": "LORA"}', "adapter_model.safetensors": b"\x00weights\x01"}
    for name, data in files.items():
        write_bytes(join(adapter, name), data, polar_settings)
    VllmEngine(url, settings=polar_settings).load_adapter("run-v5", adapter)
    PolarEngine(url).load_adapter("run-v5", adapter)
    (_, to_vllm), (_, to_polar) = handler.calls
    local = Path(to_vllm["lora_path"])
    assert "://" not in to_vllm["lora_path"] and local.is_dir()
    assert {p.name: p.read_bytes() for p in local.iterdir()} == files
    assert to_polar["lora_path"] == adapter
    with pytest.raises(WeightSyncError, match="adapter_config.json"):
        VllmEngine(url, settings=polar_settings).load_adapter("run-v6", join(polar_settings.storage_url, "nothing"))
