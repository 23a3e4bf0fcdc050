"""One training step's gradients, on one process or on each rank of a torchrun (FSDP2, gloo): the
parity tests compare the two. Run as ``torchrun --nproc-per-node 2 tests/trainer/fsdp_step.py MODEL OUT``;
rank 0 writes each case's full gradients, norm and stat sums to OUT.

The samples are fixed by a seed: ``per_request`` traces (a prompt and one completion each) or
``prefix_merging`` ones (several calls in one sequence: completions separated by tool results that
are not trained), with their group's advantages, as packing.samples_from_group makes them.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))  # torchrun runs this file as a script

from trainer.config import TrainConfig  # noqa: E402
from trainer.packing import assign_weights, pack, sample_from_trace, shard  # noqa: E402
from trainer.step import accumulate_gradients, loss_config  # noqa: E402

# The trainer's settings for these steps (micro-batches of 64 tokens: several per rank)
CFG = TrainConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0, token_budget=64, weight_decay=0.0, ratio_base="proximal")
# Each loss and correction (trainer/corrections.py) on top of CFG. The random rollout logprobs here are far from
# the tiny model's (log rho in about [-9, -6], median -7.2), so the bands are set to mask about half the tokens
# (icepop) or sequences (seq_mask_geo). The clips act: the proximal logprobs are the model's own moved by
# +-DRIFT per token (``step``), as after earlier minibatches, so the ratio pi_theta / pi_prox is e^-+0.3 and PPO,
# GSPO and CISPO clip part of the tokens.
VARIANTS = {
    "ppo_clip": {},
    "gspo": {"loss": "gspo"},
    "cispo": {"loss": "cispo"},
    "icepop": {"correction": "icepop", "icepop_low": 7.5e-4, "icepop_high": 1.0},
    "seq_mask_geo": {"correction": "seq_mask_geo", "seq_mask_low": 7.5e-4, "seq_mask_high": 1.0},
}


def loss_of(variant: str):
    from dataclasses import replace

    return loss_config(replace(CFG, **VARIANTS[variant]))


def samples(builder: str, loss_norm: str, vocab: int, seed: int = 0) -> list:
    """Four groups of four trajectories: per_request (one call a trace) or prefix_merging (three calls in
    one trace, tool results between them untrained)."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 12))]
        rewards = [rng.random() for _ in range(4)]
        mean = sum(rewards) / 4
        for i, r in enumerate(rewards):
            ids, mask = list(prompt), [0] * len(prompt)
            for call in range(3 if builder == "prefix_merging" else 1):
                if call:  # a tool result: in the sequence, not trained
                    result = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 5))]
                    ids, mask = ids + result, mask + [0] * len(result)
                completion = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
                ids, mask = ids + completion, mask + [1] * len(completion)
            logprobs = [-rng.random() * 3 if m else 0.0 for m in mask]
            s = sample_from_trace(ids, mask, logprobs, r - mean, 0, 1.0, f"g{g}", f"g{g}/t{i}")
            out.append(s)
    return assign_weights(out, loss_norm)


def micro_batches(all_samples: list, world: int = 1, rank: int = 0) -> list:
    return shard(pack(all_samples, CFG.token_budget), world, rank)


CASES = (("per_request", "token_mean", "ppo_clip"), ("prefix_merging", "token_mean", "ppo_clip"),
         ("per_request", "seq_mean", "ppo_clip"), ("per_request", "seq_mean", "gspo"),
         ("prefix_merging", "token_mean", "cispo"), ("per_request", "token_mean", "icepop"),
         ("prefix_merging", "seq_mean", "seq_mask_geo"))


DRIFT = 0.3


def drifted_proximal(model, micro, device) -> list:
    """Each micro-batch's proximal logprobs: the model's own, + DRIFT on even tokens and - DRIFT on odd ones."""
    from trainer.step import proximal_logprobs

    prox = proximal_logprobs(model, micro, 1.0, device, None)
    return [p + DRIFT * (1 - 2 * (torch.arange(len(p)) % 2)) for p in prox]


def step(model, micro, device, variant: str = "ppo_clip") -> tuple[dict, float, dict]:
    """Gradients of one step over ``micro`` (this rank's share), the norm over all ranks, the stat sums."""
    prox = drifted_proximal(model, micro, device)
    sums = accumulate_gradients(model, micro, loss_of(variant), 1.0, None, device, None, grad_scale=1.0, prox=prox)
    from trainer.parallel import clip_grad_norm_

    norm = clip_grad_norm_(model.parameters(), 1e9)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()  # a collective
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, norm, sums


def main(model_dir: str, out: str) -> None:
    """Every case of CASES on this rank's share; rank 0 saves {case: (grads, norm, summed stats)} to ``out``."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from trainer.parallel import build_model, place

    placement = place("auto", timeout_s=120)
    model = build_model(model_dir, placement, torch.float32, "auto")
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    results = {}
    for builder, loss_norm, variant in CASES:
        mine = micro_batches(samples(builder, loss_norm, vocab), placement.world, placement.rank)
        grads, norm, sums = step(model, mine, placement.device, variant)
        keys = sorted(sums)
        total = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(total)
        results[f"{builder}/{loss_norm}/{variant}"] = {"grads": grads, "norm": norm, "sums": dict(zip(keys, total.tolist())),
                                             "strategy": placement.strategy}
    # one update, then the export: the trained weights as an HF directory, and the logits they give here
    from dataclasses import replace

    from infra.settings import Settings
    from trainer.export import export_hf
    from trainer.step import train_step

    every = samples("per_request", "token_mean", vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, every, replace(CFG, lr=1e-2), reward_mean=0.0, placement=placement)
    export = Path(out).with_name("export")
    results["export_files"] = export_hf(model, f"file://{export}", model_dir, Settings())
    results["export_dir"] = str(export)
    with torch.no_grad():
        results["logits"] = model(torch.tensor([PROBE])).logits.detach().clone()
    if placement.master:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


PROBE = [5, 17, 33, 2, 71, 9, 40]  # token ids whose logits the export must reproduce


if __name__ == "__main__":
    main(*sys.argv[1:3])
