"""Trainer wall time on harness-shaped sessions: per_request vs prefix_merging vs shared group prefixes.

    .venv/bin/python bench/trainer.py [--quick] [--scale K] [--groups N] [--rounds R] [--model DIR]
                                      [--trl-python PATH]

Sessions are shaped like real harness sessions (issue 26): per group a 12,000-token system prompt plus
tools and a 100-400-token task, identical across the group's 8 samples; then per sample 24-40 turns of
30-300 sampled tokens, separated by 200-2,000-token tool results. Each call's prompt is the previous
prompt + its sampled ids + the tool result (token-in/token-out), and the sessions go through the
stream processors' own assembly (``streams.builders.assemble``) in ``per_request`` and
``prefix_merging`` mode. The trained (sampled) tokens are identical in every mode; what differs is the
work the trainer does to train them.

Two kinds of numbers, never mixed:

* ``full_scale_work``: deterministic work at the FULL shapes (a merged session is ~40-60k tokens, a
  per_request session ~1M tokens): tokens fed, attention pairs (query-key scores) and logit rows,
  summed over the real micro-batches that ``trainer.packing.pack`` builds for the same groups. Pure
  arithmetic over the packed counters, no model run. ``model_flops`` turns the counters into the
  tiny model's forward + backward FLOPs (an estimate, not a measurement): at full shapes attention is
  ~96% of them, so the full-scale cost ratio follows ``attention_pairs_ratio``, not ``tokens_fed_ratio``.
* timed passes: on 2 CPU cores with the tiny model a full-scale per_request group takes many minutes,
  so wall time is measured at the same shapes with every token length divided by ``shape_scale`` (K;
  turn counts and group size unchanged, a length never below 1 token; keep K under ~180, since the
  trainer shares only prefixes of ``packing.MIN_SHARED_PREFIX`` tokens or more). Every timed row says "shapes
  scaled 1/K"; none of them is a full-scale time. Attention is quadratic and the rest linear in
  length, so the timed speedups under-weight attention compared with full scale; compare them with
  the work ratios at the same scale (``timed_work``) and at full scale.

Timed modes, each one optimizer step over the same groups with the trainer's own step
(``trainer.step.train_step``: loss weights, packing, forward/backward, the trainer's clip, AdamW with the
trainer's default weight decay and lr saturation, and its skip rule), so a pass includes packing (also
timed alone, once, as ``pack_s``): per_request (packed), prefix_merging (packed), prefix_merging_shared
(packed with ``share_prefix=True``: a group's common prefix computed once per micro-batch) and
prefix_merging_padded. They run in interleaved rounds (``bench._rounds.interleaved``:
A B C D A B C D ..., threads fixed at 2), and a pass that got under 1.5 CPU-s per wall-s is flagged and
re-run. Min and median wall time and CPU/wall per mode are reported; the speedups use the medians
(``wall_time_speedup``) and the minima (``wall_time_speedup_min``).

The bound on shared prefixes is arithmetic: with a common prefix P and branches B_i fed after it,
sharing turns sum(P + B_i) tokens into P + sum(B_i); for 8 samples of mean branch B that is
8(P+B)/(P+8B) (``shared_vs_merged.token_bound``, with the matching attention-pair bound), which says
whether a given speedup target is reachable at these shapes at all.

Finally, if the TRL peer venv exists (see docs/trainer.md), the same tiny model's GRPO loss step is run
by TRL's ``GRPOTrainer`` and by our trainer on the same single-turn samples (outside the timed rounds):
loss values must agree, step times are compared. Prints one JSON object on stdout; progress on stderr.
(FSDP2 on 2 ranks against one process is bench/fsdp.py.)
"""

from __future__ import annotations

MEASURES = ('trainer/', 'streams/assembly.py', 'streams/builders.py', 'schemas/', 'bench/trl_peer.py')  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._rounds import interleaved, load_avg, set_threads  # noqa: E402
from schemas import TrainingGroup, Trajectory  # noqa: E402
from streams.assembly import CallTokens  # noqa: E402
from streams.builders import assemble  # noqa: E402
from trainer import attention, packing  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.loss import microbatch_logprobs  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.packing import assign_weights, sample_from_trace, samples_from_group  # noqa: E402
from trainer.step import micro_batches, train_step  # noqa: E402

