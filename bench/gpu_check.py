"""The prepared GPU check (issue 50): one command, under 8 minutes on one CUDA GPU, with only torch and
transformers (no download: the model is built from a config, random weights, the tiny model's tokenizer).

    .venv/bin/python bench/gpu_check.py            # CUDA: a ~0.5B Qwen3-shaped model, bf16
    .venv/bin/python bench/gpu_check.py --cpu      # the same code at a tiny size (the suite runs this)

It measures, and prints as one JSON object:

* ``train``: the trainer's step (``trainer.step.train_step``: packing, forward/backward, clip, AdamW) under
  FSDP2 at world size 1 (``strategy=fsdp``: a process group of one), bf16 compute with fp32 gradient
  reduction on CUDA, on the packed varlen path and on padded sdpa rows:
  tokens/s, MFU (6 x parameters x tokens/s over the device's dense bf16 peak, where the device is
  known) and peak memory;
* ``parity``: the trained tokens' logprobs of the bf16 FSDP2 model against a plain fp32 model on the
  same weights and micro-batch (max and mean absolute difference);
* ``engine``: our engine's batcher on the device, decode tokens/s at batch 1 and batch 32.

Numbers from ``--cpu`` show that the code runs; only a CUDA run's numbers describe a GPU.
"""

from __future__ import annotations

MEASURES = ("trainer/", "engine/", "bench/gpu_check.py")  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

# Dense bf16 peak FLOP/s by device name (datasheets, without sparsity), for MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
SIZES = {  # hidden, layers, heads, kv heads, intermediate; the vocabulary is the tiny tokenizer's
    "gpu": dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=4608, head_dim=128),
    "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, head_dim=16),
}


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def build(size: str, out: Path) -> Path:
    """A Qwen3-shaped model of ``size`` with random weights (seeded) and the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from infra.models import ensure_model

    tiny = ensure_model("tiny")
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SIZES[size])
    Qwen3ForCausalLM(config).save_pretrained(out)
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return out


def samples(n: int, length: int, vocab: int, seed: int = 0) -> list:
    """``n`` single-call traces of ``length`` tokens: a quarter prompt, the rest sampled, with advantages."""
    from trainer.packing import assign_weights, sample_from_trace

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [0] * (length // 4) + [1] * (length - length // 4)
        out.append(sample_from_trace(ids, mask, [-1.0] * length, rng.choice((-1.0, 1.0)), 0, 1.0, f"g{i // 4}", f"t{i}"))
    return assign_weights(out, "token_mean")


def time_steps(model_dir: Path, placement, path: str, n: int, length: int, steps: int) -> dict:
    """The trainer's FSDP2 step (``trainer.step.train_step``) on ``path`` (varlen: packed rows; padded: sdpa
    with a padding mask): the median time of a whole step, packing included."""
    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer
    from trainer.parallel import build_model
    from trainer.step import train_step

    cuda = placement.device.type == "cuda"
    varlen = path == "varlen"
    cfg = TrainConfig(lr=1e-6, weight_decay=0.0, token_budget=length * 4, packing="packed" if varlen else "padded",
                      attn_implementation="auto" if varlen else "sdpa")
    model = build_model(model_dir, placement, torch.float32, cfg.attn_implementation)
    optimizer = build_optimizer(model, cfg)
    batch = samples(n, length, model.config.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):  # the first is warm-up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # synthetic samples carry no rewards: mean 0 keeps the configured rate (no saturation scaling)
        done = train_step(model, optimizer, batch, cfg, reward_mean=0.0, placement=placement)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = sum(s.length for s in batch)
    out = {"params": params, "tokens_per_step": tokens, "microbatches": len(done.micro), "step_s": round(step_s, 4),
           "tokens_per_s": round(tokens / step_s, 1)}
    name = torch.cuda.get_device_name() if cuda else ""
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    out["mfu"] = round(6 * params * tokens / step_s / peak, 4) if peak else None
    out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    del model, optimizer
    return out


def parity(model_dir: Path, placement, length: int) -> dict:
    """The trained tokens' logprobs: bf16-compute FSDP2 model against a plain fp32 one, same weights."""
    from trainer.attention import load_model
    from trainer.loss import microbatch_logprobs
    from trainer.packing import pack
    from trainer.parallel import build_model

    cuda = placement.device.type == "cuda"
    sharded = build_model(model_dir, placement, torch.float32, "auto").eval()
    plain = load_model(model_dir, torch.float32, "auto").to(placement.device).eval()
    mb = pack(samples(4, length, plain.config.vocab_size, seed=1), length * 4)[0].to(placement.device)
    with torch.no_grad():
        with torch.autocast(placement.device.type, dtype=torch.bfloat16, enabled=cuda):
            low, _ = microbatch_logprobs(sharded, mb, 1.0)
        ref, _ = microbatch_logprobs(plain, mb, 1.0)
    diff = (low.float() - ref.float()).abs()
    return {"compute_dtype": "bfloat16" if cuda else "float32", "tokens": int(diff.numel()),
            "max_abs_diff": round(diff.max().item(), 6), "mean_abs_diff": round(diff.mean().item(), 7)}


def engine_decode(model_dir: Path, device: torch.device, new_tokens: int) -> dict:
    """Our engine's batcher on ``device``: decode tokens/s with 1 and with 32 sequences at once."""
    from engine.batcher import Batcher, Job, Sequence
    from engine.models import load_model
    from engine.sampling import SamplingParams

    lm = load_model(str(model_dir), device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32")
    batcher = Batcher(lm.model, lm.tokenizer, lm.eos_token_ids, max_num_seqs=32, prefix_cache_bytes=0)
    batcher.start()
    out = {}
    try:
        for batch in (1, 32):
            params = SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=7)
            jobs = [Job(prompt_ids=[5 + i, 9, 11, 13], seqs=[Sequence(prompt_len=4, params=params)]) for i in range(batch)]
            t0 = time.perf_counter()
            futures = [batcher.submit(j) for j in jobs]
            for f in futures:
                f.result(timeout=600)
            dt = time.perf_counter() - t0
            out[f"batch{batch}_tokens_per_s"] = round(batch * new_tokens / dt, 1)
    finally:
        batcher.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the same code at a tiny size on CPU (the suite runs it)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; --cpu runs the same code at a tiny size")
    from trainer.parallel import place

    t_start = time.perf_counter()
    size = "cpu" if args.cpu else "gpu"
    n, length, steps, new_tokens = (8, 64, 2, 8) if args.cpu else (16, 2048, 5, 128)
    placement = place("fsdp", cpu=args.cpu)  # FSDP2 in one process: a group of one
    tmp = Path(tempfile.mkdtemp(prefix="polar-gpu-check-"))
    try:
        model_dir = build(size, tmp / "model")
        log(f"model built ({size}); FSDP2 train steps")
        result = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "size": size,
                  "torch": torch.__version__, "world_size": placement.world, "strategy": placement.strategy,
                  "train": {path: time_steps(model_dir, placement, path, n, length, steps) for path in ("varlen", "padded")}}
        log("logprob parity")
        result["parity"] = parity(model_dir, placement, length)
        log("engine decode")
        result["engine"] = engine_decode(model_dir, placement.device, new_tokens)
        result["seconds"] = round(time.perf_counter() - t_start, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
