"""Checkpoints through fsspec: any URL (file://, s3://), HF layout, manifest last.

A checkpoint directory ``<root>/step-00000012/`` holds what an engine needs to load it directly
(``config.json``, ``model.safetensors``, tokenizer files copied from the starting model) plus what a
restart needs (``optimizer.pt``, ``trainer_state.json`` with the consumed Kafka offsets,
``train_config.json``). ``manifest.json`` is written last and lists every file with its size: a
directory without a manifest, or whose files do not match it, is not a checkpoint (a crash mid-write
leaves exactly that). Weight-only exports for engines (``<root>/weights/v00000012/``) use the same
layout without the optimizer and trainer state. ``<root>/engine_version.json`` records the version
the engines last loaded.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.settings import Settings
from infra.storage import filesystem, write_bytes

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
CONFIG = "train_config.json"
ENGINE_VERSION = "engine_version.json"  # <root>/engine_version.json: the version the engines last loaded
# Files a copied model directory must not carry into a checkpoint: weights (rewritten) and our own.
_NOT_COPIED = {MANIFEST, STATE, OPTIMIZER, CONFIG, "config.json", "generation_config.json",
               "model.safetensors.index.json", "pytorch_model.bin.index.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names its URL."""


@dataclass(frozen=True)
class CheckpointInfo:
    url: str  # directory URL, e.g. s3://polarstream/run1/step-00000012
    step: int
    manifest: dict[str, Any]


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:08d}"


def weights_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/weights/v{version:08d}"


def save_checkpoint(
    root: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    config: dict[str, Any],
    model_dir: str | Path,
    settings: Settings,
) -> str:
    """Write a full checkpoint for ``step`` under ``root``; returns its URL once the manifest is in."""
    url = step_dir(root, step)
    with tempfile.TemporaryDirectory(prefix="polar-ckpt-") as tmp:
        staging = Path(tmp)
        _stage_weights(staging, model, model_dir)
        torch.save(optimizer.state_dict(), staging / OPTIMIZER)
        (staging / STATE).write_text(json.dumps(state, sort_keys=True))
        (staging / CONFIG).write_text(json.dumps(config, sort_keys=True, default=str, indent=1))
        _upload(staging, url, settings, {"kind": "checkpoint", "step": step, **_summary(state)})
    return url


def export_weights(
    url: str, model: torch.nn.Module, model_dir: str | Path, settings: Settings, meta: dict[str, Any]
) -> str:
    """Write only what an engine loads (HF layout) to ``url``; returns ``url``."""
    with tempfile.TemporaryDirectory(prefix="polar-weights-") as tmp:
        _stage_weights(Path(tmp), model, model_dir)
        _upload(Path(tmp), url, settings, {"kind": "weights", **meta})
    return url


def _summary(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("policy_version",) if k in state}


def _stage_weights(staging: Path, model: torch.nn.Module, model_dir: str | Path) -> None:
    model = getattr(model, "module", model)  # unwrap DDP
    model.save_pretrained(staging, safe_serialization=True)
    for f in Path(model_dir).iterdir():  # tokenizer, chat template, ...: engines load the directory as is
        wanted = f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES)
        if wanted and not (staging / f.name).exists():
            shutil.copy2(f, staging / f.name)


def _upload(staging: Path, url: str, settings: Settings, meta: dict[str, Any]) -> None:
    fs, path = filesystem(url, settings)
    files = {f.name: f.stat().st_size for f in sorted(staging.iterdir()) if f.is_file()}
    try:
        fs.makedirs(path, exist_ok=True)
        if fs.exists(f"{path}/{MANIFEST}"):  # never true for the trainer; a rewrite must look incomplete
            fs.rm_file(f"{path}/{MANIFEST}")
        for name in files:
            fs.put_file(str(staging / name), f"{path}/{name}")
        manifest = json.dumps({"format": "polarstream-checkpoint/1", "files": files, "created_at": time.time(), **meta})
        write_bytes(f"{url.rstrip('/')}/{MANIFEST}", manifest.encode(), settings)  # atomic on file:// and s3://
    except OSError as e:
        raise CheckpointError(f"{url}: write failed ({e})") from e


