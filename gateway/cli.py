"""``polarstream gateway``: serve the model-API gateway; ``polarstream gateway-key``: mint a session key."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def _template(cfg):
    """The served model's tokenizer and template; refused in one line when no parser fits its markup."""
    from .app import load_template
    from .toolparse import ParserChoiceError, choose

    template = load_template(cfg)
    try:
        choose(template.signature(), cfg.tool_parser, cfg.reasoning_parser)
    except ParserChoiceError as e:
        raise typer.BadParameter(str(e), param_hint="--tool-parser") from None
    return template


def require_upstreams(engine_urls: list[str], settings) -> None:
    """Fail fast when an engine URL or Kafka does not answer (the gateway would only answer errors)."""
    from infra.reach import ENGINE_HINT, require_kafka, require_url

    for url in engine_urls:
        require_url(url, "the engine", ENGINE_HINT, wait_s=settings.wait_for_s)
    require_kafka(settings, wait_s=settings.wait_for_s)


def serve(
    engine_url: list[str] = typer.Option(..., "--engine-url", help="engine base URL; repeat for several workers"),
    model: str = typer.Option(..., help="tokenizer + chat template: a local HF directory or a built-in name (tiny)"),
    port: Optional[int] = typer.Option(None, help="listen port (default: settings.gateway_port)"),
    host: str = typer.Option("127.0.0.1", help="listen address"),
    upstream: str = typer.Option("polar", help="engine wire format: polar | vllm | sglang"),
    served_model: str = typer.Option("", help="model name sent to the engine ('' = ask the engine)"),
    chat_template: Optional[Path] = typer.Option(None, help="file with a chat template overriding the tokenizer's"),
    tool_parser: str = typer.Option("", "--tool-parser", help="tool-call markup, as vLLM's --tool-call-parser "
                                    "names it ('' = picked from the chat template)"),
    reasoning_parser: str = typer.Option("", "--reasoning-parser", help="reasoning markup, as vLLM's "
                                         "--reasoning-parser names it ('' = the tool-call family's)"),
    history: str = typer.Option("sampled", help="earlier turns in later prompts: sampled (token-in: as the model "
                                "wrote them, reasoning kept) | template (as the chat template renders them; a "
                                "call the template renders differently starts a new chain)"),
    open_mode: bool = typer.Option(False, "--open", help="accept any key: record ad-hoc sessions (open:<name>)"),
    allow_open_remote: bool = typer.Option(False, "--allow-open-remote",
                                           help="allow --open on an address other than loopback"),
    sampling: str = typer.Option("pin", help="pin: rollout sessions sample with the run's settings below; "
                                             "pass: every session keeps its harness's (evaluation)"),
    temperature: float = typer.Option(1.0, help="the run's sampling temperature (the trainer's)"),
    top_p: float = typer.Option(1.0, "--top-p", help="the run's top-p (1 = off; the trainer assumes off)"),
    top_k: int = typer.Option(0, "--top-k", help="the run's top-k (0 = off; the trainer assumes off)"),
    publish_mode: str = typer.Option("sync", help="sync: answer after the event is durably in Kafka; async: at once"),
    publish_timeout: float = typer.Option(10.0, help="seconds to wait for Kafka before answering 503"),
    max_body_mb: float = typer.Option(32.0, help="largest request body accepted (MiB)"),
    upstream_timeout: float = typer.Option(900.0, help="seconds an engine call may take"),
    max_tokens: int = typer.Option(4096, help="completion limit when a request names none"),
    max_model_len: Optional[int] = typer.Option(None, help="context length (default: ask the engine)"),
    policy_version: int = typer.Option(0, help="initial policy version stamped on calls"),
    max_messages: int = typer.Option(10_000, help="most messages one request may carry (400 beyond)"),
    max_tools: int = typer.Option(1_024, help="most tool definitions one request may carry (400 beyond)"),
    max_output_tokens: int = typer.Option(1_048_576, help="largest max_tokens a request may ask for (400 beyond)"),
    max_json_depth: int = typer.Option(64, help="deepest JSON nesting accepted in a body (400 beyond)"),
    max_sessions_per_key: int = typer.Option(256, help="sessions one API key may have calls in flight in (429 beyond)"),
    max_inflight_per_session: int = typer.Option(32, help="calls of one session in flight at once (429 beyond)"),
    body_timeout: float = typer.Option(120.0, help="seconds a request body may take to arrive (408 beyond)"),
    tombstones: Optional[Path] = typer.Option(None, help="file of closed sessions whose keys a restart still refuses "
                                                        "(default <data_dir>/gateway/tombstones.jsonl)"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (Kafka, topics, tokens)"),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
    processes: int = typer.Option(1, "--processes", min=1,
                                  help="gateway processes; above 1 a router sends every call of a session to one of them"),
) -> None:
    """Serve the gateway: harnesses point their base URL here; every call is recorded in Kafka."""
    import uvicorn

    from infra.heap import freeze_startup_heap
    from infra.reach import require_free_port
    from infra.settings import Settings

    from .app import create_app
    from .config import GatewayConfig
    from .limits import Limits

    if upstream not in ("polar", "vllm", "sglang"):
        raise typer.BadParameter(f"{upstream!r}: expected polar, vllm or sglang", param_hint="--upstream")
    from .template import HISTORY_MODES

    if history not in HISTORY_MODES:
        raise typer.BadParameter(f"{history!r}: expected {' or '.join(HISTORY_MODES)}", param_hint="--history")
    if publish_mode not in ("sync", "async"):
        raise typer.BadParameter(f"{publish_mode!r}: expected sync or async", param_hint="--publish-mode")
    from .sampling import SamplingPolicy

    try:
        policy = SamplingPolicy(mode=sampling, temperature=temperature, top_p=top_p, top_k=top_k)  # type: ignore[arg-type]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sampling") from None
    from .exposure import UnsafeExposure, check_exposure

    settings = Settings(config=str(config)) if config else Settings()
    try:
        check_exposure(host, admin_token=settings.admin_token, session_secret=settings.session_secret,
                       open_mode=open_mode, allow_open_remote=allow_open_remote)
    except UnsafeExposure as e:
        raise typer.BadParameter(str(e), param_hint="--host") from None
    require_free_port(port or settings.gateway_port, host)
    from infra.models import resolve_tokenizer_model

    model_dir = resolve_tokenizer_model(model)  # FileNotFoundError (infra/models/) says what was tried
    template_text = chat_template.read_text() if chat_template else None
    cfg = GatewayConfig(
        engine_urls=list(engine_url), model=model_dir, upstream=upstream,  # type: ignore[arg-type]
        served_model=served_model, chat_template=template_text, tool_parser=tool_parser,
        reasoning_parser=reasoning_parser, history=history,  # type: ignore[arg-type]
        open_mode=open_mode, publish_mode=publish_mode, sampling=policy,  # type: ignore[arg-type]
        publish_timeout_s=publish_timeout, max_body_bytes=int(max_body_mb * 1024 * 1024),
        upstream_timeout_s=upstream_timeout, default_max_tokens=max_tokens, max_model_len=max_model_len,
        policy_version=policy_version, tombstones=str(tombstones or settings.data_dir / "gateway" / "tombstones.jsonl"),
        limits=Limits(max_json_depth=max_json_depth, max_messages=max_messages, max_tools=max_tools,
                      max_output_tokens=max_output_tokens, max_sessions_per_key=max_sessions_per_key,
                      max_inflight_per_session=max_inflight_per_session, body_timeout_s=body_timeout),
    )
    template = None if processes > 1 else _template(cfg)  # said before waiting on the engine (workers load their own)
    require_upstreams(engine_url, settings)
    if processes > 1:  # session state is per process: route by session (gateway/router.py), not uvicorn --workers
        from .workers import serve_processes

        return serve_processes(settings, cfg, host, port or settings.gateway_port, processes, log_level)
    app = create_app(settings, cfg, template=template)
    freeze_startup_heap()  # the tokenizer and imports stay out of every later full collection (infra/heap.py)
    # uvicorn closes idle keep-alive connections after 5 s by default; a client reusing one just then
    # reads a reset (httpx.ReadError). Harnesses idle longer than that while tools run, and under 64
    # concurrent clients bench/gateway.py hit it in 2 of 3 runs; 75 s (nginx's default) did not.
    uvicorn.run(app, host=host, port=port or settings.gateway_port, log_level=log_level, timeout_keep_alive=75)


def key(
    session_id: str = typer.Argument(..., help="the session the key is scoped to"),
    group_id: str = typer.Option("", help="group (task submission) of the session"),
    task_id: str = typer.Option("", help="task of the session"),
    sample_index: int = typer.Option(0, help="sample number within the group"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (session secret)"),
) -> None:
    """Print a session key signed with the configured session secret."""
    from infra.settings import Settings

    from schemas.session_keys import mint_session_key

    settings = Settings(config=str(config)) if config else Settings()
    typer.echo(mint_session_key(session_id, settings.session_secret, group_id=group_id, task_id=task_id,
                                sample_index=sample_index, ttl_s=settings.session_key_ttl_s))


def register(app: typer.Typer) -> None:
    """Add the gateway commands to the root ``polarstream`` command."""
    app.command("gateway")(serve)
    app.command("gateway-key")(key)