DEFAULT_TRL_PYTHON = Path.home() / ".cache" / "polarstream" / "peers" / "trl-venv" / "bin" / "python"

# Harness-shaped sessions (issue 26), at full scale.
SYSTEM_TOOLS = 12_000  # system prompt + tool list, identical across a group
TASK = (100, 400)  # the task statement, identical across a group
TURNS = (24, 40)
SAMPLED = (30, 300)  # sampled tokens per turn
TOOL_RESULT = (200, 2_000)  # tool result tokens between turns
GROUP_SIZE = 8
# Micro-batch token budget at full scale: a group's 8 merged sessions (~8 x 50k) fit one micro-batch,
# so shared prefixes can be shared; per_request (~8M tokens a group) spreads over ~16 micro-batches.
BUDGET = 1 << 19
# Default shape scale, from idle passes (2 cores, tiny model): per_request took 4.7 s a pass at 1/128 and
# 19.8 s at 1/64 (attention and per-sequence costs grow faster than tokens). At 1/96 (~8-10 s), 5
# interleaved rounds of the 4 modes fit --quick (1 group) in about 2 minutes and the full run (2 groups)
# in about 4, on an idle machine. Under load every pass is slower, and passes under 1.5 CPU/wall re-run.
SCALE = 96
THREADS = 2
CPU_FLOOR = 1.5
MODES = ("per_request", "prefix_merging", "prefix_merging_shared", "prefix_merging_padded")


