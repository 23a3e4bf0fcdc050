"""The trained weights as an HF directory that engines load: safetensors shards with
``model.safetensors.index.json``, the config and the starting model's tokenizer files.

Under FSDP2 no process ever holds the whole model: the tensors are gathered one at a time (every rank
joins each gather, ``full_tensor``) and only the rank that owns a tensor's shard file keeps it, until
its file is written and uploaded. Shard files are balanced by bytes and dealt round-robin over the
ranks. Rank 0 writes the index and config last; the caller's manifest, written after them, is what
makes the directory visible (checkpoint.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from infra.settings import Settings
from infra.storage import filesystem

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024**3  # at most this much per shard file (vLLM and transformers take any size)
# Files a starting model directory must not carry into an export: its weights and what is rewritten.
NOT_COPIED = {"config.json", "generation_config.json", INDEX, "pytorch_model.bin.index.json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def shard_plan(sizes: dict[str, int], world: int, max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names (in state-dict order) split into consecutive shard files: at least one file per rank
    when there are enough tensors (every rank writes), none above ``max_bytes`` unless one tensor is."""
    total = sum(sizes.values())
    files = max(min(world, len(sizes)), -(-total // max_bytes), 1)
    target = total / files
    plan: list[list[str]] = [[]]
    done = current = 0
    for name, size in sizes.items():
        past_target = len(plan) < files and done + size / 2 > target * len(plan)
        if plan[-1] and (past_target or current + size > max_bytes):
            plan.append([])
            current = 0
        plan[-1].append(name)
        done += size
        current += size
    return plan


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def exported_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict an HF directory holds: canonical names, a tied head left out (its embedding is it)."""
    state = model.state_dict()
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k.replace("_checkpoint_wrapped_module.", "").removeprefix("module."): v for k, v in state.items()}


def upload_rest(staging: Path, model, model_dir: str | Path, fs, path: str) -> dict[str, int]:
    """Everything of an export but its weight shards: the config, the generation config and the base
    model's other files (tokenizer, chat template...: engines load the directory as is), written into
    ``staging`` beside what is there and uploaded with it to ``path``; the bytes of each file put."""
    model.config.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not (staging / f.name).exists():
            shutil.copy2(f, staging / f.name)
    written = {}
    for f in sorted(staging.iterdir()):
        if f.is_file() and is_export_file(f.name):
            fs.put_file(str(f), f"{path}/{f.name}")
            written[f.name] = f.stat().st_size
    return written


def export_hf(model: torch.nn.Module, url: str, model_dir: str | Path, settings: Settings) -> dict[str, int]:
    """Write ``model`` to ``url`` as sharded safetensors + index + config + the tokenizer files of
    ``model_dir``; every rank calls it. Returns {file name: bytes} of every file written (on every rank)."""
    from safetensors.torch import save_file

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tensors = exported_tensors(model)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    plan = shard_plan(sizes, world)
    fs, path = filesystem(url, settings)
    written: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="polar-export-") as tmp:
        staging = Path(tmp)
        for i, names in enumerate(plan):
            owner = i % world
            mine: dict[str, torch.Tensor] = {}
            for name in names:
                t = tensors[name]
                full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective under FSDP2
                if rank == owner:
                    mine[name] = full.detach().to("cpu").contiguous()
                del full
            if rank == owner:
                local = staging / shard_name(i, len(plan))
                save_file(mine, str(local), metadata={"format": "pt"})
                fs.makedirs(path, exist_ok=True)
                fs.put_file(str(local), f"{path}/{local.name}")
                written[local.name] = local.stat().st_size
                local.unlink()
        if rank == 0:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {n: shard_name(i, len(plan)) for i, names in enumerate(plan) for n in names}}
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
            written.update(upload_rest(staging, model, model_dir, fs, path))
    if dist.is_initialized():
        everyone: list[dict[str, int] | None] = [None] * world
        dist.all_gather_object(everyone, written)
        written = {k: v for part in everyone for k, v in (part or {}).items()}
    return written


def is_export_file(name: str) -> bool:
    """The staging files an export uploads (not the trainer's own, which checkpoint.py writes)."""
    return name not in {"manifest.json", "trainer_state.json", "train_config.json", "optimizer.pt"}
