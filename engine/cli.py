"""``polarstream engine`` (serve a model) and ``polarstream models build`` (make one without a hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (vllm/config/lora.py)


def parse_lora_module(item: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry as vLLM reads it: ``name=path``, or JSON ``{"name", "path"}`` (vLLM's
    ``base_model_name`` is accepted: this engine serves one base) -> (name, path); ValueError if neither."""
    if "=" in item and "," not in item and not item.lstrip().startswith("{"):
        name, _, path = item.partition("=")
    else:
        try:
            raw = json.loads(item)
        except ValueError:
            raise ValueError(f"{item!r}: expected name=path or JSON {{\"name\": ..., \"path\": ...}}") from None
        if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"}:
            raise ValueError(f"{item!r}: the JSON form takes name, path (and base_model_name)")
        name, path = str(raw.get("name") or ""), str(raw.get("path") or "")
    if not name or not path:
        raise ValueError(f"{item!r}: both a name and a path are needed")
    return name, path


models_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Build models without a hub.")


@models_app.command("build")
def build(
    name: str = typer.Argument(..., help="tiny | smollm2"),
    out: Optional[Path] = typer.Option(None, "--out", help="directory to write; default: the model cache"),
    seed: int = typer.Option(0, "--seed", help="tiny only: weights and tokenizer corpus derive from it"),
) -> None:
    """Build a model directory (HF layout) and print where it is."""
    from infra.models import build_smollm2, build_tiny, ensure_model

    if name not in ("tiny", "smollm2"):
        raise typer.BadParameter(f"unknown model {name!r}: expected tiny or smollm2", param_hint="NAME")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)  # an unwritable --out fails now, not after the build
    if out is None:
        path = ensure_model(f"tiny:{seed}" if name == "tiny" else "smollm2")
    elif name == "tiny":
        path = build_tiny(out, seed)
    else:
        from infra.settings import CACHE_DIR

        path = build_smollm2(out, CACHE_DIR)
    typer.echo(str(path))


def serve(
    model: str = typer.Option("tiny", "--model", help="tiny, tiny:SEED, smollm2, a local HF directory or a hub id"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    script: Optional[Path] = typer.Option(None, "--script", help="scripted mode: YAML file of assistant turns"),
    served_model_name: Optional[list[str]] = typer.Option(None, "--served-model-name", help="names to answer to"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="sequences decoded together at most"),
    logprobs_mode: str = typer.Option("processed_logprobs", "--logprobs-mode", help="processed_logprobs | raw_logprobs"),
    device: str = typer.Option("auto", "--device", help="auto (cuda when present), cpu, cuda, cuda:N"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    seed: int = typer.Option(0, "--seed", help="seed for requests that give none"),
    policy_version: int = typer.Option(0, "--policy-version", help="version reported until the first update"),
    threads: int = typer.Option(0, "--threads", help="CPU threads for the model; 0: 1 for tiny models, else torch's default"),
    prefix_cache_mb: int = typer.Option(256, "--prefix-cache-mb", help="KV memory kept for prefix reuse; 0 disables"),
    script_window: int = typer.Option(0, "--script-window", help="scripted mode: score scripted turns over the prompt's "
                                      "last N tokens instead of prefilling it all (fast, approximate logprobs; 0: off)"),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="vLLM's flag: accepted; adapters are served without "
                                     "it too (nothing to preallocate here); with it, vLLM's default --max-lora-rank 16"),
    max_loras: int = typer.Option(1, "--max-loras", min=1, help="vLLM: adapters in one batch; accepted, not enforced "
                                  "(this engine batches any mix)"),
    max_lora_rank: Optional[int] = typer.Option(None, "--max-lora-rank", help="refuse adapters of a higher rank "
                                                "(1, 8, 16, 32, 64, 128, 256, 320 or 512, as vLLM)"),
    lora_modules: Optional[list[str]] = typer.Option(None, "--lora-modules", help="name=path (or JSON "
                                                     '{"name", "path"}) of an adapter to load at start; repeat the flag'),
    logit_noise: float = typer.Option(0.0, "--logit-noise", min=0.0, help="add N(0, SIGMA^2) noise (seeded by --seed) "
                                      "to the logits before sampling: the engine samples from, and reports logprobs "
                                      "of, a policy off the trainer's by a controlled amount (0: off)"),
) -> None:
    """Serve a model with vLLM's token-level OpenAI API (CPU or CUDA)."""
    import asyncio
    import logging

    from infra.models import resolve_model
    from infra.reach import require_free_port
    from infra.settings import Settings

    from .models import load_model
    from .sampling import LOGPROBS_MODES
    from .script import Script, ScriptError

    if logprobs_mode not in LOGPROBS_MODES:
        raise typer.BadParameter(f"expected one of {', '.join(LOGPROBS_MODES)}", param_hint="--logprobs-mode")
    # The cheap checks first: bad LoRA flags, a taken port, a bad script or a missing model fail before torch loads.
    if max_lora_rank is not None and max_lora_rank not in MAX_LORA_RANKS:
        raise typer.BadParameter(f"expected one of {', '.join(map(str, MAX_LORA_RANKS))} (vLLM's choices)",
                                 param_hint="--max-lora-rank")
    try:
        modules = [parse_lora_module(m) for m in lora_modules or []]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--lora-modules") from None
    for name, path in modules:  # local ones now; s3:// ones are read at start (a failure stops it)
        local = Path(path.removeprefix("file://"))
        if ("://" not in path or path.startswith("file://")) and not (local / "adapter_config.json").is_file():
            raise typer.BadParameter(f"{name}={path}: no adapter_config.json there (PEFT's layout)", param_hint="--lora-modules")
    require_free_port(port, host)
    try:
        script_data = Script.read(script) if script else None
    except ScriptError as e:
        raise typer.BadParameter(str(e), param_hint="--script") from None
    resolve_model(model)

    import torch
    from .app import create_app, make_server
    from .serving import Engine, EngineOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = load_model(model, device=device, dtype=dtype)
    try:
        loaded_script = Script.render(script_data, lm.tokenizer, script) if script_data is not None else None
    except ScriptError as e:
        raise typer.BadParameter(str(e), param_hint="--script") from None
    options = EngineOptions(served_model_names=list(served_model_name or []), max_model_len=max_model_len,
                            max_num_seqs=max_num_seqs, logprobs_mode=logprobs_mode, seed=seed, policy_version=policy_version,
                            threads=threads, prefix_cache_mb=prefix_cache_mb,
                            script_window=script_window, enable_lora=enable_lora, max_loras=max_loras,
                            max_lora_rank=max_lora_rank, lora_modules=modules, logit_noise=logit_noise)
    engine = Engine(lm, model, options, loaded_script)
    settings = Settings()
    try:  # before the server answers, as vLLM loads them; the batching thread starts with the app
        asyncio.run(engine.load_static_adapters(settings))
    except RuntimeError as e:
        raise typer.BadParameter(str(e).removeprefix("--lora-modules "), param_hint="--lora-modules") from None
    make_server(create_app(engine, settings), host=host, port=port, log_level="info").run()


def register(app: typer.Typer) -> None:
    """Add ``engine`` and ``models`` to the root command."""
    app.command("engine")(serve)
    app.add_typer(models_app, name="models")
