"""Checkpoints through fsspec: any URL (file://, s3://), HF layout, manifest last.

A checkpoint directory ``<root>/step-00000012/`` holds what an engine needs to load it directly
(``config.json``, safetensors shards with ``model.safetensors.index.json``, tokenizer files copied from
the starting model: export.py) plus what a restart needs: ``train_state/`` (model and AdamW moments as
a DCP checkpoint each rank writes its shards of, readable at any world size: train_state.py),
``trainer_state.json`` with the consumed Kafka offsets, and ``train_config.json``. ``manifest.json`` is
written last, after every rank has written its files, and lists every file with its size: a directory
without a manifest, or whose files do not match it, is not a checkpoint (a crash of any rank mid-write
leaves exactly that). Weight-only exports for engines (``<root>/weights/v00000012/``) use the same
layout without the train state. Checkpoints of older versions (``model.safetensors`` and
``optimizer.pt``) still resume in one process. ``<root>/engine_version.json`` records the version
the engines last loaded.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.settings import Settings
from infra.storage import filesystem, write_bytes

from . import train_state
from .export import NOT_COPIED, WEIGHT_SUFFIXES, export_hf, is_export_file

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
CONFIG = "train_config.json"
ENGINE_VERSION = "engine_version.json"  # <root>/engine_version.json: the version the engines last loaded
OPTIMIZER_LEGACY = OPTIMIZER  # checkpoints before sharded train state: optimizer.pt beside model.safetensors


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


def adapters_dir(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/adapters/v{version:08d}"


def save_checkpoint(
    root: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any] | None,
    config: dict[str, Any] | None,
    model_dir: str | Path,
    settings: Settings,
    adapter: dict[str, Any] | None = None,
) -> str:
    """Write a full checkpoint for ``step`` under ``root``; returns its URL once the manifest is in. Every
    rank calls it (each writes its shards); ``state`` and ``config`` are rank 0's. ``adapter``: a LoRA
    run's adapter_config.json content; the checkpoint then holds the adapter in PEFT's layout instead of
    the weights, and its train state the adapter and its AdamW moments (the base is ``model_dir``'s)."""
    url = step_dir(root, step)
    _start(url, settings)
    files = _write_adapter(url, model, adapter, settings) if adapter else export_hf(model, url, model_dir, settings)
    train_state.save(f"{url}/{train_state.DIR}", model, optimizer, settings)
    if _rank() == 0:
        files.update(_listed(url, train_state.DIR, settings))
        for name, body in ((STATE, json.dumps(state, sort_keys=True)),
                           (CONFIG, json.dumps(config, sort_keys=True, default=str, indent=1))):
            write_bytes(f"{url}/{name}", body.encode(), settings)
            files[name] = len(body.encode())
        _finish(url, files, settings, {"kind": "checkpoint", "step": step, **_summary(state)})
    _barrier()
    return url


def export_weights(
    url: str, model: torch.nn.Module, model_dir: str | Path, settings: Settings, meta: dict[str, Any]
) -> str:
    """Write only what an engine loads (HF layout, sharded) to ``url``; returns ``url``. Every rank calls it."""
    return _export(url, "weights", lambda: export_hf(model, url, model_dir, settings), settings, meta)


def export_adapter(url: str, model: torch.nn.Module, adapter: dict[str, Any], settings: Settings,
                   meta: dict[str, Any]) -> str:
    """Write a LoRA model's adapter in PEFT's layout to ``url``, manifest last; returns ``url``. Every rank
    calls it (the adapter is gathered: a collective); rank 0 writes."""
    return _export(url, "adapter", lambda: _write_adapter(url, model, adapter, settings), settings, meta)


def _export(url: str, kind: str, write: Callable[[], dict[str, int]], settings: Settings, meta: dict[str, Any]) -> str:
    """An export of either kind: ``write()`` (every rank) returns the files rank 0 wrote, whose manifest, last,
    makes the export complete."""
    _start(url, settings)
    files = write()
    if _rank() == 0:
        _finish(url, files, settings, {"kind": kind, **meta})
    _barrier()
    return url


def _write_adapter(url: str, model: torch.nn.Module, adapter: dict[str, Any], settings: Settings) -> dict[str, int]:
    from .lora import adapter_state_dict, write_adapter

    state = adapter_state_dict(model)  # every rank: a gather per tensor under FSDP2
    return write_adapter(url, state, adapter, settings) if _rank() == 0 else {}


# safetensors' dtype codes (its format spec), for the exports written from broadcast buffers
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _packed_plan(meta: list[tuple[str, torch.dtype, list[int]]]) -> tuple[list[list[str]], bytes]:
    """The shard files of an export of ``meta``'s tensors (one process writes them all) and its index."""
    from .export import shard_name, shard_plan

    sizes = {n: _numel(s) * d.itemsize for n, d, s in meta}
    plan = shard_plan(sizes, 1)
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {n: shard_name(i, len(plan)) for i, names in enumerate(plan) for n in names}}
    return plan, json.dumps(index, indent=2, sort_keys=True).encode()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def begin_export(url: str, meta: list[tuple[str, torch.dtype, list[int]]], settings: Settings) -> None:
    """rank 0, before a version whose export is written in the background is published: the export's
    directory exists from now on with its index (so ``newest_export`` counts the version even if the
    trainer dies before the export lands), without a manifest (incomplete until ``write_packed_export``)."""
    from .export import INDEX

    fs, path = filesystem(url, settings)
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")
    write_bytes(f"{url.rstrip('/')}/{INDEX}", _packed_plan(meta)[1], settings)


