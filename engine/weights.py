"""Weight updates from a checkpoint URL (file:// or s3://) in Hugging Face safetensors layout.

A checkpoint URL names either a ``.safetensors`` file or a directory holding ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Reading happens while the engine keeps serving; only the
in-place copy into the model runs between steps (``Batcher.swap_weights``).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors

from infra.settings import Settings
from infra.storage import filesystem


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded into the served model; the message says why."""


def read_checkpoint(url: str, settings: Settings) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at ``url``."""
    fs, path = filesystem(url, settings)
    if not fs.exists(path):
        raise WeightsError(f"no checkpoint at {url}")
    if fs.isdir(path):
        index = f"{path.rstrip('/')}/model.safetensors.index.json"
        single = f"{path.rstrip('/')}/model.safetensors"
        if fs.exists(index):
            shards = sorted(set(json.loads(fs.cat_file(index))["weight_map"].values()))
            files = [f"{path.rstrip('/')}/{s}" for s in shards]
        elif fs.exists(single):
            files = [single]
        else:
            raise WeightsError(f"{url} holds neither model.safetensors nor model.safetensors.index.json")
    elif path.endswith(".safetensors"):
        files = [path]
    else:
        raise WeightsError(f"{url} is neither a directory nor a .safetensors file")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_safetensors(fs.cat_file(f)))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightsError(f"{f}: not a readable safetensors file ({e})") from None
    return state


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose names or shapes do not fit ``model`` (before anything is changed).

    Every parameter must be present, except a tied output embedding that the checkpoint left out.
    """
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise WeightsError(f"checkpoint has {len(unknown)} tensors the model lacks, e.g. {unknown[:3]}")
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(state) - tied)
    if missing:
        raise WeightsError(f"checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise WeightsError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(own[name].shape)}")


def apply_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the model's tensors in place (dtype and device converted)."""
    own = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            own[name].copy_(t)
