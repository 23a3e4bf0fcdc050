"""One process of bench/trainer.py's FSDP2 comparison: ``python bench/_fsdp_worker.py MODEL STEPS`` (one
plain model) or ``torchrun --nproc-per-node 2 bench/_fsdp_worker.py MODEL STEPS`` (FSDP2). Takes STEPS
optimizer steps over the same samples and prints, from rank 0, one JSON line: the median step time,
each rank's parameter + gradient + AdamW-state bytes (measured after the last backward, before the
update clears the gradients) and each rank's peak RSS.
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
    from trainer.loss import LossConfig
    from trainer.optim import param_groups, skip_update_reason
    from trainer.packing import pack, shard
    from trainer.parallel import build_model, clip_grad_norm_, place, state_bytes
    from trainer.step import accumulate_gradients

    placement = place("auto")
    model = build_model(model_dir, placement, torch.float32, "auto")
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-6)
    batch = samples(8, 256, model.config.vocab_size)
    mine = shard(pack(batch, 1024), placement.world, placement.rank)
    times, held = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        accumulate_gradients(model, mine, LossConfig(), 1.0, None, placement.device)
        norm = clip_grad_norm_(model.parameters(), 1.0)
        held = state_bytes(model, optimizer)  # gradients still here; AdamW's moments from the steps before
        if skip_update_reason(batch, norm) is None:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
