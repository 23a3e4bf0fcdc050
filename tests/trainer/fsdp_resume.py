"""Train steps from the newest complete checkpoint under ROOT (or from the model), saving a checkpoint
on the way, as the trainer does: ``torchrun --nproc-per-node 2 tests/trainer/fsdp_resume.py MODEL ROOT
OUT UNTIL SAVE_AT [KILL_RANK]`` (or plain python: one process).

Step ``s`` trains on the samples of seed ``s``; a run resumed from checkpoint ``step-N`` (the state after
N steps) starts at step N and runs to UNTIL, writing a checkpoint (checkpoint.save_checkpoint: HF export,
DCP train state, manifest last) before step SAVE_AT (SAVE_AT == UNTIL: after the last). Rank 0 writes
``{"start", "world", "strategy", "losses": {step: loss}}`` to OUT after every step. KILL_RANK: that rank
SIGKILLs itself in the middle of the save, just after its train-state shard is on storage.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))  # torchrun runs this file as a script

from tests.trainer.fsdp_step import CFG, samples  # noqa: E402

LR = 1e-3


def one_step(model, optimizer, vocab: int, placement, seed: int) -> float:
    """One optimizer step (the trainer's: step.train_step) on seed's samples; its loss (summed over
    ranks), before the update."""
    from dataclasses import replace

    from trainer.step import train_step

    every = samples("per_request", "token_mean", vocab, seed)
    # reward 0: no saturation scaling (the samples carry advantages only)
    return train_step(model, optimizer, every, replace(CFG, lr=LR), reward_mean=0.0, placement=placement).sums["loss"]


def die_after_own_shard() -> None:
    """This rank dies (SIGKILL) as soon as its DCP shard is written, before the save completes."""
    from trainer import train_state

    make = train_state._io

    def io(url, settings, write):
        writer = make(url, settings, write)
        if write:
            write_data = writer.write_data

            def written_then_killed(plan, planner):
                write_data(plan, planner).wait()
                os.kill(os.getpid(), signal.SIGKILL)

            writer.write_data = written_then_killed
        return writer

    train_state._io = io


def main(model_dir: str, root: str, out: str, until: str, save_at: str, kill_rank: str = "") -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from infra.settings import Settings
    from trainer import checkpoint
    from trainer.optim import param_groups
    from trainer.parallel import build_model, place

    placement = place("auto", timeout_s=120)
    settings = Settings()
    info = checkpoint.latest(root, settings)
    start = info.step if info else 0
    model = build_model(model_dir, placement, torch.float32, "auto", weights=info is None)
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=LR)
    if info is not None:
        checkpoint.load_train_state(info, model, optimizer, settings)
    if kill_rank and placement.rank == int(kill_rank):
        die_after_own_shard()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    losses: dict[int, float] = {}
    for s in range(start, int(until) + 1):
        if s == int(save_at):
            checkpoint.save_checkpoint(root, s, model, optimizer, {"step": s}, {}, model_dir, settings)
        if s == int(until):
            break
        losses[s] = one_step(model, optimizer, vocab, placement, s)
        if placement.master:
            Path(out).write_text(json.dumps({"start": start, "world": placement.world,
                                             "strategy": placement.strategy, "losses": losses}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
