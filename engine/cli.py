"""``polarstream engine`` (serve a model) and ``polarstream models build`` (make one without a hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

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
    logit_noise: float = typer.Option(0.0, "--logit-noise", min=0.0, help="add N(0, SIGMA^2) noise (seeded by --seed) "
                                      "to the logits before sampling: the engine samples from, and reports logprobs "
                                      "of, a policy off the trainer's by a controlled amount (0: off)"),
) -> None:
    """Serve a model with vLLM's token-level OpenAI API (CPU or CUDA)."""
    import logging

    from infra.models import resolve_model
    from infra.reach import require_free_port
    from infra.settings import Settings

    from .models import load_model
    from .sampling import LOGPROBS_MODES
    from .script import Script, ScriptError

    if logprobs_mode not in LOGPROBS_MODES:
        raise typer.BadParameter(f"expected one of {', '.join(LOGPROBS_MODES)}", param_hint="--logprobs-mode")
    # The cheap checks first: a taken port, a bad script or a missing model fail before torch loads.
    require_free_port(port, host)
    try:
        script_data = Script.read(script) if script else None
    except ScriptError as e:
        raise typer.BadParameter(str(e), param_hint="--script") from None
    resolve_model(model)

    import torch
    import uvicorn

    from .app import create_app
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
                            script_window=script_window, logit_noise=logit_noise)
    engine = Engine(lm, model, options, loaded_script)
    uvicorn.run(create_app(engine, Settings()), host=host, port=port, log_level="info")


def register(app: typer.Typer) -> None:
    """Add ``engine`` and ``models`` to the root command."""
    app.command("engine")(serve)
    app.add_typer(models_app, name="models")