def write_packed_export(url: str, packed: list, model: torch.nn.Module, model_dir: str | Path, settings: Settings,
                        meta: dict[str, Any]) -> str:
    """The weights-only export at ``url`` (the layout ``export_weights`` writes) from a broadcast's packed
    buffers (trainer/sync/broadcast.py ``Packed``: each the bytes of its tensors back to back), by one process
    and without a collective, so rank 0 can write it in a thread while training goes on. The safetensors
    files are written straight from the buffers (header, then the bytes: no copy). Manifest last."""
    import struct

    from .export import INDEX, shard_name, upload_rest

    views: dict[str, tuple[torch.Tensor, torch.dtype, list[int]]] = {}
    order: list[tuple[str, torch.dtype, list[int]]] = []
    for pk in packed:
        offset = 0
        for name, dtype, shape in pk.meta:
            n = _numel(shape) * dtype.itemsize
            views[name] = (pk.buf[offset:offset + n], dtype, list(shape))
            order.append((name, dtype, list(shape)))
            offset += n
        if offset != pk.buf.numel():
            raise CheckpointError(f"{url}: a packed buffer holds {pk.buf.numel()} bytes, its tensors {offset}")
    plan, index = _packed_plan(order)
    fs, path = filesystem(url, settings)
    written: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="polar-export-") as tmp:
        staging = Path(tmp)
        fs.makedirs(path, exist_ok=True)
        for i, names in enumerate(plan):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                data, dtype, shape = views[name]
                if dtype not in _ST_DTYPES:
                    raise CheckpointError(f"{url}: {name}: dtype {dtype} has no safetensors code")
                header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + data.numel()]}
                offset += data.numel()
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            local = staging / shard_name(i, len(plan))
            with open(local, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for name in names:
                    f.write(memoryview(views[name][0].numpy()))
            fs.put_file(str(local), f"{path}/{local.name}")
            written[local.name] = local.stat().st_size
            local.unlink()
        (staging / INDEX).write_bytes(index)
        written.update(upload_rest(staging, model, model_dir, fs, path))
    _finish(url, written, settings, {"kind": "weights", **meta})
    return url


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _summary(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("policy_version",) if k in state}


def _start(url: str, settings: Settings) -> None:
    """A directory about to be (re)written must look incomplete before any rank writes into it."""
    if _rank() == 0:
        fs, path = filesystem(url, settings)
        if fs.exists(f"{path}/{MANIFEST}"):  # never true for the trainer
            fs.rm_file(f"{path}/{MANIFEST}")
    _barrier()


def _listed(url: str, sub: str, settings: Settings) -> dict[str, int]:
    """{``sub``/name: bytes} of the files under ``url``/``sub`` (what the ranks wrote there)."""
    fs, path = filesystem(f"{url}/{sub}", settings)
    fs.invalidate_cache()
    return {f"{sub}/{e['name'].rstrip('/').rsplit('/', 1)[-1]}": e["size"] for e in fs.ls(path, detail=True)
            if e.get("type") != "directory"}


def _finish(url: str, files: dict[str, int], settings: Settings, meta: dict[str, Any]) -> None:
    """The manifest, last: from now on the directory is complete."""
    manifest = json.dumps({"format": "polarstream-checkpoint/2", "files": dict(sorted(files.items())),
                           "created_at": time.time(), **meta})
    try:
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
    newest = 0
    for kind in ("weights", "adapters"):  # a LoRA run exports adapters
        fs, path = filesystem(f"{root.rstrip('/')}/{kind}", settings)
        fs.invalidate_cache()
        if not fs.exists(path):
            continue
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False))
        newest = max(newest, max((int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit()), default=0))
    return newest


