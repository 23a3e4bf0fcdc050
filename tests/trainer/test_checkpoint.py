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
    assert any(n.startswith("train_state/") and n.endswith(".distcp") for n in info.manifest["files"])
    assert checkpoint.read_state(info, settings)["offsets"] == {"groups": {"0": 30}}
    local = checkpoint.download(info.url, tmp_path / "dl", settings)
    names = {p.name for p in local.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "trainer_state.json", "train_config.json",
            "manifest.json", "tokenizer_config.json"} <= names and "train_state" not in names
    restored = AutoModelForCausalLM.from_pretrained(local)  # the HF export, as an engine loads it
    for (k, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), k
    # the train state: a fresh model and optimizer take the saved weights and AdamW moments
    fresh = AutoModelForCausalLM.from_pretrained(trainer_model_dir)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint.load_train_state(info, fresh, opt2, settings)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_incomplete_checkpoints_are_ignored(setup, trainer_model_dir):
    settings, _, _, root = setup
    _save(setup, 1, trainer_model_dir)
    url2 = _save(setup, 2, trainer_model_dir)
    path2 = url2.removeprefix("file://")
    (Path(path2) / "manifest.json").unlink()  # crashed before the manifest
    assert checkpoint.latest(root, settings).step == 1
    url3 = _save(setup, 3, trainer_model_dir)
    weights = next(Path(url3.removeprefix("file://")).glob("model-*.safetensors"))
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
    assert manifest["kind"] == "weights" and not any(n.startswith("train_state/") for n in manifest["files"])


def test_a_half_written_train_state_is_not_a_checkpoint(setup, trainer_model_dir):
    """A rank that dies mid-save leaves a train-state file short of its manifest size: not loaded."""
    settings, _, _, root = setup
    _save(setup, 1, trainer_model_dir)
    url2 = _save(setup, 2, trainer_model_dir)
    shard = next(Path(url2.removeprefix("file://"), "train_state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert checkpoint.latest(root, settings).step == 1


def test_a_checkpoint_of_the_older_layout_still_resumes_in_one_process(setup, trainer_model_dir, tmp_path):
    """model.safetensors + optimizer.pt (before sharded train state): weights and moments load."""
    import io

    from safetensors.torch import save_file

    settings, model, opt, root = setup
    old = Path(checkpoint.step_dir(root, 4).removeprefix("file://"))
    old.mkdir(parents=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, old / "model.safetensors")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    (old / "optimizer.pt").write_bytes(buf.getvalue())
    (old / "trainer_state.json").write_text(json.dumps({"step": 4, "policy_version": 4}))
    files = {f.name: f.stat().st_size for f in old.iterdir()}
    (old / "manifest.json").write_text(json.dumps({"files": files, "policy_version": 4}))
    info = checkpoint.latest(root, settings)
    fresh = AutoModelForCausalLM.from_pretrained(trainer_model_dir)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint.load_train_state(info, fresh, opt2, settings)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]

    # under a process group (FSDP2), that layout is refused in one line that says what to do
    import torch.distributed as dist

    from trainer.parallel import place

    place("fsdp", timeout_s=30)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="resumes in one process only") as refused:
            checkpoint.load_train_state(info, fresh, opt2, settings)
        assert info.url in str(refused.value) and "\n" not in str(refused.value)
    finally:
        dist.destroy_process_group()
