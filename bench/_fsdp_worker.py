"""One process of bench/fsdp.py's FSDP2 comparison: ``python bench/_fsdp_worker.py MODEL STEPS`` (one
plain model) or ``torchrun --nproc-per-node 2 bench/_fsdp_worker.py MODEL STEPS`` (FSDP2). Takes STEPS
optimizer steps over the same samples with the trainer's step (``trainer.step.train_step``) and prints,
from rank 0, one JSON line: the median step time, each rank's parameter + gradient + AdamW-state bytes
(measured just before AdamW's last update, the gradients still held) and each rank's peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))


def main(model_dir: str, steps: int) -> None:
    import torch.distributed as dist

    from bench.gpu_check import samples
    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer
    from trainer.parallel import build_model, place, state_bytes
    from trainer.step import train_step

    placement = place("auto")
    cfg = TrainConfig(lr=1e-6, weight_decay=0.0, token_budget=1024)
    model = build_model(model_dir, placement, torch.float32, cfg.attn_implementation)
    optimizer = build_optimizer(model, cfg)
    batch = samples(8, 256, model.config.vocab_size)
    held = 0

    def measure(opt, args, kwargs) -> None:  # just before AdamW steps: the clipped gradients are still here
        nonlocal held
        held = state_bytes(model, opt)

    optimizer.register_step_pre_hook(measure)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        # synthetic samples carry no rewards: mean 0 keeps the configured rate (no saturation scaling)
        train_step(model, optimizer, batch, cfg, reward_mean=0.0, placement=placement)
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank = [(held, rss)]
    if dist.is_initialized():
        per_rank = [None] * placement.world
        dist.all_gather_object(per_rank, (held, rss))
    if placement.master:
        print(json.dumps({"strategy": placement.strategy, "world": placement.world,
                          "params": sum(p.numel() for p in model.parameters()) if placement.world == 1 else None,
                          "step_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],
                          "state_bytes_per_rank": [b for b, _ in per_rank],
                          "peak_rss_bytes_per_rank": [r for _, r in per_rank]}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
