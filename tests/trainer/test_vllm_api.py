"""The trainer's vLLM path against the pinned wheel (vllm==0.33.0, the peer venv of ``make vllm-peer``).

- CI check: every vLLM symbol our code imports or calls exists in the pinned wheel, with the signature we call
  it with (the static ``NCCLWeightTransferEngine.trainer_init`` our trainer called was removed in 0.28 and no
  test reached it); the wheel's version is inside ``VLLM_SUPPORTED``.
- Our trainer's vLLM branch (``WeightTransfer`` -> ``VllmLink``: vLLM's ``trainer_init`` + ``send_weights``,
  a gloo backend registered through its factory) syncs our engine twice, in the peer venv, and falls back per
  engine when one does not answer.
- Outside the supported versions (or without vLLM) the trainer says so in one line and uses storage."""

import ast
import json
import logging
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from schemas.weight_transfer import checksum_key, tensor_sha256
from trainer.sync import vllm_api
from trainer.sync.broadcast import WeightTransfer
from trainer.sync.storage import VllmEngine, WeightSyncError

ROOT = Path(__file__).parents[2]
PRODUCT = ["trainer", "engine", "gateway", "polarstream", "infra", "streams", "producers", "schemas"]


def vllm_uses() -> dict[str, set[str]]:
    """module -> the attribute paths our product code imports from it or calls on what it imported (AST)."""
    uses: dict[str, set[str]] = {}
    for pkg in PRODUCT:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            imported: dict[str, tuple[str, str]] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                    for a in node.names:
                        uses.setdefault(node.module, set()).add(a.name)
                        imported[a.asname or a.name] = (node.module, a.name)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
                    module, name = imported[node.value.id]
                    if name[0].isupper():  # a class's attribute (a method, a field); instances are checked by use
                        uses[module].add(f"{name}.{node.attr}")
    return uses


CHECK = """
import dataclasses, importlib, inspect, json, sys
import vllm
from packaging.specifiers import SpecifierSet
spec = json.loads(sys.stdin.read())
missing = []
for module, attrs in spec["uses"].items():
    for attr in attrs:
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            missing.append(f"{module}:{attr}: {e}")
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
F.trainer_init  # bound classmethod: the call we make must bind
inspect.signature(F.trainer_init).bind(object(), client=None, source=None)
inspect.signature(HTTPVLLMWeightSyncClient).bind("http://x", timeout=1.0)
fields = {f.name for f in dataclasses.fields(NCCLTrainerInitInfo)}
print(json.dumps({"version": vllm.__version__, "supported": vllm.__version__ in SpecifierSet(spec["supported"]),
                  "missing": missing, "init_fields": sorted(fields)}))
"""


def test_no_vllm_symbol_we_use_is_missing_from_the_pinned_wheel(vllm_python):
    uses = vllm_uses()
    assert "vllm.distributed.weight_transfer.factory" in uses  # the scan sees the trainer's imports
    for module, attrs in uses.items():  # every import and class attribute the code uses is in the kept list
        assert attrs <= {p for a in vllm_api.USED.get(module, []) for p in (a, a.split(".")[0])}, (module, attrs)
    proc = subprocess.run([str(vllm_python), "-c", CHECK], input=json.dumps({
        "uses": {m: sorted(a | set(vllm_api.USED.get(m, []))) for m, a in uses.items()},
        "supported": vllm_api.VLLM_SUPPORTED}), capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["missing"] == [], out["missing"]
    assert out["supported"], f"the peer has vLLM {out['version']}, outside VLLM_SUPPORTED {vllm_api.VLLM_SUPPORTED}"
    # the fields VllmLink.form fills
    assert {"master_address", "master_port", "world_size", "packed", "packed_buffer_size_bytes",
            "packed_num_buffers", "rank"} <= set(out["init_fields"])


def test_our_trainer_syncs_our_engine_through_vllms_trainer_api(vllm_python, engine_server, tiny_model_dir, tmp_path):
    url = engine_server.url
    proc = subprocess.run([str(vllm_python), str(ROOT / "tests/trainer/vllm_sync.py"), url, str(tiny_model_dir),
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, dead = json.loads((tmp_path / "reports.json").read_text())
    for r in (first, second):
        assert r == {"broadcast": [url], "storage": [], "stale": [], "errors": {}}
    assert dead["stale"] == ["http://127.0.0.1:9"] and "no engine took policy version 9" in dead["error"]
    info = httpx.get(f"{url}/weight_info").json()
    assert info["policy_version"] == 8 and info["transfer"]["groups_formed"] == 1 and info["transfer"]["updates"] == 2
    sent = load_file(str(tmp_path / "sent.safetensors"))
    baseline = {checksum_key(n): tensor_sha256(t) for n, t in sent.items()}
    r = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=60).json()
    assert r == {"match": True, "mismatches": []}


def test_outside_the_supported_versions_one_line_then_storage(monkeypatch, caplog):
    monkeypatch.setattr(vllm_api.importlib.metadata, "version", lambda name: "0.27.2")
    assert vllm_api.unsupported() == "vLLM 0.27.2 is installed; the in-memory sync supports vllm>=0.28,<0.34"
    for inside in ("0.28.0", "0.33.0", "0.33.1.post1", "0.30.0+cu130"):
        monkeypatch.setattr(vllm_api.importlib.metadata, "version", lambda name, v=inside: v)
        assert vllm_api.unsupported() is None, inside
    monkeypatch.setattr(vllm_api.importlib.metadata, "version", lambda name: "0.34.0rc1")
    assert "0.34.0rc1 is installed" in vllm_api.unsupported()
    monkeypatch.setattr(vllm_api.importlib.metadata, "version", lambda name: "0.34.0")
    wt = WeightTransfer([VllmEngine("http://127.0.0.1:9")], "broadcast", timeout_s=2)
    with caplog.at_level(logging.WARNING, logger="trainer.sync.broadcast"):
        assert not wt.prepare([])  # nothing to send: the vLLM engine goes by storage
        assert not wt.prepare([])
    lines = [r.getMessage() for r in caplog.records if "vLLM" in r.getMessage()]
    assert lines == ["vLLM engines load weights from storage: vLLM 0.34.0 is installed; the in-memory sync "
                     "supports vllm>=0.28,<0.34"]  # once, one line, no traceback
    assert not any(r.exc_info for r in caplog.records)
    with pytest.raises(WeightSyncError, match="no checkpoint URL"):
        wt.finish(None, 1)