def _read_manifest(fs, dir_path: str) -> dict[str, Any] | None:
    """The manifest if the directory is complete: manifest present, every file there at its size."""
    try:
        manifest = json.loads(fs.cat_file(f"{dir_path}/{MANIFEST}"))
        listed = manifest.get("files", {})
        sizes = {}
        for sub in {"", *(n.rsplit("/", 1)[0] for n in listed if "/" in n)}:
            where = f"{dir_path}/{sub}" if sub else dir_path
            prefix = f"{sub}/" if sub else ""
            sizes.update({prefix + e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"] for e in fs.ls(where, detail=True)})
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if any(sizes.get(name) != size for name, size in listed.items()):
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
        if name.startswith(f"{train_state.DIR}/"):  # the trainer reads its state from the URL, not a copy
            continue
        fs.get_file(f"{path}/{name}", str(local / name))
    return local


def has_train_state(info: CheckpointInfo) -> bool:
    """The checkpoint holds a sharded train state (model and AdamW moments): it fills a model by itself."""
    return any(n.startswith(f"{train_state.DIR}/") for n in info.manifest.get("files", {}))


def load_train_state(info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     settings: Settings) -> None:
    """Fill a freshly built ``model`` and ``optimizer`` (any world size) from a checkpoint's train state.
    A checkpoint of an older version (model.safetensors and optimizer.pt) loads in one process."""
    if has_train_state(info):
        train_state.load(f"{info.url.rstrip('/')}/{train_state.DIR}", model, optimizer, settings)
        return
    if dist.is_initialized():
        raise CheckpointError(f"{info.url}: a checkpoint without train_state/ (an older version) resumes in one "
                              "process only; resume it once without torchrun, then continue sharded")
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="polar-resume-") as tmp:
        local = download(info.url, tmp, settings)
        model.load_state_dict(load_file(local / "model.safetensors"), strict=False)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        data = (local / OPTIMIZER_LEGACY).read_bytes()
        optimizer.load_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))


def prune(root: str, keep: int, settings: Settings) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints and weight exports; returns deleted URLs.

    The manifest goes first, so a prune interrupted halfway leaves an incomplete (ignored) directory,
    never a checkpoint that looks complete but is not.
    """
    fs, path = filesystem(root, settings)
    fs.invalidate_cache()
    deleted = []
    for parent, prefix in ((path, "step-"), (f"{path}/weights", "v"), (f"{path}/adapters", "v")):
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


def export_model(url: str, out: str, settings: Settings, merge: bool = False, base: str | None = None) -> dict:
    """``polarstream export --checkpoint URL``: the model of a checkpoint (``url``: a checkpoint directory, or a
    root whose newest complete checkpoint is taken) to ``out`` (a directory or URL). A LoRA run's checkpoint
    gives its adapter in PEFT's layout, or with ``merge`` the base with the adapter folded in, in HF layout
    (peft's merge_and_unload; the base is ``base`` or the adapter's base_model_name_or_path); a full-weight
    checkpoint its HF directory. Returns {"checkpoint", "out", "kind", "files"}; CheckpointError in one line."""
    from . import lora

    fs, path = filesystem(url, settings)
    if not fs.exists(f"{path}/{MANIFEST}"):
        info = latest(url, settings)
        if info is None:
            raise CheckpointError(f"{url}: neither a complete checkpoint nor a root holding one")
        url = info.url
    out_fs, out_path = filesystem(out, settings)
    with tempfile.TemporaryDirectory(prefix="polar-export-model-") as tmp:
        local = download(url, Path(tmp) / "ckpt", settings)
        adapter = (local / lora.WEIGHTS_FILE).is_file()
        if merge and not adapter:
            raise CheckpointError(f"{url}: --merge: a full-weight checkpoint has no adapter to merge")
        if merge:
            base_dir = base or json.loads((local / lora.CONFIG_FILE).read_text())["base_model_name_or_path"]
            if not (Path(base_dir) / "config.json").is_file():
                raise CheckpointError(f"--merge: base model {base_dir!r} is not a local model directory "
                                                 "(give --base DIR)")
            staging = Path(tmp) / "merged"
            lora.merge(base_dir, local).save_pretrained(staging)
            for f in Path(base_dir).iterdir():  # the tokenizer and chat template, as every export carries them
                if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_SUFFIXES) \
                        and not (staging / f.name).exists():
                    shutil.copy2(f, staging / f.name)
            kind = "merged"
        else:
            staging, kind = local, "adapter" if adapter else "weights"
        keep = (lambda n: n in (lora.CONFIG_FILE, lora.WEIGHTS_FILE)) if kind == "adapter" else \
            (lambda n: is_export_file(n) and n not in (STATE, CONFIG))
        out_fs.makedirs(out_path, exist_ok=True)
        files = {}
        for f in sorted(staging.iterdir()):
            if f.is_file() and keep(f.name):
                out_fs.put_file(str(f), f"{out_path}/{f.name}")
                files[f.name] = f.stat().st_size
    return {"checkpoint": url, "out": out, "kind": kind, "files": files}
