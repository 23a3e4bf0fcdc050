"""Trainer throughput: prefix-merged vs per-request sequences from the same sessions, and TRL's GRPO step.

    .venv/bin/python bench/trainer.py [--quick] [--model DIR] [--trl-python PATH]

Synthetic agent sessions (token-in/token-out: each call's prompt is the previous prompt + its sampled
ids + a tool result) go through the stream processors' own assembly (``streams.builders.assemble``)
in ``per_request`` and ``prefix_merging`` mode; each set of groups is then trained for one pass with
the trainer's own packing and step code. The sampled (trained) tokens are identical in both modes; what
differs is how many tokens the model must process to train them. Packed vs padded micro-batches are
measured on the same merged data. Finally the same tiny model's GRPO loss step is run by TRL's
``GRPOTrainer`` (in a separate venv, see docs/trainer.md) and by our trainer on the same single-turn
samples: loss values must agree, step times are compared. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schemas import TrainingGroup, Trajectory  # noqa: E402
from streams.assembly import CallTokens  # noqa: E402
from streams.builders import assemble  # noqa: E402
from trainer.loss import LossConfig, microbatch_logprobs  # noqa: E402
from trainer.packing import assign_weights, pack, pad_by_length, sample_from_trace, samples_from_group  # noqa: E402
from trainer.step import accumulate_gradients  # noqa: E402

DEFAULT_TRL_PYTHON = Path.home() / ".cache" / "polarstream" / "peers" / "trl-venv" / "bin" / "python"


def make_session(rng: random.Random, turns: int, prompt: int, completion: int, tool: int, vocab: int) -> list[CallTokens]:
    """One agent session's calls, each prompt extending the previous prompt + sampled ids + a tool result.

    Turn counts and lengths vary (half to 1.5x the given sizes), as real sessions do.
    """
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(rng.randint(max(1, n // 2), n * 3 // 2))]  # noqa: E731
    calls, prompt_ids = [], ids(prompt)
    for k in range(rng.randint(max(1, turns // 2), turns)):
        comp = ids(completion)
        calls.append(CallTokens(event_id=f"e{k}", call_index=k, prompt_ids=list(prompt_ids), delta=None,
                                completion_ids=comp, logprobs=[-2.0] * len(comp)))
        prompt_ids = prompt_ids + comp + ids(tool)
    return calls


def make_groups(sessions: list[list[CallTokens]], builder: str, group_size: int, seed: int) -> list[TrainingGroup]:
    rng = random.Random(seed)
    groups = []
    for g in range(0, len(sessions), group_size):
        trajs, rewards = [], []
        for i, calls in enumerate(sessions[g:g + group_size]):
            traces = assemble(calls, builder).traces
            rewards.append(float(rng.random() < 0.5) if i else 1.0)
            trajs.append(Trajectory(session_id=f"s{g + i}", group_id=f"g{g}", sample_index=i, reward=rewards[-1],
                                    builder=builder, traces=traces))
        mean = sum(rewards) / len(rewards)
        groups.append(TrainingGroup(group_id=f"g{g}", trajectories=trajs, advantages=[r - mean + 0.1 for r in rewards]))
    return groups


def train_pass(model_dir: str, groups: list[TrainingGroup], groups_per_step: int, budget: int, packing: str) -> dict:
    """One pass over ``groups`` with the trainer's step code; the first step warms up and is not timed.

    ``packing``: rows (packed into rows of the step's longest sequence: the trainer's default on sdpa),
    one_row (packed, one row per micro-batch: the flash-attention layout) or padded.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    steps = [groups[i:i + groups_per_step] for i in range(0, len(groups), groups_per_step)]
    times, cpu, fed, real, trained, seqs, micro_count = [], 0.0, 0, 0, 0, 0, 0
    for n, step_groups in enumerate([steps[0], *steps]):
        t0, c0 = time.perf_counter(), time.process_time()
        samples = [s for g in step_groups for s in samples_from_group(g, budget)[0]]
        samples = assign_weights(samples, "token_mean")
        if packing == "padded":
            micro = pad_by_length(samples, budget)
        else:
            micro = pack(samples, budget, budget if packing == "one_row" else max(s.length for s in samples))
        sums = accumulate_gradients(model, micro, LossConfig())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if n == 0:
            continue
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        fed += sum(mb.num_tokens for mb in micro)
        real += sum(mb.num_real_tokens for mb in micro)
        trained += int(sums["tokens"])
        seqs += len(samples)
        micro_count += len(micro)
    total = sum(times)
    return {"steps": len(times), "sequences": seqs, "microbatches": micro_count, "tokens_fed": fed,
            "trained_tokens": trained, "padding_frac": round(1 - real / fed, 4),
            "step_time_s_median": round(statistics.median(times), 4), "total_s": round(total, 3),
            "cpu_s": round(cpu, 3),
            "tokens_per_s": round(fed / total, 1), "trained_tokens_per_s": round(trained / total, 1)}


