"""TRL's GRPOTrainer loss step on given data; runs inside the TRL peer venv, never in .venv.

    python bench/trl_peer.py DATA.json   ->  prints JSON {loss_<type>, step_s, ...}

DATA.json: {"model": dir, "reps": n, "lr": f, "epsilon": f, "epsilon_high": f,
            "samples": [{"prompt": [...], "completion": [...], "rollout_logprobs": [...], "advantage": f}]}
Called by bench/trainer.py, which runs our trainer's step on the same data and compares.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time


def main(path: str) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    data = json.loads(open(path).read())
    samples = data["samples"]
    B = len(samples)
    P = max(len(s["prompt"]) for s in samples)
    C = max(len(s["completion"]) for s in samples)
    # TRL's layout: prompts left-padded, completions right-padded, one row per sample
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.zeros(B, C, dtype=torch.long)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    old = torch.zeros(B, C)
    for i, s in enumerate(samples):
        p, c = s["prompt"], s["completion"]
        prompt_ids[i, P - len(p):] = torch.tensor(p)
        prompt_mask[i, P - len(p):] = 1
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
        old[i, : len(c)] = torch.tensor(s["rollout_logprobs"])
    advantages = torch.tensor([s["advantage"] for s in samples])

    out: dict = {"trl_version": trl.__version__, "tokens_fed": int(B * (P + C))}
    tok = AutoTokenizer.from_pretrained(data["model"])
    for loss_type in ("bnpo", "grpo"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(data["model"], attn_implementation="sdpa")
        with tempfile.TemporaryDirectory() as tmp:
            args = GRPOConfig(
                output_dir=tmp, per_device_train_batch_size=B, num_generations=B, max_completion_length=C,
                beta=0.0, epsilon=data["epsilon"], epsilon_high=data["epsilon_high"], loss_type=loss_type,
                learning_rate=data["lr"], use_cpu=True, report_to=[], logging_steps=1, bf16=False,
            )
            trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * B),
                                  processing_class=tok)
        trainer.current_gradient_accumulation_steps = 1  # set by its training loop; one step here
        model.train()
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
                  "num_items_in_batch": completion_mask.sum()}
        opt = torch.optim.AdamW(model.parameters(), lr=data["lr"], weight_decay=0.0)
        times, cpu, first = [], [], None
        for _ in range(data["reps"] + 1):  # the first rep warms up and is not timed
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            first = float(loss) if first is None else first
        out[f"loss_{loss_type}"] = first
        out[f"step_s_{loss_type}"] = statistics.median(times[1:])
        out[f"step_cpu_s_{loss_type}"] = statistics.median(cpu[1:])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
