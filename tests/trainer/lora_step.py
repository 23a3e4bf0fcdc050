"""Two LoRA steps, on one process or on each rank of a torchrun (FSDP2, gloo), then a checkpoint: the LoRA
tests compare the two and resume from the checkpoint. ``torchrun --nproc-per-node 2 tests/trainer/lora_step.py
MODEL OUT``; rank 0 writes the first step's adapter gradients, the adapter after both steps and the
checkpoint's URL to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))  # torchrun runs this file as a script

from trainer.config import TrainConfig  # noqa: E402

CFG = TrainConfig(lora_rank=4, lora_alpha=8, token_budget=64, lr=1e-3, weight_decay=0.0, tis_cap=2.0,
                  lr_saturation=1.0)


def run(model_dir: str, out: str, placement=None) -> dict:
    """Both steps on ``placement`` (default: one plain process); the results on every rank."""
    from transformers import AutoConfig

    from infra.settings import Settings
    from tests.trainer.fsdp_step import micro_batches, samples
    from trainer import checkpoint, lora
    from trainer.optim import build_optimizer
    from trainer.parallel import Placement, build_model, clip_grad_norm_
    from trainer.step import accumulate_gradients, loss_config, train_step

    placement = placement or Placement()
    model = build_model(model_dir, placement, torch.float32, "auto", lora=CFG)
    optimizer = build_optimizer(model, CFG)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    every = samples("per_request", "token_mean", vocab)
    accumulate_gradients(model, micro_batches(every, placement.world, placement.rank), loss_config(CFG), 1.0, None,
                         placement.device)
    norm = clip_grad_norm_(model.parameters(), 1e9)
    grads = {lora.peft_key(n): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in lora.adapter_params(model) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for step in range(2):
        train_step(model, optimizer, samples("prefix_merging" if step else "per_request", "token_mean", vocab), CFG,
                   reward_mean=0.0, step=step, placement=placement)
    url = checkpoint.save_checkpoint(f"file://{Path(out).parent}/ckpt-{placement.world}", 2, model, optimizer,
                                     {"step": 2, "policy_version": 2}, {}, model_dir, Settings(),
                                     lora.adapter_config(CFG, model_dir))
    return {"grads": grads, "norm": norm, "adapter": lora.adapter_state_dict(model), "checkpoint": url,
            "strategy": placement.strategy}


def main(model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.parallel import place

    placement = place("auto", timeout_s=120)
    results = run(model_dir, out, placement)
    if placement.master:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