def trl_compare(model_dir: str, sessions: list[list[CallTokens]], trl_python: Path, reps: int) -> dict:
    """Our loss and step time vs TRL GRPOTrainer's on the first call of every session (single-turn)."""
    if not trl_python.exists():
        return {"status": "skipped", "reason": f"no TRL peer venv at {trl_python} (see docs/trainer.md to create it)"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    rng = random.Random(1)
    rows = []
    for calls in sessions:
        c = calls[0]
        ids = c.prompt_ids + c.completion_ids
        s = sample_from_trace(ids, [0] * len(c.prompt_ids) + [1] * len(c.completion_ids), [0.0] * len(ids), 0.0, 10**6)
        with torch.no_grad():  # behaviour logprobs near the model's own, so ratios straddle the clip range
            lp, _ = microbatch_logprobs(model, pack([s], 10**6)[0], 1.0)
        rows.append({"prompt": c.prompt_ids, "completion": c.completion_ids, "advantage": rng.choice([-1.0, 0.5, 1.0]),
                     "rollout_logprobs": (lp + torch.randn_like(lp) * 0.3).tolist()})
    out: dict = {"status": "ok", "samples": len(rows)}
    for loss_type, norm in (("bnpo", "token_mean"), ("grpo", "seq_mean")):
        samples = [sample_from_trace(r["prompt"] + r["completion"], [0] * len(r["prompt"]) + [1] * len(r["completion"]),
                                     [0.0] * len(r["prompt"]) + r["rollout_logprobs"], r["advantage"], 10**6) for r in rows]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        micro = pack(assign_weights(samples, norm), 10**6)
        times, cpu, first = [], [], None
        for _ in range(reps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            sums = accumulate_gradients(model, micro, LossConfig(0.2, 0.28))
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            first = sums["loss"] if first is None else first
        out[f"ours_loss_{norm}"] = first
        out[f"ours_step_s_{norm}"] = round(statistics.median(times[1:]), 4)
        out[f"ours_step_cpu_s_{norm}"] = round(statistics.median(cpu[1:]), 4)
    out["ours_tokens_fed"] = sum(mb.num_tokens for mb in micro)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model_dir, "reps": reps, "lr": 1e-5, "epsilon": 0.2, "epsilon_high": 0.28, "samples": rows}, f)
    proc = subprocess.run([str(trl_python), str(Path(__file__).with_name("trl_peer.py")), f.name],
                          capture_output=True, text=True, timeout=600)
    Path(f.name).unlink()
    if proc.returncode != 0:
        return {**out, "status": "trl_failed", "error": proc.stderr.strip().splitlines()[-1:]}
    trl = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update({f"trl_{k}": v for k, v in trl.items()})
    out["loss_abs_diff_token_mean"] = abs(out["ours_loss_token_mean"] - trl["loss_bnpo"])
    out["loss_abs_diff_seq_mean"] = abs(out["ours_loss_seq_mean"] - trl["loss_grpo"])
    out["step_speedup_vs_trl_token_mean"] = round(trl["step_s_bnpo"] / out["ours_step_s_token_mean"], 2)
    out["step_cpu_speedup_vs_trl_token_mean"] = round(trl["step_cpu_s_bnpo"] / out["ours_step_cpu_s_token_mean"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    ap.add_argument("--model", default="", help="HF model directory (default: the engine's tiny model)")
    ap.add_argument("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="python of the TRL peer venv")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if not args.model:
        from engine.models import ensure_model

        args.model = str(ensure_model("tiny"))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    size = dict(n=8, turns=6, prompt=128, completion=16, tool=32, budget=1024, gps=1, rounds=1) if args.quick else \
        dict(n=16, turns=8, prompt=256, completion=32, tool=64, budget=2048, gps=2, rounds=2)
    rng = random.Random(0)
    sessions = [make_session(rng, size["turns"], size["prompt"], size["completion"], size["tool"], vocab)
                for _ in range(size["n"])]
    merged = make_groups(sessions, "prefix_merging", 4, seed=0)
    per_req = make_groups(sessions, "per_request", 4, seed=0)
    result = {"bench": "trainer", "quick": args.quick, "model": args.model, "threads": torch.get_num_threads(),
              "sessions": size["n"], "turns": size["turns"], "token_budget": size["budget"], "groups_per_step": size["gps"]}
    runs = {"prefix_merging_packed": (merged, "rows"), "per_request_packed": (per_req, "rows"),
            "prefix_merging_packed_one_row": (merged, "one_row"), "prefix_merging_padded": (merged, "padded")}
    passes: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(size["rounds"]):  # modes interleaved, so a noisy neighbour hits them alike
        for name, (groups, packing) in runs.items():
            passes[name].append(train_pass(args.model, groups, size["gps"], size["budget"], packing))
    for name, results in passes.items():  # the median pass by total time stands for the mode
        result[name] = {**sorted(results, key=lambda r: r["total_s"])[len(results) // 2], "rounds": len(results)}
    a, b = result["prefix_merging_packed"], result["per_request_packed"]
    result["merged_vs_per_request"] = {
        "same_trained_tokens": a["trained_tokens"] == b["trained_tokens"],
        "tokens_fed_ratio": round(b["tokens_fed"] / a["tokens_fed"], 2),
        "wall_time_speedup": round(b["total_s"] / a["total_s"], 2),
        "cpu_time_speedup": round(b["cpu_s"] / a["cpu_s"], 2),
    }
    for key, other in (("packed_vs_padded", "prefix_merging_padded"),
                       ("packed_rows_vs_one_row", "prefix_merging_packed_one_row")):
        o = result[other]
        result[key] = {"wall_time_speedup": round(o["total_s"] / a["total_s"], 2),
                       "cpu_time_speedup": round(o["cpu_s"] / a["cpu_s"], 2)}
    result["trl"] = trl_compare(args.model, sessions, Path(args.trl_python), reps=1 if args.quick else 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