def log(msg: str) -> None:
    print(f"[bench/trainer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ sessions


@dataclass(frozen=True)
class GroupShape:
    """Token lengths of one group at full scale: shared prefix, then per sample per turn (sampled, tool)."""

    system: int
    task: int
    samples: tuple[tuple[tuple[int, int], ...], ...]


def group_shapes(n_groups: int, seed: int = 0) -> list[GroupShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        task = rng.randint(*TASK)
        samples = tuple(tuple((rng.randint(*SAMPLED), rng.randint(*TOOL_RESULT)) for _ in range(rng.randint(*TURNS)))
                        for _ in range(GROUP_SIZE))
        out.append(GroupShape(SYSTEM_TOOLS, task, samples))
    return out


def scaled(n: int, k: int) -> int:
    return max(1, round(n / k))


def make_sessions(shape: GroupShape, k: int, vocab: int, seed: int) -> list[list[CallTokens]]:
    """The group's sessions at shape scale 1/k: every sample starts from the same prefix token ids.

    Call t's prompt = prefix + (sampled + tool result) of every earlier turn; the last turn's sampled
    tokens end the session (no tool result after them).
    """
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefix = ids(scaled(shape.system, k)) + ids(scaled(shape.task, k))
    sessions = []
    for turns in shape.samples:
        calls, prompt = [], list(prefix)
        for t, (sampled, tool) in enumerate(turns):
            comp = ids(scaled(sampled, k))
            calls.append(CallTokens(event_id=f"e{t}", call_index=t, prompt_ids=list(prompt), delta=None,
                                    completion_ids=comp, logprobs=[-2.0] * len(comp)))
            prompt = prompt + comp + ids(scaled(tool, k))
        sessions.append(calls)
    return sessions


def make_group(sessions: list[list[CallTokens]], builder: str, g: int) -> TrainingGroup:
    rng = random.Random(g)
    trajs, rewards = [], []
    for i, calls in enumerate(sessions):
        traces = assemble(calls, builder).traces
        rewards.append(float(rng.random() < 0.5) if i else 1.0)
        trajs.append(Trajectory(session_id=f"g{g}s{i}", group_id=f"g{g}", sample_index=i, reward=rewards[-1],
                                builder=builder, traces=traces))
    mean = sum(rewards) / len(rewards)
    return TrainingGroup(group_id=f"g{g}", trajectories=trajs, advantages=[r - mean + 0.1 for r in rewards])


def build_groups(shapes: list[GroupShape], k: int, vocab: int) -> dict[str, list[TrainingGroup]]:
    """builder -> groups, from the same sessions."""
    out: dict[str, list[TrainingGroup]] = {"per_request": [], "prefix_merging": []}
    for g, shape in enumerate(shapes):
        sessions = make_sessions(shape, k, vocab, seed=1000 + g)
        for builder in out:
            out[builder].append(make_group(sessions, builder, g))
    return out


def step_samples(groups: list[TrainingGroup]) -> tuple[list[packing.Sample], int]:
    """The step's samples, whole (no trace is cut), token_mean weights; and the sampled tokens cut."""
    samples, cut = [], 0
    for g in groups:
        s, c = samples_from_group(g, 1 << 30)
        samples += s
        cut += c
    return assign_weights(samples, "token_mean"), cut


# ------------------------------------------------------------------------------------ packing + work


def mode_config(mode: str, budget: int) -> TrainConfig:
    """The trainer's settings for ``mode`` (defaults otherwise): packed modes one row of ``budget`` per
    micro-batch (the layout for ``polar_varlen``), padded one sequence per row."""
    return TrainConfig(token_budget=budget, packing="padded" if mode == "prefix_merging_padded" else "packed",
                       share_prefix=mode == "prefix_merging_shared")


def build_micro(mode: str, samples: list[packing.Sample], budget: int) -> list[packing.MicroBatch]:
    """The micro-batches the trainer's step builds for ``mode`` (``trainer.step.micro_batches``)."""
    return micro_batches(samples, mode_config(mode, budget))


def reward_mean(groups: list[TrainingGroup]) -> float:
    """The step's mean trajectory reward, as the trainer computes it for its lr saturation."""
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards)


def work(micro: list[packing.MicroBatch]) -> dict:
    """Deterministic work of a list of micro-batches: the trainer's own counters, summed.

    ``tokens_fed`` counts padding; ``attention_pairs`` are the (query, key) scores ``polar_varlen``
    computes (a shared prefix's once); ``logit_rows`` the rows through lm_head (trained tokens only).
    """
    return {
        "microbatches": len(micro),
        "sequences": sum(mb.num_sequences for mb in micro),
        "tokens_fed": sum(mb.num_tokens for mb in micro),
        "real_tokens": sum(mb.num_real_tokens for mb in micro),
        "attention_pairs": sum(mb.attention_pairs for mb in micro),
        "logit_rows": sum(mb.logit_rows for mb in micro),
        "trained_tokens": sum(int(mb.targets.numel()) for mb in micro),
    }


def prefix_bound(groups: list[TrainingGroup]) -> dict:
    """What sharing each group's common prefix can save at most, from the merged samples' lengths."""
    merged_tok = shared_tok = merged_pairs = shared_pairs = 0
    ps, bs = [], []
    for g in groups:
        s, _ = samples_from_group(g, 1 << 30)
        ids = [x.input_ids for x in s]
        p = 0
        while p < min(len(x) for x in ids) and all(x[p] == ids[0][p] for x in ids):
            p += 1
        tri = lambda n: n * (n + 1) // 2  # noqa: E731
        merged_tok += sum(len(x) for x in ids)
        shared_tok += p + sum(len(x) - p for x in ids)
        merged_pairs += sum(tri(len(x)) for x in ids)
        shared_pairs += tri(p) + sum(tri(len(x)) - tri(p) for x in ids)
        ps.append(p)
        bs += [len(x) - p for x in ids]
    P, B, n = statistics.mean(ps), statistics.mean(bs), GROUP_SIZE
    return {"prefix_tokens_mean": round(P, 1), "branch_tokens_mean": round(B, 1), "samples_per_group": n,
            "token_bound": round(merged_tok / shared_tok, 3),
            "token_bound_formula": round(n * (P + B) / (P + n * B), 3),
            "attention_pairs_bound": round(merged_pairs / shared_pairs, 3)}


def add_flops(cfg, w: dict) -> None:
    f = model_flops(cfg, w)
    w["model_flops"] = f["total"]
    w["model_flops_attention_frac"] = round(f["attention"] / f["total"], 4)


def full_scale_work(shapes: list[GroupShape], cfg, budget: int, modes: list[str]) -> dict:
    """Work counters at full shapes, one group at a time (a per_request group is ~8M tokens)."""
    totals: dict[str, dict] = {}
    bound_groups = []
    for g, shape in enumerate(shapes):
        groups = build_groups([shape], 1, cfg.vocab_size)
        bound_groups.append(groups["prefix_merging"][0])
        for mode in modes:
            samples, cut = step_samples(groups["per_request" if mode == "per_request" else "prefix_merging"])
            w = work(build_micro(mode, samples, budget))
            w["cut_tokens"] = cut
            t = totals.setdefault(mode, {})
            for key, v in w.items():
                t[key] = t[key] + v if isinstance(v, int) and key in t else v
        log(f"full-scale work: group {g + 1}/{len(shapes)} counted")
    for w in totals.values():
        add_flops(cfg, w)
    out = {"budget_tokens": budget, "groups": len(shapes), "modes": totals,
           "shared_prefix_bound": prefix_bound(bound_groups)}
    out.update(ratios(totals))
    return out


def model_flops(cfg, w: dict) -> dict:
    """Forward + backward FLOPs implied by a mode's work counters for the model ``cfg`` (an estimate from
    arithmetic, not a measurement): 2 FLOPs per multiply-add, backward twice the forward."""
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None)
    hd = hd or h // nh
    per_token = 2 * cfg.num_hidden_layers * (2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * cfg.intermediate_size)
    per_pair = 2 * cfg.num_hidden_layers * nh * 2 * hd  # q.k and p.v per (query, key) pair, every head
    per_logit = 2 * h * cfg.vocab_size
    lin, att, head = 3 * per_token * w["tokens_fed"], 3 * per_pair * w["attention_pairs"], 3 * per_logit * w["logit_rows"]
    return {"linear": lin, "attention": att, "lm_head": head, "total": lin + att + head}


