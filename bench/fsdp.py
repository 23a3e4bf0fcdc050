"""FSDP2 on 2 ranks against one process (issue 50): memory per rank and step time.

    .venv/bin/python bench/fsdp.py [--rounds R] [--steps N]

A ~54M-parameter Qwen3-shaped model (``FSDP_MODEL``, random weights, tied head) is trained by 2 gloo
ranks (1 thread each) and by one process (2 threads) on the same samples, in interleaved rounds (single,
fsdp, single, fsdp, ...), each run N optimizer steps of ``bench/_fsdp_worker.py`` (the trainer's own
step, ``trainer.step.train_step``). Reported at the top level: ``fsdp_state_bytes_per_rank_ratio``, the
largest rank's parameter + gradient + AdamW-state bytes over the single process's (goal <= 0.55), and
``fsdp_step_time_vs_single``, the median over rounds of the FSDP2 step time over the single process's in
the same round; each rank's peak RSS beside them. It is an opt-in benchmark (``bench/run_all.py --fsdp``
or ``--only fsdp``): a few minutes of both cores, which the full run's 30-minute budget has no room for.
Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

MEASURES = ("trainer/", "bench/fsdp.py", "bench/_fsdp_worker.py")  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from bench._rounds import load_avg  # noqa: E402


def log(msg: str) -> None:
    print(f"[fsdp] {msg}", file=sys.stderr, flush=True)


# FSDP2's comparison model: Qwen3-shaped, ~54M parameters (issue 50: big enough to matter on this machine)
FSDP_MODEL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=4096)


def fsdp_compare(rounds: int, steps: int) -> dict:
    """FSDP2 on 2 gloo ranks (1 thread each) against one process (2 threads) on FSDP_MODEL, in interleaved
    rounds (single, fsdp, single, fsdp, ...), each run STEPS optimizer steps of bench/_fsdp_worker.py.
    Returns the issue's two ratios at the top level and every run under ``fsdp``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    worker = str(Path(__file__).with_name("_fsdp_worker.py"))
    runs: dict[str, list[dict]] = {"single": [], "fsdp": []}
    with tempfile.TemporaryDirectory(prefix="polar-fsdp-bench-") as tmp:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**FSDP_MODEL))
        model.save_pretrained(tmp)
        del model
        for r in range(rounds):
            for mode in ("single", "fsdp"):
                launcher = [sys.executable] if mode == "single" else [torchrun, "--standalone", "--nproc-per-node", "2"]
                env = {**os.environ, "OMP_NUM_THREADS": "2" if mode == "single" else "1"}
                log(f"round {r + 1}/{rounds}: {mode}")
                run = subprocess.run([*launcher, worker, tmp, str(steps)], capture_output=True, text=True, env=env,
                                     timeout=1200, cwd=Path(__file__).parents[1])
                if run.returncode != 0:
                    raise RuntimeError(f"{mode} run failed: {run.stderr[-2000:]}")
                runs[mode].append({"round": r, "load_avg": load_avg(), **json.loads(run.stdout.strip().splitlines()[-1])})
    med = lambda xs: statistics.median(xs)  # noqa: E731
    single = runs["single"][0]["state_bytes_per_rank"][0]
    per_rank = max(b for run in runs["fsdp"] for b in run["state_bytes_per_rank"])
    times = [f["step_s"] / s["step_s"] for s, f in zip(runs["single"], runs["fsdp"])]
    return {"fsdp_state_bytes_per_rank_ratio": round(per_rank / single, 4),
            "fsdp_step_time_vs_single": round(med(times), 3),
            "fsdp": {"model": FSDP_MODEL, "params": runs["single"][0]["params"], "world_size": 2, "steps_per_run": steps,
                     "state_bytes_single": single, "state_bytes_per_rank_max": per_rank,
                     "step_time_vs_single_min": round(min(times), 3), "step_time_vs_single_per_round": times,
                     "peak_rss_bytes_single": runs["single"][0]["peak_rss_bytes_per_rank"][0],
                     "peak_rss_bytes_per_rank": runs["fsdp"][0]["peak_rss_bytes_per_rank"], "runs": runs}}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = {"bench": "fsdp", "load_avg": {"start": load_avg()},
              **fsdp_compare(1 if args.quick else args.rounds, args.steps)}
    result["load_avg"]["end"] = load_avg()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
