"""Checkpoints on file:// storage: HF layout, manifest-last completeness, pruning, restore."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from infra.settings import Settings
from trainer import checkpoint


@pytest.fixture
def setup(trainer_model_dir, tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return settings, model, opt, settings.checkpoint_url


def _save(setup, step, model_dir):
    settings, model, opt, root = setup
    state = {"step": step, "policy_version": step, "offsets": {"groups": {"0": step * 10}}}
    return checkpoint.save_checkpoint(root, step, model, opt, state, {"lr": 1e-3}, model_dir, settings)


def test_save_restore_roundtrip(setup, trainer_model_dir, tmp_path):
    settings, model, opt, root = setup
    url = _save(setup, 3, trainer_model_dir)
    assert url.startswith("file://") and url.endswith("step-00000003")
    info = checkpoint.latest(root, settings)
    assert info.step == 3 and info.manifest["policy_version"] == 3
    assert checkpoint.read_state(info, settings)["offsets"] == {"groups": {"0": 30}}
    local = checkpoint.download(info.url, tmp_path / "dl", settings)
    names = {p.name for p in local.iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.pt", "trainer_state.json", "train_config.json",
            "manifest.json", "tokenizer_config.json"} <= names
    restored = AutoModelForCausalLM.from_pretrained(local)
    for (k, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), k
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    checkpoint.load_optimizer(local, opt2, "cpu")
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_incomplete_checkpoints_are_ignored(setup, trainer_model_dir):
    settings, _, _, root = setup
    _save(setup, 1, trainer_model_dir)
    url2 = _save(setup, 2, trainer_model_dir)
    path2 = url2.removeprefix("file://")
    (Path(path2) / "manifest.json").unlink()  # crashed before the manifest
    assert checkpoint.latest(root, settings).step == 1
    url3 = _save(setup, 3, trainer_model_dir)
    weights = Path(url3.removeprefix("file://")) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a file that does not match its manifest
    assert checkpoint.latest(root, settings).step == 1
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.download(url3, "/tmp/never", settings)


def test_prune_keeps_the_newest(setup, trainer_model_dir):
    settings, model, _, root = setup
    for step in (1, 2, 3):
        _save(setup, step, trainer_model_dir)
        url = checkpoint.weights_dir(root, step)
        checkpoint.export_weights(url, model, trainer_model_dir, settings, {"policy_version": step})
    deleted = checkpoint.prune(root, 2, settings)
    assert [u.rsplit("/", 1)[-1] for u in deleted] == ["step-00000001", "v00000001"]
    assert [c.step for c in checkpoint.list_checkpoints(root, settings)] == [2, 3]
    manifest = json.loads(Path(checkpoint.weights_dir(root, 3).removeprefix("file://"), "manifest.json").read_text())
    assert manifest["kind"] == "weights" and "optimizer.pt" not in manifest["files"]