def ratios(w: dict[str, dict]) -> dict:
    def r(a: str, b: str, key: str) -> float | None:
        if a not in w or b not in w or not w[b].get(key):
            return None
        return round(w[a][key] / w[b][key], 3)

    keys = ("tokens_fed", "attention_pairs", "logit_rows", "model_flops")
    out = {"merged_vs_per_request": {f"{k}_ratio": r("per_request", "prefix_merging", k) for k in keys}}
    out["merged_vs_per_request"]["same_trained_tokens"] = (
        w.get("per_request", {}).get("trained_tokens") == w.get("prefix_merging", {}).get("trained_tokens"))
    out["shared_vs_merged"] = {f"{k}_ratio": r("prefix_merging", "prefix_merging_shared", k) for k in keys}
    out["packed_vs_padded"] = {f"{k}_ratio": r("prefix_merging_padded", "prefix_merging", k) for k in keys}
    return out


# ------------------------------------------------------------------------------------ timing


def load_model(model_dir: str) -> torch.nn.Module:
    """The trainer's own loader and attention (``attn_implementation=auto``: ``polar_varlen``), fp32."""
    return attention.load_model(model_dir, torch.float32, "auto")


def make_target(model_dir: str, samples: list[packing.Sample], cfg: TrainConfig, mean: float):
    """One timed pass: the trainer's step (``trainer.step.train_step``) on the step's samples, with ``cfg``
    and the step's mean reward ``mean``."""
    torch.manual_seed(0)
    model = load_model(model_dir)
    model.train()
    opt = build_optimizer(model, cfg)

    def run() -> dict:
        out = train_step(model, opt, samples, cfg, reward_mean=mean)
        return {"trained_tokens": int(out.sums["tokens"]), "updated": out.no_update is None}

    return run


def warm(model_dir: str) -> None:
    """Imports, kernels and the allocator settle on a small step before anything is timed."""
    m = load_model(model_dir)
    ids = torch.randint(10, 1000, (1, 256))
    m(input_ids=ids, use_cache=False).logits[:, -8:].float().logsumexp(-1).sum().backward()


def compact_rounds(res: dict) -> dict:
    """interleaved()'s result with each pass reduced to its timing fields."""
    keep = ("round", "wall_s", "cpu_s", "cpu_per_wall", "low_cpu")
    out = {k: v for k, v in res.items() if k != "targets"}
    out["targets"] = {name: {**{k: v for k, v in t.items() if k != "passes"},
                             "passes": [{k: round(p[k], 4) if isinstance(p[k], float) else p[k] for k in keep} for p in t["passes"]]}
                      for name, t in res["targets"].items()}
    return out


