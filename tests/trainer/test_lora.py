"""LoRA (trainer/lora.py, issue 64) on the tiny model: the base stays frozen and AdamW holds state for the
adapter only; a LoRA step on 2 FSDP2 ranks (gloo) equals one process to 1e-5; the adapter written in PEFT's
layout loads in ``peft`` with the trainer's logits, and merged into the base gives them too; its checkpoint
(adapter + AdamW moments, DCP) saved on 2 ranks resumes in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.models import ensure_model
from infra.settings import Settings
from trainer import lora
from trainer.config import ConfigError, TrainConfig

from tests.trainer.fsdp_step import PROBE, samples
from tests.trainer.lora_step import CFG, run
from tests.trainer.test_weight_sync import recorder  # noqa: F401 - a fixture: an HTTP server that records calls

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCRIPT = Path(__file__).with_name("lora_step.py")


def test_peft_keys_and_adapter_names():
    assert lora.peft_key("model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.peft_key("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert lora.adapter_name("run-a", 12) == "run-a-v12"
    with pytest.raises(ValueError, match="adapter name"):
        lora.adapter_name("run a/b", 1)


@pytest.mark.parametrize("overrides, key", [({"lora_rank": -1}, "lora_rank"), ({"lora_dropout": 1.0}, "lora_dropout"),
                                            ({"lora_alpha": 0}, "lora_alpha"),
                                            ({"lora_rank": 8, "weight_transfer_verify": True}, "weight_transfer_verify"),
                                            ({"lora_rank": 8, "model_name": "my run"}, "model_name")])
def test_bad_lora_settings_fail_in_one_line(overrides, key):
    with pytest.raises(ConfigError, match=key):
        TrainConfig.from_overrides(overrides)


def test_lora_settings_from_strings():
    cfg = TrainConfig.from_overrides({"lora_rank": "8", "lora_alpha": "16", "lora_target_modules": "q_proj,v_proj"})
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert lora.enabled(cfg) and not lora.enabled(TrainConfig())


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """CFG's two LoRA steps in this process, then its checkpoint."""
    return run(str(ensure_model("tiny")), str(tmp_path_factory.mktemp("lora1") / "one.pt"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same on 2 FSDP2 ranks (gloo)."""
    out = tmp_path_factory.mktemp("lora2") / "two.pt"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(ensure_model("tiny")), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _model():
    from trainer.parallel import Placement, build_model

    return build_model(ensure_model("tiny"), Placement(), torch.float32, "auto", lora=CFG)


def test_the_base_is_frozen_and_adamw_holds_the_adapter_only():
    from trainer.attention import load_model
    from trainer.optim import build_optimizer
    from trainer.step import train_step

    model = _model()
    optimizer = build_optimizer(model, CFG)
    base = {n.replace(".base_layer.", "."): p.detach().clone() for n, p in model.named_parameters()
            if not lora.is_adapter_param(n)}
    adapter = {n for n, _ in lora.adapter_params(model)}
    assert len(adapter) == 2 * 7 * 2  # A and B of the 7 projections of each of the 2 layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapter
    out = train_step(model, optimizer, samples("per_request", "token_mean", model.config.vocab_size), CFG,
                     reward_mean=0.0)
    assert out.no_update is None
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert {by_id[id(p)] for p in optimizer.state} == adapter
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in optimizer.state.values())
    start = load_model(ensure_model("tiny")).state_dict()
    assert all(torch.equal(t, start[n]) for n, t in base.items())  # every base weight as it was
    assert any(p.abs().max() > 0 for n, p in lora.adapter_params(model) if ".lora_B." in n)  # B moved off 0


def test_a_lora_step_on_two_fsdp_ranks_equals_one_process(one, sharded):
    assert sharded["strategy"] == "fsdp" and one["strategy"] == "single"
    assert set(sharded["grads"]) == set(one["grads"]) and one["norm"] > 0
    worst = max(((sharded["grads"][k] - g).norm() / g.norm().clamp_min(1e-12)).item() for k, g in one["grads"].items()
                if g.norm() > 0)
    assert worst <= 1e-5, f"largest relative gradient difference {worst:.2e}"
    assert sharded["norm"] == pytest.approx(one["norm"], rel=1e-5)
    assert set(sharded["adapter"]) == set(one["adapter"])
    moved = max(a.abs().max().item() for k, a in one["adapter"].items() if ".lora_B." in k)
    assert moved > 1e-4  # two steps at lr 1e-3 moved B away from 0
    assert max((sharded["adapter"][k] - a).abs().max().item() for k, a in one["adapter"].items()) <= 1e-5


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROBE])).logits


def test_peft_loads_the_written_adapter_with_the_trainers_logits(tmp_path):
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from trainer.optim import build_optimizer
    from trainer.step import train_step

    model = _model()
    train_step(model, build_optimizer(model, CFG), samples("per_request", "token_mean", model.config.vocab_size), CFG,
               reward_mean=0.0)
    model.eval()
    state = lora.adapter_state_dict(model)
    # the keys peft itself saves for this config
    assert set(state) == set(get_peft_model_state_dict(get_peft_model(
        AutoModelForCausalLM.from_pretrained(ensure_model("tiny")), lora.lora_config(CFG))))
    files = lora.write_adapter(tmp_path / "adapter", state, lora.adapter_config(CFG, ensure_model("tiny")))
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    base = AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval()
    before = _logits(base)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    expected = _logits(model)
    assert (_logits(loaded) - expected).abs().max().item() <= 1e-5
    assert (before - expected).abs().max().item() > 1e-4  # the adapter changes the logits
    # merged into the base (what `polarstream export --merge` writes), saved and read back in HF layout
    merged = lora.merge(ensure_model("tiny"), tmp_path / "adapter")
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in k or "base_layer" in k for k in again.state_dict())
    assert (_logits(again) - expected).abs().max().item() <= 1e-5


def test_a_checkpoint_saved_on_two_ranks_resumes_in_one_process(one, sharded):
    from trainer import checkpoint
    from trainer.optim import build_optimizer

    settings = Settings()
    root = sharded["checkpoint"].rsplit("/", 1)[0]
    info = checkpoint.latest(root, settings)
    assert info is not None and info.url == sharded["checkpoint"] and checkpoint.has_train_state(info)
    files = info.manifest["files"]
    assert "adapter_model.safetensors" in files and not any(f.startswith("model") for f in files)
    # the train state is the adapter and its moments, not the base (the tiny model's weights are ~5 MB)
    assert sum(v for k, v in files.items() if k.startswith("train_state/")) < 1_000_000
    model = _model()
    optimizer = build_optimizer(model, CFG)
    checkpoint.load_train_state(info, model, optimizer, settings)
    got = lora.adapter_state_dict(model)
    assert max((got[k] - a).abs().max().item() for k, a in sharded["adapter"].items()) == 0
    # AdamW's moments and step count came back too: the one-process run's, to 1e-5
    reference = _model()
    ref_opt = build_optimizer(reference, CFG)
    checkpoint.load_train_state(checkpoint.latest(one["checkpoint"].rsplit("/", 1)[0], settings), reference, ref_opt,
                                settings)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {n: p for n, p in reference.named_parameters()}
    assert len(optimizer.state) == len(lora.adapter_params(model))
    for p, s in optimizer.state.items():
        r = ref_opt.state[ref_names[names[id(p)]]]
        assert float(s["step"]) == float(r["step"]) == 2
        assert (s["exp_avg"] - r["exp_avg"]).abs().max().item() <= 1e-5
        assert (s["exp_avg_sq"] - r["exp_avg_sq"]).abs().max().item() <= 1e-8


def test_polarstream_export_writes_the_adapter_and_with_merge_the_merged_model(one, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from polarstream.cli import app

    root = one["checkpoint"].rsplit("/", 1)[0]
    r = CliRunner().invoke(app, ["export", "--checkpoint", root, "--out", str(tmp_path / "adapter")])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kind"] == "adapter"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval()
    before = _logits(base)  # from_pretrained injects the adapter into base itself
    expected = _logits(PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval())
    r = CliRunner().invoke(app, ["export", "--checkpoint", one["checkpoint"], "--out", str(tmp_path / "merged"), "--merge"])
    assert r.exit_code == 0, r.output
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "merged").iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (_logits(merged) - expected).abs().max().item() <= 1e-5
    assert (before - expected).abs().max().item() > 1e-4
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "neither a complete checkpoint" in r.output and r.output.count("\n") == 1


@pytest.mark.integration
def test_the_trainer_loop_trains_checkpoints_syncs_and_resumes_an_adapter(polar_settings, recorder, tmp_path):
    """``train`` with LoRA on the real broker and S3 server: each version's adapter in PEFT's layout under
    <root>/adapters, loaded into the engine under <model_name>-v<version> with the gateway stamped after it and
    the old one unloaded; killed and restarted, it resumes from the adapter checkpoint and hands it back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.plugins.trainer import make_group, publish_groups
    from trainer import checkpoint
    from trainer.train import train

    handler, url = recorder
    publish_groups(polar_settings, [make_group(f"g{i}", [[30 + i, 31, 32], [40, 41 + i]], [1.0, 0.0]) for i in range(3)])
    overrides = {"model": str(ensure_model("tiny")), "groups_per_step": 1, "max_steps": 2, "lr": 1e-2,
                 "idle_timeout_s": 2, "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False,
                 "tensorboard": False, "engines": [f"polar={url}"], "gateway": url, "model_name": "exp1",
                 "lora_rank": 4, "lora_alpha": 8}
    summary = train(TrainConfig.from_overrides(overrides), polar_settings)
    assert summary["step"] == 2
    root = polar_settings.checkpoint_url
    adapters = [checkpoint.adapters_dir(root, v) for v in (1, 2)]
    calls = [(p.split("?")[0], b) for p, b in handler.calls]
    run = polar_settings.topic_prefix  # the run the gateway routes to the adapter (schemas.PolicyStamp)
    assert [c for c in calls if "lora" in c[0] or c[0] == "/admin/policy_version"] == [
        ("/v1/load_lora_adapter", {"lora_name": "exp1-v1", "lora_path": adapters[0], "load_inplace": True}),
        ("/admin/policy_version", {"version": 1, "lora_name": "exp1-v1", "run": run}),
        ("/v1/load_lora_adapter", {"lora_name": "exp1-v2", "lora_path": adapters[1], "load_inplace": True}),
        ("/admin/policy_version", {"version": 2, "lora_name": "exp1-v2", "run": run}),
        ("/v1/unload_lora_adapter", {"lora_name": "exp1-v1"}),
    ]
    assert not any(p.startswith("/update_weights") for p, _ in calls)  # the base weights never move
    # the version-2 adapter, as peft reads it, is the checkpoint's
    local = checkpoint.download(adapters[1], tmp_path / "v2", polar_settings)
    assert sorted(p.name for p in local.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    base = AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval()
    before = _logits(base)
    served = _logits(PeftModel.from_pretrained(base, str(local)).eval())
    assert (served - before).abs().max().item() > 1e-4
    # a restart resumes from the step-2 checkpoint (the adapter and its moments), hands the engine that
    # adapter again, and trains step 3 on the third group
    handler.calls.clear()
    summary = train(TrainConfig.from_overrides({**overrides, "max_steps": 3}), polar_settings)
    assert summary["step"] == 3
    events = [json.loads(x) for x in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "start"] == [0, 2]
    assert [e for e in events if e["event"] == "resync"] == [{"event": "resync", "step": 2, "policy_version": 2,
                                                              "adapter": True}]
    loads = [b["lora_name"] for p, b in handler.calls if p == "/v1/load_lora_adapter"]
    assert loads == ["exp1-v2", "exp1-v3"]
    resumed = checkpoint.download(checkpoint.step_dir(root, 2), tmp_path / "s2", polar_settings)
    again = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval(),
                                              str(resumed)).eval())
    assert (again - served).abs().max().item() <= 1e-6  # the checkpoint's adapter is the synced one


@pytest.mark.integration
def test_a_lora_run_broadcasts_its_adapter_and_a_restart_serves_the_checkpoints(polar_settings, engine_server_factory,
                                                                                gateway_factory, tmp_path):
    """``train`` with LoRA and weight_transfer auto against our engine: the adapter's tensors (only those) go in
    memory, the engine serves them as <model_name>-v1 with the logprobs of the adapter the step checkpointed (to
    1e-5), the gateway routes the run to it. An engine that lost it (as a restarted engine would) gets the
    checkpoint's adapter again from a restarted trainer, under the same name."""
    import httpx
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.plugins.trainer import make_group, publish_groups
    from trainer import checkpoint
    from trainer.train import train

    engine_server = engine_server_factory(settings=polar_settings)  # it reads the checkpoint's adapter from S3
    gateway = gateway_factory(polar_settings, engine_server.url)
    publish_groups(polar_settings, [make_group("g0", [[30, 31, 32], [40, 41]], [1.0, 0.0])])
    cfg = TrainConfig.from_overrides({
        "model": str(ensure_model("tiny")), "groups_per_step": 1, "max_steps": 1, "lr": 1e-2, "idle_timeout_s": 2,
        "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
        "engines": [f"polar={engine_server.url}"], "gateway": gateway.url, "model_name": "exp1",
        "lora_rank": 4, "lora_alpha": 8})
    assert train(cfg, polar_settings)["step"] == 1
    events = [json.loads(x) for x in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    [sync] = [e for e in events if e["event"] == "sync"]
    assert (sync["mode"], sync["adapter"], sync["broadcast"]) == ("auto", True, [engine_server.url]) and "storage" not in sync
    base = AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval()
    local = checkpoint.download(checkpoint.step_dir(polar_settings.checkpoint_url, 1), tmp_path / "s1", polar_settings)
    trained = PeftModel.from_pretrained(base, str(local)).eval()
    assert sync["bytes_sent"] == sum(t.numel() * t.element_size() for t in lora.adapter_state_dict(trained).values())
    assert gateway.gw.policy(polar_settings.topic_prefix).lora_name == "exp1-v1"
    with httpx.Client(base_url=engine_server.url, timeout=60) as c:
        assert _served_vs_trainer(c, "exp1-v1", trained) <= 1e-5
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "exp1-v1"}).status_code == 200
        train(cfg, polar_settings)  # nothing left to train: it resumes at step 1 and hands the engines its adapter
        assert _served_vs_trainer(c, "exp1-v1", trained) <= 1e-5
    events = [json.loads(x) for x in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "resync"] == [{"event": "resync", "step": 1, "policy_version": 1,
                                                              "adapter": True}]


