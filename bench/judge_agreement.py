"""How often a real small model, as a judge, agrees with the rule judge (issue 77): SmolLM2-135M-Instruct
served by our engine against polarstream/tools/rule_judge.py, on the same trajectories of the arith family.

    .venv/bin/python bench/judge_agreement.py [--quick] [--trajectories 100] [--out bench/results/judge_agreement.json]

The trajectories are the demo's policy's (its cached warm start, ``polarstream.demo.model.demo_model``)
first turns at the demo's temperature (1.0) and 48-token cap, sampled as ``learning.answer_rates``
samples them, over the whole family (81 sums), then taken half right and half wrong by the demo's own
reward (``arith.reward``: the test command's 1 or 0), so a judge that says the same thing every time
agrees on half. Each becomes a Trajectory (prompt tokens mask 0, the reply mask 1) and is judged by the
judge stage's own client (``streams.judge_stage.client_for``: the same system prompt, transcript,
strict verdict parsing) under examples/judge_arith.yaml's judge: task rubric none, experiment rubric
"Rule: arith", the meta-rubric, ``judge_only``. Only where it asks differs (the rule judge, an HTTP server
in this process; the engine serving ``smollm2`` at temperature 0, in this process too) and the limits:
SmolLM2 on a CPU gets 900 s per request instead of 10, 16 requests at a time instead of 8 (the engine
batches them), and one attempt (at temperature 0 a retry asks the same question for the same answer).

A verdict passes when its score is above 0 (judge_only: reward (score + 5) / 10 above one half). Agreement
is over the trajectories both judges scored; SmolLM2's failures (``unparseable``, ``refusal``, ...) are a
class of their own, counted apart, never a disagreement. Prints one JSON object and writes it to ``--out``
(with its provenance); docs/rewards.md renders it (``markdown``; bench/render.py OWN_RESULTS). Opt-in in
bench/run_all.py (``--judge-agreement``): minutes of CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import bench_provenance  # noqa: E402

# What the figures measure (bench/_provenance.py): the judge's prompt, client and parsing, the rule judge,
# the engine and SmolLM2's build, and the policy whose trajectories are judged.
MEASURES = ("streams/judge.py", "streams/judge_client.py", "streams/judge_stage.py", "polarstream/tools/rule_judge.py",
            "engine/", "infra/models/smollm2.py", "polarstream/demo/learning.py", "polarstream/demo/arith.py",
            "polarstream/demo/model.py", "examples/judge_arith.yaml")
EXPERIMENT = ROOT / "examples/judge_arith.yaml"
SEED = 0


# ------------------------------------------------------------------------------------ the arithmetic


def passes(score: float) -> bool:
    """A verdict's pass/fail: judge_only's reward (score + 5) / 10 above one half."""
    return score > 0


def agreement(rows: list[tuple[float, float | None, str | None]]) -> dict:
    """Agreement of judge B with judge A over ``rows`` of (A's score, B's score or None, B's failure class).

    Only rows B scored count towards agreement; B's failures are counted by class apart. ``confusion``:
    rule_pass/rule_fail x model_pass/model_fail. ``kappa``: Cohen's, agreement beyond what the two pass
    rates would give by chance (None when chance agreement is 1: nothing to beat)."""
    confusion = Counter()
    failures = Counter()
    failed_on = Counter()  # B's failures by A's verdict
    for a, b, failure in rows:
        if b is None:
            failures[failure or "no_verdict"] += 1
            failed_on[f"rule_{'pass' if passes(a) else 'fail'}"] += 1
            continue
        confusion[f"rule_{'pass' if passes(a) else 'fail'}_model_{'pass' if passes(b) else 'fail'}"] += 1
    cells = {k: confusion[k] for k in ("rule_pass_model_pass", "rule_pass_model_fail", "rule_fail_model_pass",
                                       "rule_fail_model_fail")}
    n = sum(cells.values())
    agreed = cells["rule_pass_model_pass"] + cells["rule_fail_model_fail"]
    rate = agreed / n if n else None
    kappa = None
    if n:
        pa = (cells["rule_pass_model_pass"] + cells["rule_pass_model_fail"]) / n
        pb = (cells["rule_pass_model_pass"] + cells["rule_fail_model_pass"]) / n
        chance = pa * pb + (1 - pa) * (1 - pb)
        kappa = (rate - chance) / (1 - chance) if chance < 1 else None
    return {"trajectories": len(rows), "scored_by_both": n, "agreed": agreed, "agreement": rate, "kappa": kappa,
            "confusion": cells, "model_failures": dict(sorted(failures.items())), "model_failure_count": sum(failures.values()),
            "model_failures_by_rule": {k: failed_on[k] for k in ("rule_pass", "rule_fail")}}


# ------------------------------------------------------------------------------------ the trajectories


def trajectories(count: int, seed: int = SEED):
    """(model dir, [(Trajectory, TaskRequest, the demo's reward)]): ``count`` first turns of the warm-started
    policy, half passing and half failing where the samples allow (the rest from the other kind)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from infra.settings import Settings
    from polarstream.demo import arith
    from polarstream.demo.learning import render_prompt, sample_many
    from polarstream.demo.model import demo_model
    from polarstream.driver.config import RunConfig
    from schemas import Trace, Trajectory

    cfg = RunConfig(seed=seed)
    train, _ = arith.split(cfg.seed, cfg.heldout)
    model_dir, _ = demo_model(cfg, Settings(), train)  # cached: built once by any demo run
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = arith.family()
    per = max(4, -(-3 * count // len(problems)))  # the warm start passes about 1 in 5: enough right ones for half
    prompts = [render_prompt(tok, q, SYSTEM, TOOLS) for q, _ in problems]
    drawn = sample_many(model, tok, prompts, per, 48, cfg.temperature, torch.Generator().manual_seed(seed))
    right, wrong = [], []
    for (q, a), prompt, (comps, lps) in zip(problems, prompts, drawn):
        task = arith.template(q, a)
        for k, (c, lp) in enumerate(zip(comps, lps)):
            trace = Trace(call_indices=[0], token_ids=prompt + c, loss_mask=[0] * len(prompt) + [1] * len(c),
                          logprobs=[0.0] * len(prompt) + lp, policy_versions=[0])
            sid = f"judge-agreement-{q.replace(' ', '')}-{k}"
            traj = Trajectory(event_id=f"t-{sid}", session_id=sid, group_id=f"g-{q}", task_id=q, sample_index=k,
                              traces=[trace], reward=arith.reward(tok.decode(c), a))
            (right if traj.reward == 1.0 else wrong).append((traj, task))
    rng = random.Random(f"judge-agreement-{seed}")
    rng.shuffle(right)
    rng.shuffle(wrong)
    take_right = min(len(right), count - min(len(wrong), count // 2))
    chosen = right[:take_right] + wrong[:count - take_right]
    rng.shuffle(chosen)
    return model_dir, chosen


# ------------------------------------------------------------------------------------ the judges


def judge_config(base_url: str, model: str, tokenizer: Path, **limits):
    """examples/judge_arith.yaml's judge, asking ``base_url`` for ``model`` (``limits``: JudgeConfig's
    timeout, attempts, concurrency fields, which change when a verdict comes, not what it is)."""
    import yaml

    from streams.judge import JudgeConfig

    given = yaml.safe_load(EXPERIMENT.read_text())["judge"]
    return JudgeConfig(**{**given, "base_url": base_url, "model": model, "tokenizer": str(tokenizer), **limits})


async def judge_all(config, chosen) -> tuple[list, float]:
    """(each trajectory's JudgeVerdict, wall seconds), asked as the judge stage asks (its client, its limits)."""
    from streams.judge import task_rubric
    from streams.judge_stage import client_for

    client = client_for(config)
    t0 = time.perf_counter()
    try:
        verdicts = await asyncio.gather(*(client.judge(t, task_rubric(task), task.instruction) for t, task in chosen))
    finally:
        await client.close()
    return verdicts, time.perf_counter() - t0


def judge_summary(verdicts, wall: float) -> dict:
    return {"model": verdicts[0].model if verdicts else None, "wall_s": round(wall, 1),
            "per_trajectory_s": round(wall / max(1, len(verdicts)), 2),
            "scored": sum(v.failure is None for v in verdicts),
            "failures": dict(Counter(v.failure for v in verdicts if v.failure)),
            "scores": dict(sorted(Counter(int(v.score) for v in verdicts if v.failure is None).items())),
            "prompt_tokens": sum(v.prompt_tokens for v in verdicts), "completion_tokens": sum(v.completion_tokens for v in verdicts)}


def measure(count: int) -> dict:
    from engine.local import start_engine_server
    from infra.models import ensure_model
    from polarstream.tools.rule_judge import RuleJudge

    t0 = time.perf_counter()
    model_dir, chosen = trajectories(count)
    sampled_s = time.perf_counter() - t0
    tokenizer = model_dir / "tokenizer.json"
    rule = RuleJudge(0, None)
    threading.Thread(target=rule.serve_forever, daemon=True).start()
    engine = start_engine_server(ensure_model("smollm2"), name="smollm2", threads=1)
    try:
        rule_cfg = judge_config(f"http://127.0.0.1:{rule.server_address[1]}/v1", "rule-arith", tokenizer)
        small_cfg = judge_config(f"{engine.url}/v1", "smollm2", tokenizer, timeout_s=900, max_attempts=1, concurrency=16)
        rule_v, rule_s = asyncio.run(judge_all(rule_cfg, chosen))
        small_v, small_s = asyncio.run(judge_all(small_cfg, chosen))
    finally:
        engine.stop()
        rule.shutdown()
    if any(v.failure for v in rule_v):
        raise RuntimeError(f"the rule judge failed: {Counter(v.failure for v in rule_v if v.failure)}")
    rows = [(r.score, None if s.failure else s.score, s.failure) for r, s in zip(rule_v, small_v)]
    # The rule judge against the demo's own reward (the test command's verdict): the reference must be right.
    rule_vs_outcome = agreement([(t.reward * 2 - 1, r.score, None) for (t, _), r in zip(chosen, rule_v)])
    return {
        "bench": "judge_agreement", "trajectories": len(chosen),
        "right_answers": sum(t.reward == 1.0 for t, _ in chosen), "policy": model_dir.name,
        "judge": {"rubric": rule_cfg.rubric, "preset": rule_cfg.preset, "max_tokens": rule_cfg.max_tokens,
                  "temperature": rule_cfg.temperature, "concurrency": rule_cfg.concurrency,
                  "smollm2_timeout_s": small_cfg.timeout_s, "smollm2_max_attempts": small_cfg.max_attempts,
                  "smollm2_concurrency": small_cfg.concurrency},
        "agreement": agreement(rows),
        "rule_vs_outcome_agreement": rule_vs_outcome["agreement"],
        "rule": judge_summary(rule_v, rule_s), "smollm2": judge_summary(small_v, small_s),
        "sampling_s": round(sampled_s, 1), "wall_s": round(time.perf_counter() - t0, 1),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None, "load_avg_1m": round(os.getloadavg()[0], 2),
        "rows": [{"session": t.session_id, "outcome": t.reward, "rule": r.score, "smollm2": s.score,
                  "failure": s.failure, "detail": (s.detail or "")[:160]}
                 for (t, _), r, s in zip(chosen, rule_v, small_v)],
    }


# ------------------------------------------------------------------------------------ the page


def markdown(result: dict, key: str) -> str:
    """What bench/render.py puts between ``<!-- bench:judge_agreement:KEY -->`` markers: ``summary``."""
    if key != "summary":
        raise ValueError(f"bench/judge_agreement.py renders no {key!r}: summary")
    a, s = result["agreement"], result["smollm2"]
    c = a["confusion"]

    def pct(x):
        return "—" if x is None else f"{100 * x:.0f}%"

    fails = ", ".join(f"{k} {v}" for k, v in a["model_failures"].items()) or "none"
    by_rule = a["model_failures_by_rule"]
    example = next((r["detail"] for r in result["rows"] if r["failure"]), "")
    example = " ".join(example.split())[:90].replace("`", "'").replace("|", "/")
    kappa = "—" if a["kappa"] is None else f"{a['kappa']:.2f}"
    return "\n".join([
        f"SmolLM2-135M-Instruct (our engine, temperature 0) against the rule judge on {a['trajectories']} "
        f"trajectories of the arith family ({result['right_answers']} right answers by the test command):",
        "",
        "| | rule: pass | rule: fail |",
        "|---|---|---|",
        f"| SmolLM2: pass | {c['rule_pass_model_pass']} | {c['rule_fail_model_pass']} |",
        f"| SmolLM2: fail | {c['rule_pass_model_fail']} | {c['rule_fail_model_fail']} |",
        f"| SmolLM2: no verdict | {by_rule['rule_pass']} | {by_rule['rule_fail']} |",
        "",
        f"Agreement **{pct(a['agreement'])}** ({a['agreed']} of the {a['scored_by_both']} both scored; Cohen's kappa "
        f"{kappa}); SmolLM2 gave no verdict on {a['model_failure_count']} of {a['trajectories']} ({fails}: a failure "
        f"class, not a disagreement{f'; one such reply began `{example}`' if example else ''}). SmolLM2's scores: {', '.join(f'{k}: {v}' for k, v in s['scores'].items()) or 'none'}. "
        f"Wall time: SmolLM2 {s['wall_s']:g} s ({s['per_trajectory_s']:g} s a trajectory, "
        f"{result['judge']['smollm2_concurrency']} at a time, {result.get('threads') or '?'} CPU thread), the rule judge "
        f"{result['rule']['wall_s']:g} s. The rule judge agrees with the test command on "
        f"{pct(result['rule_vs_outcome_agreement'])}.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 trajectories, and no results file unless --out is given")
    ap.add_argument("--trajectories", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/judge_agreement.json (full runs)")
    args = ap.parse_args()
    count = 10 if args.quick else args.trajectories
    if count < 2:
        ap.error("--trajectories: at least 2 (one right, one wrong)")
    result = measure(count)
    result["provenance"] = {**bench_provenance(Path(__file__).resolve(), ROOT), "mode": "quick" if args.quick else "full",
                            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    out = args.out or (None if args.quick else ROOT / "bench/results/judge_agreement.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
