"""Train steps, save the train state (DCP) to a URL, and go on; or load it and go on, at another world
size. ``torchrun --nproc-per-node 2 tests/trainer/fsdp_resume.py MODEL URL save|resume OUT`` (or plain
python: one process). Rank 0 writes the loss of every step it took to OUT, as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))  # torchrun runs this file as a script

from tests.trainer.fsdp_step import LOSS, micro_batches, samples  # noqa: E402

LR = 1e-3


def steps(model, optimizer, vocab: int, placement, seeds: list[int]) -> list[float]:
    """One optimizer step per seed's samples; each step's loss (summed over ranks), before its update."""
    import torch.distributed as dist

    from trainer.optim import apply_update
    from trainer.step import accumulate_gradients

    losses = []
    for seed in seeds:
        every = samples("per_request", "token_mean", vocab, seed)
        sums = accumulate_gradients(model, micro_batches(every, placement.world, placement.rank), LOSS, 1.0, None,
                                    placement.device)
        loss = torch.tensor([sums["loss"]], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
        apply_update(model, optimizer, every, 1.0)
        losses.append(float(loss))
    return losses


def main(model_dir: str, url: str, mode: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from infra.settings import Settings
    from trainer import train_state
    from trainer.optim import param_groups
    from trainer.parallel import build_model, place

    placement = place("auto", timeout_s=120)
    settings = Settings()
    model = build_model(model_dir, placement, torch.float32, "auto")
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=LR)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if mode == "save":  # step 0, save, then steps 1 and 2: the uninterrupted run
        losses = steps(model, optimizer, vocab, placement, [0])
        train_state.save(url, model, optimizer, settings)
        losses += steps(model, optimizer, vocab, placement, [1, 2])
    else:  # the state after step 0, then steps 1 and 2
        train_state.load(url, model, optimizer, settings)
        losses = steps(model, optimizer, vocab, placement, [1, 2])
    if placement.master:
        Path(out).write_text(json.dumps({"losses": losses, "world": placement.world, "strategy": placement.strategy}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
