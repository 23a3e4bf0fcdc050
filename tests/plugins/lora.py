"""LoRA fixtures: adapters made with peft itself on the tiny model, saved in PEFT's layout.

- ``peft_adapters`` (session): ``{"a": (dir, peft model), "b": (dir, peft model), None: (None, base model)}``;
  ``a`` is r=4 on q/v/down, ``b`` r=2 rsLoRA on k/o/gate/up, both with random nonzero ``lora_B`` (peft
  starts B at zero, which would leave outputs unchanged). The models are the references to compare
  engine logprobs against (``lora_logprobs``).
"""

from __future__ import annotations

import pytest


def make_adapter(model_dir, out_dir, seed: int, **lora):
    """A peft LoRA model on ``model_dir`` with random nonzero lora_B, saved to ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return model


def lora_logprobs(model, prompt_ids: list[int], ids: list[int]):
    """Log-softmax at temperature 1 of ``model`` at each of ``ids`` after ``prompt_ids``."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1: -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


@pytest.fixture(scope="session")
def peft_adapters(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("loras")
    a = make_adapter(tiny_model_dir, d / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    b = make_adapter(tiny_model_dir, d / "b", 2, r=2, lora_alpha=4, use_rslora=True,
                     target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return {"a": (d / "a", a), "b": (d / "b", b), None: (None, base)}
