"""The arith family's model: the tiny model after its supervised warm start (warmstart.py), cached by
everything that determines it, with the warm start's pass rate on the train split as its gate."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from infra.settings import Settings

from . import arith
from .shape import Shape

if TYPE_CHECKING:
    from polarstream.driver.config import RunConfig


def demo_model(cfg: "RunConfig", settings: Settings, train: list[tuple[str, str]],
               shape: Shape | None = None) -> tuple[Path, dict]:
    """The tiny model after its warm start, cached by everything that determines it, and the warm
    start's record: its pass rate on the train split, measured before any RL (``learning.pass_rate``).

    For a real CLI (``shape``), the built-in warm start goes on for ``shape_sft_steps`` in the CLI's
    captured shape: the sums are known already, only the prompt, the tools and the tool results are new.
    """
    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from infra.models import ensure_model

    family = arith.family()
    if shape is None:
        key = json.dumps(["family-v3", cfg.seed, cfg.sft_steps, cfg.sft_lr, cfg.sft_batch, cfg.sft_drills, cfg.p_tool,
                          family, train, SYSTEM, TOOLS], sort_keys=True)
        base, steps = ensure_model("tiny" if cfg.seed == 0 else f"tiny:{cfg.seed}"), cfg.sft_steps
    else:
        base, _ = demo_model(cfg, settings, train)
        key = json.dumps(["shape-v1", base.name, cfg.shape_sft_steps, cfg.sft_lr, cfg.sft_batch, cfg.sft_drills,
                          cfg.p_tool, cfg.seed, shape.to_json()], sort_keys=True)
        steps = cfg.shape_sft_steps
    out = settings.cache_dir / "models" / f"demo-sft-{uuid.uuid5(uuid.NAMESPACE_OID, key).hex[:12]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: another process wanting the same warm start (a second run, a test worker)
    # waits for this one instead of building it again on the same cores.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file, also when this process dies
        return _built(cfg, out, base, steps, family, train, shape)


def _built(cfg: "RunConfig", out: Path, base: Path, steps: int, family, train: list[tuple[str, str]],
           shape: Shape | None) -> tuple[Path, dict]:
    """``out`` (the warm start and its record), built unless it is there; under demo_model's lock."""
    from gateway.harnesses.builtin import SYSTEM, TOOLS

    from .warmstart import warm_start

    record = out / "warmstart.json"
    if (out / "config.json").exists() and record.exists():
        info = json.loads(record.read_text())
        if info.get("train_pass_rate") is not None or cfg.min_pass_rate <= 0:
            return out, info
        info.update(_gate_rates(cfg, out, train, shape))  # cached by a run with the gate off: measure it now
        record.write_text(json.dumps(info, indent=2))
        return out, info
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # its own: another process may build the same one
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    warm_start(base, tmp, family, system=SYSTEM, tools=TOOLS, steps=steps, lr=cfg.sft_lr, p_tool=cfg.p_tool,
               batch_size=cfg.sft_batch, drills=cfg.sft_drills, seed=cfg.seed, shape=shape)
    # the gate is off in tests (min_pass_rate 0): measuring it would only cost time
    rates = _gate_rates(cfg, tmp, train, shape) if cfg.min_pass_rate > 0 else {"train_pass_rate": None, "working_correct": None}
    info = {**rates, "samples_per_problem": 2, "problems": len(train), "sft_steps": steps, "p_tool": cfg.p_tool,
            "seconds": round(time.monotonic() - t0, 1),
            **({"shape": f"{shape.harness} {shape.version} over {shape.api}", "base": base.name} if shape else {})}
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    if not (out / "warmstart.json").exists():
        shutil.rmtree(out, ignore_errors=True)  # a half-built one from an older layout
    try:
        tmp.rename(out)
    except OSError:  # finished by a process that held no lock (an older polarstream): theirs is the same, keep it
        shutil.rmtree(tmp, ignore_errors=True)
        info = json.loads((out / "warmstart.json").read_text())
    return out, info


def _gate_rates(cfg: "RunConfig", model_dir: Path, train: list[tuple[str, str]], shape: Shape | None) -> dict:
    """The warm start's pass rate on the train split (2 samples per problem) and how often its sums are right."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.harnesses.builtin import SYSTEM, TOOLS

    from .learning import answer_rates

    rates = answer_rates(AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir), train,
                         2, system=SYSTEM, tools=TOOLS, seed=cfg.seed, shape=shape)
    return {"train_pass_rate": rates["pass_rate"], "working_correct": rates["working_correct"]}
