"""Issue 48's collapse as a recording that carries everything its replay needs (issue 60).

The first recording held only the groups of a demo run; their replay started from the demo's warm start
rebuilt on the replaying machine, which is not the recording's model bit for bit (500 SFT steps on
another CPU's rounding), so on any other machine the recorded update no longer collapsed it. A
recording now is a directory (``tests/demo/data/collapse/``):

- ``model/``: the model the run started from, the tiny model after a short warm start, its weights
  stored in fp16 (2.8 MB) and the run sampled from exactly those weights (read back as fp32);
- ``record.json.gz``: the learning rate, the problems, every step's groups as sampled (prompt ids,
  completion ids, their logprobs, rewards and advantages), which step collapses, and the pass rates
  the recording machine measured on its own replay: the expected outcome, held to a tolerance.

The run is ``polarstream.demo.learning.rl_run`` at a constant learning rate (``lr_saturation=1``, the
trainer's old default); the replay takes the same updates (``grpo_update``) on the recorded groups,
once at a constant rate and once with the trainer's defaults.

    .venv/bin/python -m tests.demo.collapse record [--seed N] [--lr LR] [--steps N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent / "data" / "collapse"
EVAL_SAMPLES = 16  # per problem: the pass rate around the collapsing step
FALL = 0.3  # issue 48's rule: a fall of more than this is a collapse
TOLERANCE = 0.15  # how far another machine's replayed pass rate may sit from the recording's


def problems() -> list[tuple[str, str]]:
    from polarstream.demo import arith

    return arith.split(0)[0][::11]  # test_learning's problems: a short warm start knows their sums


def load(root: Path = HERE) -> dict:
    return json.loads(gzip.decompress((root / "record.json.gz").read_bytes()))


def pass_rate(model, tok, rec: dict) -> float:
    """Mean reward of EVAL_SAMPLES fresh samples per recorded problem, seeded."""
    from polarstream.demo.arith import reward
    from polarstream.demo.learning import sample_many

    model.eval()
    model.set_attn_implementation("sdpa")  # sampled with a KV cache, trained with polar_varlen
    prompts = [g["prompt"] for g in rec["steps"][0]]
    drawn = sample_many(model, tok, prompts, EVAL_SAMPLES, 48, 1.0, torch.Generator().manual_seed(0))
    got = [reward(tok.decode(c), a) for (_, a), (comps, _) in zip(rec["problems"], drawn) for c in comps]
    return sum(got) / len(got)


def replay(rec: dict, lr_saturation: float, root: Path = HERE, upto: int | None = None) -> tuple[float, float]:
    """The pass rate before and after the recorded step ``upto`` (default: the collapsing one), replaying
    the recorded groups of every step up to it from the recorded start."""
    from transformers import AutoTokenizer

    from polarstream.demo.learning import grpo_update
    from trainer.attention import load_model
    from trainer.config import TrainConfig
    from trainer.optim import param_groups
    from trainer.packing import sample_from_trace

    upto = rec["collapse_step"] if upto is None else upto
    torch.manual_seed(0)
    model_dir = root / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, torch.float32, "auto")
    train_attn = model.config._attn_implementation
    tcfg = TrainConfig(lr=rec["lr"], weight_decay=0.0, lr_saturation=lr_saturation)
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=tcfg.lr)
    before = None
    for step, groups in enumerate(rec["steps"][:upto + 1]):
        if step == upto:
            before = pass_rate(model, tok, rec)
        model.train()
        model.set_attn_implementation(train_attn)
        batch, rewards = [], []
        for g in groups:
            p = g["prompt"]
            for c, lp, adv in zip(g["completions"], g["logprobs"], g["advantages"]):
                s = sample_from_trace(p + c, [0] * len(p) + [1] * len(c), [0.0] * len(p) + lp, adv, len(p + c),
                                      group_id=f"{step}-{len(batch)}")
                if s is not None:
                    batch.append(s)
            rewards += g["rewards"]
        grpo_update(model, optimizer, batch, sum(rewards) / len(rewards), tcfg)
    return before, pass_rate(model, tok, rec)


def _start_model(out: Path, seed: int, p_tool: float) -> None:
    """The tiny model after a short warm start on the problems (test_learning's, but showing the tool call
    ``p_tool`` of the time: near 1 the run starts saturated, where issue 48's collapse happened), its
    weights rounded to fp16 (what ships)."""
    from safetensors.torch import load_file, save_file

    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from infra.models import ensure_model
    from polarstream.demo.warmstart import warm_start

    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        warm_start(ensure_model("tiny"), warm, problems(), system=SYSTEM, tools=TOOLS, progress=False,
                   steps=80, batch_size=8, drills=32, p_tool=p_tool, seed=seed)
        shutil.copytree(warm, out)
    weights = out / "model.safetensors"
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})


def record(seed: int, lr: float, steps: int, p_tool: float, out: Path = HERE) -> dict:
    """Run at a constant rate from a fresh start, find the step whose update collapses the pass rate, and
    write the recording (refuses when the run has none: try another seed or a higher lr)."""
    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from polarstream.demo.learning import LearningConfig, rl_run
    from trainer.config import TrainConfig

    torch.set_num_threads(2)
    tmp = out.with_name(out.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _start_model(tmp / "model", seed, p_tool)
    recorded: list = []
    log, _ = rl_run(tmp / "model", problems(), LearningConfig(steps=steps, samples=8, lr=lr, seed=seed, all_problems=True,
                                                              lr_saturation=1.0),
                    system=SYSTEM, tools=TOOLS, on_groups=lambda step, groups: recorded.append(groups),
                    on_step=lambda s: print(f"step {s.step}: reward {s.reward:.3f} lr {s.lr:.2e}", flush=True))
    rec = {"seed": seed, "lr": lr, "p_tool": p_tool, "problems": problems(), "steps": recorded, "run_rewards": log.rewards}
    defaults = TrainConfig().lr_saturation
    for k in range(steps):  # the first step at a constant rate whose update takes the pass rate down by FALL
        constant = replay(rec, 1.0, tmp, upto=k)
        print(f"replayed step {k}: constant lr {constant}", flush=True)
        if constant[0] - constant[1] > FALL:
            kept = replay(rec, defaults, tmp, upto=k)
            print(f"replayed step {k}: trainer defaults {kept}", flush=True)
            if kept[0] - kept[1] > FALL:
                raise SystemExit(f"step {k} of seed {seed} collapses with the trainer's defaults too: {kept}")
            rec.update(collapse_step=k, steps=recorded[:k + 1], expected={"constant": constant, "defaults": kept})
            break
    else:
        shutil.rmtree(tmp)
        raise SystemExit(f"no step of seed {seed} at lr {lr} collapses by more than {FALL}: try another seed or lr")
    (tmp / "record.json.gz").write_bytes(gzip.compress(json.dumps(rec, separators=(",", ":")).encode(), mtime=0))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(json.dumps({k: rec[k] for k in ("seed", "lr", "p_tool", "collapse_step", "expected", "run_rewards")}))
    return rec


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="record the collapse replayed by tests/demo/test_learning.py")
    ap.add_argument("cmd", choices=["record"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--p-tool", type=float, default=1.0)
    args = ap.parse_args()
    record(args.seed, args.lr, args.steps, args.p_tool)