def list_checkpoints(root: str, settings: Settings) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first; incomplete directories are skipped."""
    fs, path = filesystem(root, settings)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.startswith("step-") or not name[5:].isdigit():
            continue
        manifest = _read_manifest(fs, entry)
        if manifest is not None:
            found.append(CheckpointInfo(url=_url(fs, entry), step=int(name[5:]), manifest=manifest))
    return sorted(found, key=lambda c: c.step)


def latest(root: str, settings: Settings) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root, settings)
    return found[-1] if found else None


def write_engine_version(root: str, version: int, settings: Settings) -> None:
    """Record that the engines loaded ``version`` (after each successful sync). A checkpoint is written
    before its own step's sync, so only this tells a restarted trainer what the engines serve."""
    data = json.dumps({"version": version, "time": time.time()}).encode()
    write_bytes(f"{root.rstrip('/')}/{ENGINE_VERSION}", data, settings)


def read_engine_version(root: str, settings: Settings) -> int:
    """The version of the newest successful sync under ``root`` (0 when none was recorded)."""
    fs, path = filesystem(f"{root.rstrip('/')}/{ENGINE_VERSION}", settings)
    try:
        return int(json.loads(fs.cat_file(path))["version"])
    except FileNotFoundError:
        return 0


def newest_export(root: str, settings: Settings) -> int:
    """The highest policy version with a weights-only export under ``root`` (0 when none).

    Complete or not: every version published between checkpoints was exported first, and pruning keeps
    the newest exports, so a restarted trainer that continues above this never reuses a published version.
    """
    fs, path = filesystem(f"{root.rstrip('/')}/weights", settings)
    fs.invalidate_cache()
    if not fs.exists(path):
        return 0
    names = (e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False))
    return max((int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit()), default=0)


def _read_manifest(fs, dir_path: str) -> dict[str, Any] | None:
    """The manifest if the directory is complete: manifest present, every file there at its size."""
    try:
        manifest = json.loads(fs.cat_file(f"{dir_path}/{MANIFEST}"))
        sizes = {e["name"].rsplit("/", 1)[-1]: e["size"] for e in fs.ls(dir_path, detail=True)}
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if any(sizes.get(name) != size for name, size in manifest.get("files", {}).items()):
        return None
    return manifest


def _url(fs, path: str) -> str:
    return fs.unstrip_protocol(path)


def read_state(info: CheckpointInfo, settings: Settings) -> dict[str, Any]:
    """The trainer state (step, version, offsets, ...) of a checkpoint."""
    fs, path = filesystem(info.url, settings)
    return json.loads(fs.cat_file(f"{path}/{STATE}"))


def download(url: str, local_dir: str | Path, settings: Settings) -> Path:
    """Copy a checkpoint or weights directory to ``local_dir`` (loadable with from_pretrained)."""
    fs, path = filesystem(url, settings)
    manifest = _read_manifest(fs, path)
    if manifest is None:
        raise CheckpointError(f"{url}: not a complete checkpoint (no manifest, or files missing)")
    local = Path(local_dir)
    local.mkdir(parents=True, exist_ok=True)
    for name in [*manifest["files"], MANIFEST]:
        fs.get_file(f"{path}/{name}", str(local / name))
    return local


def load_optimizer(local_dir: str | Path, optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Restore an optimizer from a downloaded checkpoint."""
    data = (Path(local_dir) / OPTIMIZER).read_bytes()
    optimizer.load_state_dict(torch.load(io.BytesIO(data), map_location=device, weights_only=True))


def prune(root: str, keep: int, settings: Settings) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints and weight exports; returns deleted URLs.

    The manifest goes first, so a prune interrupted halfway leaves an incomplete (ignored) directory,
    never a checkpoint that looks complete but is not.
    """
    fs, path = filesystem(root, settings)
    fs.invalidate_cache()
    deleted = []
    for parent, prefix in ((path, "step-"), (f"{path}/weights", "v")):
        if not fs.exists(parent):
            continue
        entries = (e.rstrip("/") for e in fs.ls(parent, detail=False))
        dirs = sorted(e for e in entries if e.rsplit("/", 1)[-1].startswith(prefix))
        for d in dirs[:-keep] if keep else dirs:
            if fs.exists(f"{d}/{MANIFEST}"):
                fs.rm_file(f"{d}/{MANIFEST}")
            fs.rm(d, recursive=True)
            deleted.append(_url(fs, d))
    return deleted
