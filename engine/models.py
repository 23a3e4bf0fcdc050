"""Loading a model to serve: ``load_model`` takes a built-in name, a local HF directory or a hub id.

What a name means (built-in models, their cache, hub ids) and how tokenizers load is infra/models/,
shared with the gateway and the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.models import load_tokenizer, model_load_error, resolve_model


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, eval mode
    tokenizer: Any  # transformers tokenizer
    path: str  # the resolved directory or hub id
    eos_token_ids: list[int]  # the tokenizer's EOS first, then generation_config's extra ones
    max_model_len: int


def load_model(name_or_path: str, device: str = "cpu", dtype: str = "float32", cache_dir: str | Path | None = None) -> LoadedModel:
    """Load a built-in name, a local HF directory or a hub id (the hub is only reached for the last)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path, cache_dir)
    try:
        tokenizer = load_tokenizer(path, download=True)  # the hub is only reached for a hub id
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    except OSError as e:  # transformers' word for "not found here nor on the hub" (and for unreadable files)
        raise model_load_error(name_or_path, path, e) from e
    model = model.to(device).eval()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    for i in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
        if i not in eos:
            eos.append(i)
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    return LoadedModel(model=model, tokenizer=tokenizer, path=str(path), eos_token_ids=eos, max_model_len=max_len)