# ------------------------------------------------------------------------------------ TRL


def trl_compare(model_dir: str, sessions: list[list[CallTokens]], trl_python: Path, reps: int) -> dict:
    """Our loss and step time vs TRL GRPOTrainer's on the first call of every session (single-turn)."""
    if not trl_python.exists():
        return {"status": "skipped", "reason": f"no TRL peer venv at {trl_python} (see docs/trainer.md to create it)"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    rng, noise = random.Random(1), torch.Generator().manual_seed(1)  # the same rows in every run
    rows = []
    for calls in sessions:
        c = calls[0]
        ids = c.prompt_ids + c.completion_ids
        s = sample_from_trace(ids, [0] * len(c.prompt_ids) + [1] * len(c.completion_ids), [0.0] * len(ids), 0.0, 10**6)
        with torch.no_grad():  # behaviour logprobs near the model's own, so ratios straddle the clip range
            lp, _ = microbatch_logprobs(model, packing.pack([s], 10**6)[0], 1.0)
        rows.append({"prompt": c.prompt_ids, "completion": c.completion_ids, "advantage": rng.choice([-1.0, 0.5, 1.0]),
                     "rollout_logprobs": (lp + torch.randn(lp.shape, generator=noise) * 0.3).tolist()})
    out: dict = {"status": "ok", "samples": len(rows)}
    for loss_type, norm in (("bnpo", "token_mean"), ("grpo", "seq_mean")):
        samples = [sample_from_trace(r["prompt"] + r["completion"], [0] * len(r["prompt"]) + [1] * len(r["completion"]),
                                     [0.0] * len(r["prompt"]) + r["rollout_logprobs"], r["advantage"], 10**6) for r in rows]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        # TRL's settings where they differ from the trainer's defaults: its clip range, no dual clip, no
        # weight decay, a constant rate (no saturation); the trainer's clip at 1.0 is also TRL's default
        cfg = TrainConfig(lr=1e-5, weight_decay=0.0, clip_low=0.2, clip_high=0.28, dual_clip=0.0, lr_saturation=1.0,
                          loss_norm=norm, token_budget=10**6, attn_implementation="sdpa")
        opt = build_optimizer(model, cfg)
        times, cpu, first = [], [], None
        for _ in range(reps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            step = train_step(model, opt, samples, cfg, reward_mean=0.0)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            first = step.sums["loss"] if first is None else first
        out[f"ours_loss_{norm}"] = first
        out[f"ours_step_s_{norm}"] = round(statistics.median(times[1:]), 4)
        out[f"ours_step_cpu_s_{norm}"] = round(statistics.median(cpu[1:]), 4)
    out["ours_tokens_fed"] = int(step.sums["tokens_fed"])
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


# ------------------------------------------------------------------------------------ report


def speedup(t: dict, slow: str, fast: str, stat: str) -> float | None:
    if slow not in t or fast not in t:
        return None
    return round(t[slow]["wall_s"][stat] / t[fast]["wall_s"][stat], 3)


def comparisons(res: dict) -> list[dict]:
    """Rows for bench/render.py: ours (the mode under test) beside its anchor (the mode it replaces)."""
    k = res["shape_scale"]
    rows = []
    timed, tw, fw = res["timed"], res["timed_work"], res["full_scale_work"]["modes"]

    def add(area, metric, ours, anchor, anchor_name, unit, hib, note=""):
        if isinstance(ours, (int, float)) and isinstance(anchor, (int, float)):
            rows.append({"area": area, "metric": metric, "ours": ours, "anchor": anchor, "anchor_name": anchor_name,
                         "unit": unit, "higher_is_better": hib, "note": note})

    for ours, anchor, area in (("prefix_merging", "per_request", "Training: prefix_merging vs per_request"),
                               ("prefix_merging_shared", "prefix_merging", "Training: shared group prefixes vs prefix_merging"),
                               ("prefix_merging", "prefix_merging_padded", "Training: packed vs padded micro-batches (prefix_merging)")):
        if ours not in timed or anchor not in timed:
            continue
        for stat in ("median", "min"):
            add(area, f"wall time of one step, {stat} of {res['rounds']['rounds']} (shapes scaled 1/{k})",
                timed[ours]["wall_s"][stat], timed[anchor]["wall_s"][stat], anchor, "s", False)
        for key, label, unit in (("tokens_fed", "tokens fed", "tokens"), ("attention_pairs", "attention pairs", "pairs"),
                                 ("logit_rows", "logit rows", "rows"),
                                 ("model_flops", "model FLOPs (arithmetic estimate)", "FLOPs")):
            add(area, f"{label} (shapes scaled 1/{k})", tw[ours][key], tw[anchor][key], anchor, unit, False)
            if ours in fw and anchor in fw:
                add(area, f"{label} (full-scale shapes)", fw[ours][key], fw[anchor][key], anchor, unit, False)
        add(area, "trained tokens (full-scale shapes)", fw.get(ours, {}).get("trained_tokens"),
            fw.get(anchor, {}).get("trained_tokens"), anchor, "tokens", None, "must be equal: same samples")
    t = res.get("trl") or {}
    name = f"TRL {t.get('trl_trl_version') or ''} GRPOTrainer".replace("  ", " ")
    for norm, loss in (("token_mean", "bnpo"), ("seq_mean", "grpo")):
        add("Training: our GRPO step vs TRL's on the same samples", f"step time ({norm} / loss_type={loss})",
            t.get(f"ours_step_s_{norm}"), t.get(f"trl_step_s_{loss}"), name, "s", False)
        add("Training: our GRPO step vs TRL's on the same samples", f"loss value ({norm} / loss_type={loss})",
            t.get(f"ours_loss_{norm}"), t.get(f"trl_loss_{loss}"), name, "", None, "must agree: same model, data and clip range")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="same shapes, 1 group instead of 2")
    ap.add_argument("--scale", type=int, default=SCALE, help="timed shapes: every token length divided by this")
    ap.add_argument("--groups", type=int, default=0, help="groups per step (default 1 quick, 2 full)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--no-full-scale", action="store_true", help="skip the full-scale work counts")
    ap.add_argument("--model", default="", help="HF model directory (default: the engine's tiny model)")
    ap.add_argument("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="python of the TRL peer venv")
    args = ap.parse_args()
    started = time.perf_counter()
    set_threads(THREADS)
    if not args.model:
        from infra.models import ensure_model

        args.model = str(ensure_model("tiny"))
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    mcfg = AutoConfig.from_pretrained(args.model)
    vocab = mcfg.vocab_size
    k, n_groups = args.scale, args.groups or (1 if args.quick else 2)
    shapes = group_shapes(n_groups)
    budget = max(1, BUDGET // k)
    modes = list(MODES)
    result: dict = {"bench": "trainer", "quick": args.quick, "model": args.model, "threads": THREADS,
                    "shape_scale": k, "timed_shapes": f"shapes scaled 1/{k}: every token length divided by {k}, "
                                                      f"turn counts and group size unchanged",
                    "groups": n_groups, "samples_per_group": GROUP_SIZE,
                    "session_shape": {"system_tools_tokens": SYSTEM_TOOLS, "task_tokens": list(TASK), "turns": list(TURNS),
                                      "sampled_tokens_per_turn": list(SAMPLED), "tool_result_tokens": list(TOOL_RESULT)},
                    "token_budget_full_scale": BUDGET, "token_budget_timed": budget,
                    "load_avg": {"start": load_avg()}}

    # -- timed data at scale 1/k, packed once per mode --------------------------------------------
    groups = build_groups(shapes, k, vocab)
    step_data, result["timed_work"], result["pack_s"] = {}, {}, {}
    for mode in modes:
        samples, cut = step_samples(groups["per_request" if mode == "per_request" else "prefix_merging"])
        step_data[mode] = samples
        t0 = time.perf_counter()
        micro = build_micro(mode, samples, budget)
        result["pack_s"][mode] = round(time.perf_counter() - t0, 4)
        result["timed_work"][mode] = {**work(micro), "cut_tokens": cut}
        add_flops(mcfg, result["timed_work"][mode])
    mean = reward_mean(groups["prefix_merging"])  # the same trajectories' rewards in every mode
    result["timed_work"]["shared_prefix_bound"] = prefix_bound(groups["prefix_merging"])
    if result["timed_work"]["shared_prefix_bound"]["prefix_tokens_mean"] < getattr(packing, "MIN_SHARED_PREFIX", 0):
        log(f"warning: at scale 1/{k} the group prefix is shorter than packing.MIN_SHARED_PREFIX: nothing is shared")
    log(f"timed data (scale 1/{k}, {n_groups} group(s)): " + ", ".join(f"{m} {w['tokens_fed']} tokens"
                                                                       for m, w in result["timed_work"].items() if m in modes))

    # -- interleaved rounds ---------------------------------------------------------------------------
    warm(args.model)
    targets = {mode: make_target(args.model, step_data[mode], mode_config(mode, budget), mean) for mode in modes}
    res = interleaved(targets, rounds=args.rounds, cpu_floor=CPU_FLOOR, threads=THREADS, progress=sys.stderr.isatty())
    result["rounds"] = compact_rounds(res)
    t = res["targets"]
    result["timed"] = {m: {"wall_s": {s: round(v, 4) if isinstance(v, float) else v for s, v in t[m]["wall_s"].items()},
                           "cpu_per_wall": {s: round(v, 3) if isinstance(v, float) else v for s, v in t[m]["cpu_per_wall"].items()},
                           "flagged": t[m]["flagged"], "reruns": t[m]["reruns"]} for m in modes}
    log("timed: " + ", ".join(f"{m} median {t[m]['wall_s']['median']:.2f}s" for m in modes))
    del micro, step_data, targets

    # -- deterministic work at full shapes ----------------------------------------------------------
    if not args.no_full_scale:
        result["full_scale_work"] = full_scale_work(shapes, mcfg, BUDGET, modes)
    else:
        result["full_scale_work"] = {"modes": {}, "skipped": "--no-full-scale"}

    # -- summary ------------------------------------------------------------------------------------------
    tw, fsw = result["timed_work"], result["full_scale_work"]
    r = ratios(tw)
    mv = {"wall_time_speedup": speedup(t, "per_request", "prefix_merging", "median"),
          "wall_time_speedup_min": speedup(t, "per_request", "prefix_merging", "min"),
          **r["merged_vs_per_request"]}
    if mv["wall_time_speedup"] and mv["tokens_fed_ratio"]:
        mv["speedup_over_tokens_fed_ratio"] = round(mv["wall_time_speedup"] / mv["tokens_fed_ratio"], 3)
    sv = {"wall_time_speedup": speedup(t, "prefix_merging", "prefix_merging_shared", "median"),
          "wall_time_speedup_min": speedup(t, "prefix_merging", "prefix_merging_shared", "min"),
          **r["shared_vs_merged"],
          "token_bound": tw["shared_prefix_bound"]["token_bound"],
          "attention_pairs_bound": tw["shared_prefix_bound"]["attention_pairs_bound"]}
    pv = {"wall_time_speedup": speedup(t, "prefix_merging_padded", "prefix_merging", "median"),
          "wall_time_speedup_min": speedup(t, "prefix_merging_padded", "prefix_merging", "min"), **r["packed_vs_padded"]}
    if fsw.get("modes"):
        for d, key in ((mv, "merged_vs_per_request"), (sv, "shared_vs_merged"), (pv, "packed_vs_padded")):
            d["full_scale"] = fsw[key]
        sv["token_bound_full_scale"] = fsw["shared_prefix_bound"]["token_bound"]
        sv["attention_pairs_bound_full_scale"] = fsw["shared_prefix_bound"]["attention_pairs_bound"]
    for d in (mv, sv, pv):
        d["timed_at"] = f"shapes scaled 1/{k}"
    result = {"merged_vs_per_request": mv, "shared_vs_merged": sv, "packed_vs_padded": pv, **result}

    # -- TRL, outside the rounds --------------------------------------------------------------------------
    sessions = make_sessions(shapes[0], k, vocab, seed=1000)
    result["trl"] = trl_compare(args.model, sessions, Path(args.trl_python), reps=1 if args.quick else 3)
    result["load_avg"]["end"] = load_avg()
    result["load_avg"]["rounds"] = res["load_avg"]
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["comparisons"] = comparisons(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