def test_activation_checkpointing_and_shared_prefixes_take_the_same_lora_step():
    """Recomputed layers (non-reentrant checkpointing: the frozen embedding's output needs no grad) and a group's
    prefix fed once (polar_varlen's prefix branches) give the plain run's adapter update."""
    from dataclasses import replace

    from trainer.optim import build_optimizer
    from trainer.parallel import Placement, build_model
    from trainer.step import train_step

    got = []
    for ac, share in ((False, False), (True, True)):
        model = build_model(ensure_model("tiny"), Placement(), torch.float32, "auto", activation_checkpointing=ac, lora=CFG)
        out = train_step(model, build_optimizer(model, CFG), samples("prefix_merging", "token_mean", 8192),
                         replace(CFG, share_prefix=share), reward_mean=0.0)
        got.append((out.grad_norm, lora.adapter_state_dict(model)))
    assert got[0][0] > 0 and got[1][0] == pytest.approx(got[0][0], rel=1e-5)
    assert max((got[1][1][k] - v).abs().max().item() for k, v in got[0][1].items()) <= 1e-6


def _served_vs_trainer(client, name: str, model) -> float:
    """The largest gap between the engine's logprobs of tokens it samples with adapter ``name`` and ``model``'s."""
    r = client.post("/v1/completions", json={"model": name, "prompt": PROBE, "max_tokens": 8, "temperature": 1.0,
                                             "seed": 1, "logprobs": 0, "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([PROBE + ids])).logits[0].double(), -1)
    expected = [full[len(PROBE) - 1 + i, t].item() for i, t in enumerate(ids)]
    return max(abs(a - b) for a, b in zip(served, expected))


def test_the_engine_samples_with_the_trainers_adapter(engine_server, tmp_path):
    """The trainer's sync (``sync_adapter``) into our engine: its sampled tokens' logprobs with the adapter equal
    the trainer's model's to 1e-5; the next sync unloads the old name (404 from then on). Then the in-memory
    transfer (``WeightTransfer`` with ``lora``): only the adapter's tensors travel, the engine serves them as
    the next version's adapter with the trainer's logprobs to 1e-5, and the old name goes."""
    import httpx

    from trainer import checkpoint
    from trainer.sync.broadcast import WeightTransfer
    from trainer.optim import build_optimizer
    from trainer.step import train_step
    from trainer.sync.storage import PolarEngine, VllmEngine, WeightSyncError, sync_adapter

    model = _model()
    optimizer = build_optimizer(model, CFG)
    train_step(model, optimizer, samples("per_request", "token_mean", model.config.vocab_size), CFG, reward_mean=0.0)
    model.eval()
    config = lora.adapter_config(CFG, ensure_model("tiny"))
    url = checkpoint.export_adapter(checkpoint.adapters_dir(f"file://{tmp_path}", 1), model, config, Settings(),
                                    {"policy_version": 1})
    engine = PolarEngine(engine_server.url)
    assert sync_adapter([engine], url, 1, "exp-v1") == []
    with httpx.Client(base_url=engine_server.url, timeout=60) as c:
        assert _served_vs_trainer(c, "exp-v1", model) <= 1e-5
        assert sync_adapter([engine], url, 2, "exp-v2", previous="exp-v1") == []
        assert c.post("/v1/completions", json={"model": "exp-v1", "prompt": PROBE, "max_tokens": 1}).status_code == 404
        assert c.post("/v1/completions", json={"model": "exp-v2", "prompt": PROBE, "max_tokens": 1}).status_code == 200

        v2 = lora.adapter_state_dict(model)
        model.train()
        train_step(model, optimizer, samples("per_request", "token_mean", model.config.vocab_size), CFG, reward_mean=0.0)
        model.eval()
        assert max((t - v2[k]).abs().max().item() for k, t in lora.adapter_state_dict(model).items()) > 1e-4
        transfer = WeightTransfer([engine], "auto", timeout_s=30, lora=True)
        try:
            assert transfer.prepare(lora.adapter_meta(model))
            transfer.send(lora.adapter_tensors(model))
            report = transfer.finish_adapter(None, 3, "exp-v3", config, previous="exp-v2")
            # a full-weight finish of staged adapter tensors is refused, the served weights untouched
            assert transfer.prepare(lora.adapter_meta(model))
            transfer.send(lora.adapter_tensors(model))
            with pytest.raises(WeightSyncError, match="staged tensors are a LoRA adapter"):
                transfer.finish(None, 4)
        finally:
            transfer.close()
        assert report["broadcast"] == [engine_server.url] and not report["storage"] and not report.get("unload_errors")
        assert report["bytes_sent"] == sum(t.numel() * t.element_size() for t in lora.adapter_state_dict(model).values())
        assert _served_vs_trainer(c, "exp-v3", model) <= 1e-5
        assert c.post("/v1/completions", json={"model": "exp-v2", "prompt": PROBE, "max_tokens": 1}).status_code == 404
        assert c.get("/policy_version").json()["policy_version"] == 0  # the base weights never moved

        # an engine that cannot take the next adapter (a vLLM one loads it from storage; nothing listens there)
        # fails the sync before its stamp, and the engine that took it in memory unloads it again
        transfer = WeightTransfer([engine, VllmEngine("http://127.0.0.1:1")], "auto", timeout_s=30, lora=True)
        try:
            assert transfer.prepare(lora.adapter_meta(model))
            transfer.send(lora.adapter_tensors(model))
            with pytest.raises(WeightSyncError, match="not on every engine"):
                transfer.finish_adapter(url, 4, "exp-v4", config, previous="exp-v3")
        finally:
            transfer.close()
        assert c.post("/v1/completions", json={"model": "exp-v4", "prompt": PROBE, "max_tokens": 1}).status_code == 404
        assert c.post("/v1/completions", json={"model": "exp-v3", "prompt": PROBE, "max_tokens": 1}).status_code == 200
