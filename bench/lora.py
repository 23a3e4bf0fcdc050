"""LoRA against full fine-tuning (issue 64) on the ~54M-parameter model, one process: trained state, step time
and the bytes a weight sync moves.

    .venv/bin/python bench/lora.py [--quick] [--rounds R] [--rank 16]

The model is bench/fsdp.py's ``FSDP_MODEL`` (Qwen3-shaped, random weights, tied head), built once. Two copies
train side by side with the trainer's own step (``trainer.step.train_step``) on the same samples
(bench/gpu_check.py ``samples``): ``full`` (every weight) and ``lora`` (trainer/lora.py: rank R, alpha 2R, every
attention and MLP projection, the base frozen). Reported at the top level:

* ``lora_state_bytes_vs_full``: trainable parameters + their gradients + AdamW's state, measured just before
  AdamW's update (the gradients still held), LoRA over full (deterministic: no timing in it). The frozen
  base, which both hold, is reported beside it (``lora.frozen_bytes``).
* ``lora_step_time_vs_full``: the median over interleaved rounds (full, lora, full, lora, ...; 2 threads;
  ``bench._rounds.interleaved``) of one optimizer step's wall time, LoRA over full, with min and the load.
* ``lora_sync_bytes_vs_full``: the bytes one sync writes for the engines to load: the adapter in PEFT's
  layout (trainer/lora.py ``write_adapter``) against the full weights' HF export (trainer/export.py
  ``export_hf``), every file of each counted (deterministic).

An opt-in benchmark (``bench/run_all.py --lora`` or ``--only lora``): a few minutes of both cores.
Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

MEASURES = ("trainer/", "bench/lora.py")  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench._rounds import interleaved, load_avg  # noqa: E402


def log(msg: str) -> None:
    print(f"[lora] {msg}", file=sys.stderr, flush=True)


def trained_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the trainable parameters, their gradients and the optimizer's state."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def compare(rounds: int, rank: int) -> dict:
    from dataclasses import replace

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.fsdp import FSDP_MODEL
    from bench.gpu_check import samples
    from infra.settings import Settings
    from trainer import lora
    from trainer.config import TrainConfig
    from trainer.export import export_hf
    from trainer.optim import build_optimizer
    from trainer.parallel import Placement, build_model
    from trainer.step import train_step

    full_cfg = TrainConfig(lr=1e-6, weight_decay=0.0, token_budget=1024)
    lora_cfg = replace(full_cfg, lr=1e-5, lora_rank=rank, lora_alpha=2 * rank)
    with tempfile.TemporaryDirectory(prefix="polar-lora-bench-") as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**FSDP_MODEL)).save_pretrained(f"{tmp}/model")
        runs = {}
        for name, cfg in (("full", full_cfg), ("lora", lora_cfg)):
            model = build_model(f"{tmp}/model", Placement(), torch.float32, cfg.attn_implementation, lora=cfg)
            runs[name] = {"model": model, "optimizer": build_optimizer(model, cfg), "cfg": cfg, "held": 0}
        batch = samples(8, 256, FSDP_MODEL["vocab_size"])

        def target(name: str):
            run = runs[name]

            def measure(opt, args, kwargs) -> None:  # just before AdamW steps: the gradients are still held
                run["held"] = trained_state_bytes(run["model"], opt)

            run["optimizer"].register_step_pre_hook(measure)

            def step() -> dict:
                # synthetic samples carry no rewards: mean 0 keeps the configured rate
                train_step(run["model"], run["optimizer"], batch, run["cfg"], reward_mean=0.0)
                return {}
            return step

        log(f"{rounds} interleaved rounds of one step each (full, lora), after an untimed one each")
        # a pass under 1 CPU-s per wall-s is flagged and re-run once (a busy machine would re-run every pass)
        res = interleaved({n: target(n) for n in runs}, rounds=rounds, threads=2, cpu_floor=1.0, retries=1,
                          warmup=True, progress=False)
        log("sync bytes: the full HF export and the adapter")
        full_files = export_hf(runs["full"]["model"], f"file://{tmp}/export", f"{tmp}/model", Settings())
        model = runs["lora"]["model"]
        adapter_files = lora.write_adapter(f"{tmp}/adapter", lora.adapter_state_dict(model),
                                           lora.adapter_config(lora_cfg, f"{tmp}/model"))
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        params = sum(p.numel() for p in runs["full"]["model"].parameters())
        adapter_params = sum(p.numel() for _, p in lora.adapter_params(model))
    t = res["targets"]
    per_round = [lo["wall_s"] / fu["wall_s"] for fu, lo in zip(t["full"]["passes"], t["lora"]["passes"])]
    sorted_rounds = sorted(per_round)
    median = statistics.median(per_round)
    full_bytes, lora_bytes = runs["full"]["held"], runs["lora"]["held"]
    return {
        "lora_state_bytes_vs_full": round(lora_bytes / full_bytes, 5),
        "lora_step_time_vs_full": round(median, 3),
        "lora_sync_bytes_vs_full": round(sum(adapter_files.values()) / sum(full_files.values()), 5),
        "lora": {
            "model": FSDP_MODEL, "params": params, "rank": rank, "alpha": 2 * rank, "adapter_params": adapter_params,
            "state_bytes_full": full_bytes, "state_bytes_lora": lora_bytes, "frozen_bytes": frozen,
            "step_time_vs_full_min": round(sorted_rounds[0], 3), "step_time_vs_full_per_round": [round(x, 3) for x in per_round],
            "step_s": {n: {k: round(v, 4) for k, v in t[n]["wall_s"].items() if k in ("min", "median")} for n in t},
            "cpu_per_wall": {n: round(t[n]["cpu_per_wall"]["median"], 2) for n in t},
            "flagged": {n: t[n]["flagged"] for n in t}, "rounds": rounds, "threads": 2,
            "sync_bytes_full": sum(full_files.values()), "sync_bytes_lora": sum(adapter_files.values()),
            "sync_files_lora": adapter_files, "load_avg": res["load_avg"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = {"bench": "lora", "load_avg": {"start": load_avg()}, **compare(2 if args.quick else args.rounds, args.rank)}
    result["load_avg"]["end"] = load_avg()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
