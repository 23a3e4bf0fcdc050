"""LoRA: train low-rank adapters on a frozen base (``lora_rank > 0``), with peft's layers, and hand them out
in PEFT's own layout (``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM and ``peft`` load.

peft's ``inject_adapter_in_model`` swaps each target ``nn.Linear`` for a ``lora.Linear`` (the original kept as
``base_layer``) in place, so the trainer's model stays the transformers model it was: our ``polar_varlen``
attention, the loss's hook on ``model.base_model`` and FSDP2's per-decoder-layer sharding see the same modules
(the adapter's A and B are parameters of the decoder layer that holds them, sharded with it). The
``PeftModel`` wrapper is not used: it would put itself at ``model.base_model``.

The adapter's initial values come from ``init_adapter`` (seeded, computed whole and sliced per rank), so one
process and every FSDP2 world size start from the same adapter: B = 0 (the model starts as the base),
A as peft initializes it (kaiming uniform, a = sqrt(5)).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name inside the model; PEFT's saved keys leave it out
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's saved keys: the PeftModel -> LoraModel -> transformers model path
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def enabled(cfg) -> bool:
    """The run trains an adapter (``TrainConfig.lora_rank > 0``)."""
    return getattr(cfg, "lora_rank", 0) > 0


def targets(cfg) -> list[str]:
    return list(cfg.lora_target_modules or DEFAULT_TARGETS)


def lora_config(cfg):
    """peft's ``LoraConfig`` of ``cfg``'s lora_* settings."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets(cfg), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Inject ``cfg``'s LoRA layers into ``model`` in place (before FSDP2 shards it, on any device, meta
    included) and freeze everything else; returns ``model``. ValueError when no target module matches."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER)
    except ValueError as e:  # peft's message names the targets it did not find
        raise ValueError(f"lora_target_modules={targets(cfg)}: {str(e).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    return model


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_lora_model(model: torch.nn.Module) -> bool:
    return any(is_adapter_param(n) for n, _ in model.named_parameters())


def adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter tensor, in the model's order (the same on every rank)."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]


def init_adapter(model: torch.nn.Module, seed: int) -> None:
    """Set every adapter tensor to its initial value, the same whatever the world size: A kaiming uniform
    (a = sqrt(5), peft's default), B zero, drawn whole from a generator seeded with ``seed`` in the
    model's parameter order; an FSDP2 rank keeps its own slice (no collective)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_params(model):
            full = torch.empty(p.shape, dtype=torch.float32)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
            else:
                full.zero_()
            if hasattr(p, "to_local"):  # a DTensor shard: this rank's slice of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)


def peft_key(name: str) -> str:
    """The trainer's parameter name -> PEFT's saved key (``get_peft_model_state_dict``'s): the PeftModel
    prefix added, the adapter name dropped, wrapper names removed."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it: {PEFT key: whole tensor on CPU}. Under FSDP2 every rank must call it
    (each tensor is gathered: a collective) and every rank gets the whole adapter."""
    out = {}
    for name, p in adapter_params(model):
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[peft_key(name)] = t.to("cpu").contiguous().clone()
    return out


def adapter_meta(model: torch.nn.Module) -> list[tuple[str, torch.dtype, list[int]]]:
    """(PEFT key, dtype, whole shape) of every adapter tensor, in ``adapter_tensors``' order, gathering nothing:
    what the in-memory weight transfer announces (``trainer/sync/broadcast.py``)."""
    return [(peft_key(n), p.dtype, list(p.shape)) for n, p in adapter_params(model)]


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, whole tensor) of every adapter tensor, one at a time; under FSDP2 each is gathered on every
    rank (a collective: every rank must iterate all of them)."""
    for name, p in adapter_params(model):
        t = p.detach()
        yield peft_key(name), (t.full_tensor() if hasattr(t, "full_tensor") else t)


def adapter_config(cfg, base_model_path: str | Path) -> dict[str, Any]:
    """The content of PEFT's ``adapter_config.json`` for ``cfg``'s adapter on ``base_model_path``."""
    config = lora_config(cfg)
    config.base_model_name_or_path = str(base_model_path)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    data = config.to_dict()
    return json.loads(json.dumps(data, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def write_adapter(url: str | Path, state: dict[str, torch.Tensor], config: dict[str, Any],
                  settings=None) -> dict[str, int]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` to a local directory or a URL
    (``file://``, ``s3://``: the fsspec path of the trainer's exports); returns {file name: bytes}."""
    from safetensors.torch import save_file

    from infra.settings import Settings
    from infra.storage import filesystem

    fs, path = filesystem(str(url), settings or Settings())
    fs.makedirs(path, exist_ok=True)
    written = {}
    with tempfile.TemporaryDirectory(prefix="polar-adapter-") as tmp:
        weights = Path(tmp) / WEIGHTS_FILE
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights), metadata={"format": "pt"})
        (Path(tmp) / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        for f in (weights, Path(tmp) / CONFIG_FILE):
            fs.put_file(str(f), f"{path}/{f.name}")
            written[f.name] = f.stat().st_size
    return written


def adapter_name(model_name: str, version: int) -> str:
    """The engines' name of a policy version's adapter (a request selects it by ``model``)."""
    if not re.fullmatch(r"[A-Za-z0-9._:-]+", model_name):
        raise ValueError(f"model_name {model_name!r}: an adapter name takes letters, digits and . _ : - only")
    return f"{model_name}-v{version}"


def merge(base_dir: str | Path, adapter_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The base model with the adapter folded into its weights (peft's ``merge_and_unload``): a plain
    transformers model that ``save_pretrained`` writes in HF layout."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
