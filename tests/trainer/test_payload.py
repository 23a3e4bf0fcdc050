"""trainer/sync/payload.py: one Payload type for full weights and a LoRA adapter, each telling the sync paths
its own tensors, export directory and engine-side name (a real tiny model, with and without an adapter)."""

from __future__ import annotations

import torch

from infra.models import ensure_model
from trainer import lora
from trainer.parallel import Placement, build_model
from trainer.sync import Payload
from trainer.sync.broadcast import tensor_meta

from tests.trainer.lora_step import CFG


def test_full_weights_payload_names_the_exported_tensors_and_the_weights_directory():
    model = build_model(ensure_model("tiny"), Placement(), torch.float32, "auto")
    p = Payload.of(model, 7, "polar-tiny", None)
    assert (p.kind, p.adapter, p.name, p.log_fields()) == ("weights", False, None, {})
    meta = p.meta()
    assert meta == tensor_meta(model) and meta
    assert [(n, t.dtype, list(t.shape)) for n, t in p.tensors()] == meta  # what prepare announced, in its order
    assert p.export_dir("s3://b/ckpt/") == "s3://b/ckpt/weights/v00000007"


def test_adapter_payload_carries_only_the_adapter_under_its_version_name():
    model = build_model(ensure_model("tiny"), Placement(), torch.float32, "auto", lora=CFG)
    config = lora.adapter_config(CFG, ensure_model("tiny"))
    p = Payload.of(model, 3, "polar-tiny", config, url="file:///x")
    assert (p.kind, p.adapter, p.url, p.log_fields()) == ("adapter", True, "file:///x", {"adapter": True})
    assert p.name == lora.adapter_name("polar-tiny", 3) and p.config is config
    names = [n for n, _, _ in p.meta()]
    assert names and all("lora_" in n for n in names)  # the adapter's tensors, not the base model's
    assert [n for n, _ in p.tensors()] == names
    assert sum(t.numel() for _, t in p.tensors()) < sum(t.numel() for t in model.parameters()) / 10
    assert p.export_dir("file:///r") == "file:///r/adapters/v00000003"
