"""``polarstream replay | eval | export | cat``: re-derive, evaluate, export and print the recorded topics.

All four read with their own throw-away consumer group and never commit, so they run beside live
collection and training without moving anyone's offsets. See docs/replay-and-eval.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

_PREFIX_HELP = "topic prefix to read (default: the settings' POLAR_TOPIC_PREFIX); e.g. a replay's namespace"
_CONFIG_HELP = "settings YAML (else POLAR_* environment)"


def _settings(config: Optional[Path], prefix: Optional[str]):
    from infra.settings import Settings

    settings = Settings(config=str(config)) if config else Settings()
    return settings if prefix is None else settings.model_copy(update={"topic_prefix": prefix})


def _fail(message: str, code: int = 1):
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _json(obj) -> None:
    import orjson

    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")


def replay_command(
    to_prefix: Annotated[str, typer.Option(help="namespace to write: topics <NAME>.<source prefix>polar.trajectories|groups")],
    from_time: Annotated[Optional[str], typer.Option(help="start at this time (unix seconds or ISO 8601, UTC if no zone)")] = None,
    from_offsets: Annotated[Optional[Path], typer.Option(help='JSON {"calls": {"0": 12, ...}, "session-events": {...}}; e.g. a previous replay\'s end_offsets')] = None,
    to_time: Annotated[Optional[str], typer.Option(help="stop before this time (default: the end offsets when the replay starts)")] = None,
    builder: Annotated[str, typer.Option(help="per_request | prefix_merging")] = "prefix_merging",
    advantage: Annotated[str, typer.Option(help="grpo (mean/std) | loo (leave-one-out/std) | no_std (mean only)")] = "grpo",
    side_calls: Annotated[str, typer.Option(help="trace: own traces | drop: left out")] = "trace",
    zero_variance: Annotated[str, typer.Option(help="keep (flagged) | drop")] = "keep",
    epsilon: Annotated[float, typer.Option(help="added to the group std")] = 1e-6,
    timeout_reward: Annotated[float, typer.Option(help="reward of agent-budget timeouts")] = 0.0,
    group_deadline: Annotated[float, typer.Option(help="seconds (event time) after a group's first trajectory to emit with >= min_valid")] = 600.0,
    missing_calls_grace: Annotated[float, typer.Option(help="seconds (event time) a finished session waits for missing calls")] = 30.0,
    missing_calls_timeout: Annotated[float, typer.Option(help="seconds (event time) after which it stops waiting regardless")] = 300.0,
    tick_interval: Annotated[float, typer.Option(help="seconds (event time) between deadline sweeps")] = 2.0,
    drain: Annotated[bool, typer.Option(help="at the end of the input, let time run on until every deadline passed (--no-drain: leave open sessions and groups out)")] = True,
    allow_existing: Annotated[bool, typer.Option(help="write into target topics that already hold records")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    prefix: Annotated[Optional[str], typer.Option(help=_PREFIX_HELP)] = None,
    config: Annotated[Optional[Path], typer.Option(help=_CONFIG_HELP)] = None,
    judge: Annotated[Optional[Path], typer.Option("--judge", "--rejudge", help="judge YAML (docs/rewards.md): its verdicts "
                                                  "recorded in the run are reused (the run's own judge: the same rewards, bit for bit), "
                                                  "others asked for and recorded under --to-prefix; another rubric or judge re-judges")] = None,
    judge_failed_only: Annotated[bool, typer.Option(help="with --judge: ask again only where the recorded verdict is a failure")] = False,
) -> None:
    """Re-derive trajectories and groups from polar.calls + polar.session-events into a new namespace."""
    from pydantic import ValidationError

    from infra.errors import InfraError
    from infra.reach import require_kafka
    from streams.cli import load_judge
    from streams.config import StreamsConfig

    from producers.kafka_read import ReadError, plan_spans
    from producers.positions import PositionError, load_offsets, parse_time
    from .tools.replay import SOURCES, ReplayError, prepare_target, replay, target_settings

    if from_time is not None and from_offsets is not None:
        raise _fail("--from-time and --from-offsets: give one of them, not both", 2)
    if judge_failed_only and judge is None:
        raise _fail("--judge-failed-only: name the judge with --judge (the run's judge YAML)", 2)
    source = _settings(config, prefix)
    try:
        judge_cfg = load_judge(judge, source) if judge else None
    except typer.BadParameter as e:
        raise _fail(str(e), 2) from None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise _fail(f"--judge {judge}: {'.'.join(map(str, err['loc']))}: {err['msg']}", 2) from None
    try:
        cfg = StreamsConfig(builder=builder, advantage=advantage, side_calls=side_calls, zero_variance=zero_variance,
                            epsilon=epsilon, timeout_reward=timeout_reward, group_deadline_s=group_deadline,
                            missing_calls_grace_s=missing_calls_grace, missing_calls_timeout_s=missing_calls_timeout,
                            tick_interval_s=tick_interval, judge=judge_cfg)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise _fail(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", 2) from None
    try:
        target = target_settings(source, to_prefix)
        offsets = load_offsets(from_offsets, SOURCES) if from_offsets else None
        start_ms = parse_time(from_time) if from_time else None
        end_ms = parse_time(to_time) if to_time else None
        require_kafka(source)
        spans = plan_spans(source, SOURCES, from_offsets=offsets, from_time_ms=start_ms, to_time_ms=end_ms)
    except (PositionError, ReplayError) as e:
        raise _fail(str(e), 2) from None
    except ReadError as e:
        raise _fail(str(e)) from None
    try:
        prepare_target(target, allow_existing, judged=judge_cfg is not None)
        result = _run_with_progress(lambda tick: replay(source, target, spans, cfg, drain=drain, on_message=tick,
                                                        judge_failed_only=judge_failed_only),
                                    sum(s.size for s in spans), quiet)
    except (ReplayError, ReadError, InfraError) as e:
        raise _fail(str(e)) from None
    _json(result.to_dict())


def _run_with_progress(run, total: int, quiet: bool):
    """``run(tick)`` with a rich progress bar on stderr that ``tick`` advances one message at a time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet) as progress:
        task = progress.add_task("replay", total=total)
        return run(lambda _msg: progress.advance(task))


def eval_command(
    out: Annotated[Optional[Path], typer.Option(help="directory for eval.json, eval.png, eval.html")] = None,
    follow: Annotated[bool, typer.Option(help="keep reading and refreshing the report while collection runs")] = False,
    k: Annotated[Optional[list[int]], typer.Option(help="k for pass@k; repeat for several (pass@1 is always in)")] = None,
    threshold: Annotated[float, typer.Option(help="a sample passes when its status is ok and reward >= this")] = 1.0,
    refresh: Annotated[float, typer.Option(help="with --follow: seconds between report refreshes")] = 5.0,
    duration: Annotated[float, typer.Option(help="with --follow: stop after this many seconds (0: at Ctrl-C)")] = 0.0,
    prefix: Annotated[Optional[str], typer.Option(help=_PREFIX_HELP)] = None,
    config: Annotated[Optional[Path], typer.Option(help=_CONFIG_HELP)] = None,
) -> None:
    """pass@1, pass@k, reward, tokens, turns, timeouts and merge breaks per harness x policy version x task set."""
    from infra.reach import require_kafka

    from .tools.eval_run import run_eval
    from producers.kafka_read import ReadError

    ks = tuple(k or (1,))
    if min(ks) < 1:
        raise _fail(f"--k: every k must be at least 1, got {min(ks)}", 2)
    settings = _settings(config, prefix)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)  # an unwritable --out fails now, not after the read
    require_kafka(settings)

    def progress(report: dict) -> None:
        if follow:
            cells = report["cells"]
            typer.echo(f"eval: {report['source']['trajectories']} trajectories, {len(cells)} cells, "
                       f"pass@1 {', '.join(_pct(c['pass@1']) for c in cells) or '-'}", err=True)

    try:
        report = run_eval(settings, ks, threshold, out, follow, refresh, duration, progress)
    except ReadError as e:
        raise _fail(str(e)) from None
    if out is not None:
        typer.echo(f"eval: report in {out}/eval.json, eval.png, eval.html", err=True)
    _json(report)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def export_command(
    out: Annotated[str, typer.Option(help="output file (a directory with --checkpoint): a path, file:// or s3:// URL")],
    format: Annotated[Optional[str], typer.Option("--format", help="jsonl | parquet (datasets)")] = None,
    checkpoint: Annotated[Optional[str], typer.Option(help="export a model instead: this checkpoint directory, or "
                                                      "the newest under this checkpoint root; a LoRA run's gives its "
                                                      "adapter (PEFT layout)")] = None,
    merge: Annotated[bool, typer.Option(help="with --checkpoint of a LoRA run: the base with the adapter merged "
                                             "in, as an HF model directory")] = False,
    base: Annotated[Optional[str], typer.Option(help="--merge: the base model directory (default: the adapter's "
                                                     "base_model_name_or_path)")] = None,
    source: Annotated[str, typer.Option(help="trajectories | groups (groups add each trace's advantage)")] = "trajectories",
    min_reward: Annotated[Optional[float], typer.Option(help="only trajectories with at least this reward")] = None,
    harness: Annotated[Optional[str], typer.Option(help="only this harness")] = None,
    policy_version: Annotated[Optional[int], typer.Option(help="only traces whose calls were all sampled by this version")] = None,
    include_unusable: Annotated[bool, typer.Option(help="also trajectories masked out of training")] = False,
    side_calls: Annotated[bool, typer.Option(help="also traces of side calls (titles, quota checks)")] = False,
    prefix: Annotated[Optional[str], typer.Option(help=_PREFIX_HELP)] = None,
    config: Annotated[Optional[Path], typer.Option(help=_CONFIG_HELP)] = None,
) -> None:
    """SFT / offline datasets: one row per trace with input_ids, loss_mask, logprobs, reward (and advantage);
    with --checkpoint, a trained model (a LoRA run's adapter, or merged with --merge)."""
    from infra.reach import require_kafka, require_storage
    from infra.storage import StorageError

    settings = _settings(config, prefix)  # a bad config file is named before anything else is checked
    if checkpoint is not None:
        _export_model(checkpoint, out, merge, base, settings)
        return
    if format is None:
        raise _fail("--format jsonl|parquet (a dataset) or --checkpoint URL (a model) is required", 2)
    if merge or base:
        raise _fail("--merge and --base go with --checkpoint", 2)

    from .tools.export import FORMATS, ExportStats, Filters, rows_from, write_rows
    from producers.kafka_read import ReadError, fresh_group, merged, plan_spans

    if format not in FORMATS:
        raise _fail(f"--format {format!r}: expected one of {', '.join(FORMATS)}", 2)
    if source not in ("trajectories", "groups"):
        raise _fail(f"--source {source!r}: expected trajectories or groups", 2)
    if format == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise _fail("--format parquet needs pyarrow: pip install 'polarstream[export]'", 2) from None
    require_storage(settings, out)
    require_kafka(settings)
    filters = Filters(min_reward, harness, policy_version, include_unusable, side_calls)
    stats = ExportStats()
    try:
        spans = plan_spans(settings, (source,))
        messages = merged(settings, spans, fresh_group("export"))
        write_rows(rows_from(messages, source, filters, stats), format, out, settings, stats)
    except (ReadError, StorageError) as e:
        raise _fail(str(e)) from None
    _json({"out": out, "format": format, "source": settings.topic(source), **stats.to_dict()})


def _export_model(url: str, out: str, merge: bool, base: str | None, settings) -> None:
    from infra.reach import require_storage
    from infra.storage import StorageError
    from trainer.checkpoint import CheckpointError, export_model

    require_storage(settings, url)
    try:
        _json(export_model(url, out, settings, merge=merge, base=base))
    except (CheckpointError, StorageError, OSError) as e:
        raise _fail(str(e).splitlines()[0]) from None


def cat_command(
    topic: Annotated[str, typer.Argument(help="calls | trajectories | groups | tasks | sessions | session-events | policy")],
    limit: Annotated[Optional[int], typer.Option(help="stop after this many records")] = None,
    prefix: Annotated[Optional[str], typer.Option(help=_PREFIX_HELP)] = None,
    config: Annotated[Optional[Path], typer.Option(help=_CONFIG_HELP)] = None,
) -> None:
    """Print a topic's records as JSON lines, packed or JSON on the wire, in (time, partition, offset) order."""
    import orjson

    from infra.reach import require_kafka
    from schemas import document

    from producers.kafka_read import ReadError, fresh_group, merged, plan_spans

    settings = _settings(config, prefix)
    try:
        settings.topic(topic)
    except ValueError as e:
        raise _fail(str(e), 2) from None
    require_kafka(settings)
    shown = bad = 0
    try:
        for msg in merged(settings, plan_spans(settings, (topic,)), fresh_group("cat")):
            if limit is not None and shown >= limit:
                break
            try:
                record = document(msg.value)
            except ValueError as e:
                bad += 1
                typer.echo(f"error: {msg.topic}[{msg.partition}]@{msg.offset}: not a record ({e})", err=True)
                continue
            sys.stdout.write(orjson.dumps(record).decode() + "\n")
            shown += 1
    except ReadError as e:
        raise _fail(str(e)) from None
    if bad:
        raise typer.Exit(1)


def tasks_command(
    tasks_file: Annotated[Path, typer.Argument(help="tasks: JSON lines (TaskRequest or flat rows), .parquet, or Harbor task dirs")],
    check: Annotated[bool, typer.Option("--check", help="score each task's untouched workspace (must be 0) and its "
                                                        "solution/solve.sh applied (must be 1) in the sandbox")] = False,
    runtime: Annotated[str, typer.Option(help="sandbox for --check: auto (a container of the task's image for a task with "
                                              "environment/Dockerfile, else bwrap), bwrap, podman, docker, apptainer")] = "auto",
    jobs: Annotated[int, typer.Option(min=1, help="tasks --check runs at once (image builds and runs overlap)")] = 2,
    force_build: Annotated[bool, typer.Option("--force-build", help="build each task's environment/Dockerfile even where "
                                                                    "its docker_image could be pulled (Harbor's --force-build)")] = False,
    agent_processes: Annotated[str, typer.Option(help="what the solution left running when the verifier opens: kill, or "
                                                      "keep (Harbor's behaviour: tests that query a server it started)")] = "kill",
) -> None:
    """List the tasks a source holds, as polarstream reads them; --check runs each task's oracle.

    In a directory of Harbor tasks each task is read on its own: one that cannot run here (it asks for a
    GPU, its task.toml is malformed, its image can be neither pulled nor built) is refused in its own line
    and the others are listed or checked. A task with an image says how it gets it: pulled, local, built
    (and why, where it names a docker_image: unreachable, absent, force_build), +standin where a FROM
    base is an offline stand-in (gateway/runtimes/image_source.py)."""
    import asyncio
    import tempfile

    if agent_processes not in ("kill", "keep"):
        raise _fail(f"--agent-processes: {agent_processes!r} is not kill or keep", 2)
    from gateway.runtimes import RUNTIMES
    from producers.tasks import with_phase_policies

    if runtime not in RUNTIMES:  # before any task is read: without --check the value was never looked at
        raise _fail(f"--runtime: {runtime!r} is not one of {', '.join(RUNTIMES)}", 2)

    tasks, refused = _read_tasks(tasks_file, force_build)
    tasks = [with_phase_policies(t, agent_processes=agent_processes) for t in tasks]
    plans, tasks, refused = _plan_images(tasks, refused, runtime)
    width = max([len(t.task_id) for t in tasks] + [len(name) for name, _ in refused] + [24]) + 2
    if not check:
        for t in tasks:
            ws = t.workspace.kind + (f" {t.workspace.source}" if t.workspace.source else "")
            image = f"  image {plans[t.task_id].label()}" if t.task_id in plans else ""
            typer.echo(f"{t.task_id:<{width}}workspace {ws}{f' at {t.workspace.mount}' if t.workspace.mount else ''}  "
                       f"evaluator {t.evaluator.kind}  verifier network {_verifier_net(t)}"
                       f"{'  solution' if t.metadata.get('solution') else ''}{image}")
        for name, why in refused:
            typer.echo(f"{name:<{width}}refused: {why}")
        if refused:
            raise _fail(f"{len(refused)} of {len(tasks) + len(refused)} tasks refused")
        return
    from gateway.node.oracle import check_task
    from gateway.runtimes import make_runtime

    try:
        rt = make_runtime(runtime)
    except ValueError as e:
        raise _fail(str(e)) from None
    typer.echo(f"{'task':<{width}}{'solution':<10}{'untouched':<11}{'build s':>8}{'run s':>8}  {'image':<{IMAGE_W}}"
               f"{'verifier net':<14}verdict")
    for name, why in refused:
        typer.echo(f"{name:<{width}}refused: {why}")

    def show(r) -> str:
        return f"{r.reward:g}" if r.reward is not None else "error"

    async def check_all(tmp: Path) -> int:
        gate = asyncio.Semaphore(jobs)

        async def one(i: int, t):
            async with gate:
                return await check_task(t, rt, tmp / str(i))

        runs = [asyncio.ensure_future(one(i, t)) for i, t in enumerate(tasks)]
        bad = 0
        for t, run in zip(tasks, runs):  # printed in the source's order, each as soon as it and those before are done
            res = await run
            bad += not res.ok
            secs = f"{res.seconds.get('build', 0.0):>8.1f}{res.seconds.get('run', 0.0):>8.1f}"
            if res.error:  # the task could not start (its image does not build, its prepare fails): one line
                typer.echo(f"{t.task_id:<{width}}FAILED: {_one_line(res.error.removeprefix('init: '))}")
                continue
            solved = show(res.solved) if res.solved is not None else "none"
            verdict = "ok" if res.ok else "FAILED" + "".join(
                f"; {what}: {_one_line(r.error)[:160]}" for what, r in (("untouched", res.untouched), ("solution", res.solved))
                if r is not None and r.error)
            image = plans[t.task_id].label() if t.task_id in plans else "-"
            typer.echo(f"{t.task_id:<{width}}{solved:<10}{show(res.untouched):<11}{secs}  {image:<{IMAGE_W}}"
                       f"{_verifier_net(t):<14}{verdict}")
        return bad

    with tempfile.TemporaryDirectory(prefix="polar-oracle-") as tmp:
        bad = asyncio.run(check_all(Path(tmp))) + len(refused)
    if bad:
        raise _fail(f"{bad} of {len(tasks) + len(refused)} tasks failed their check (untouched must score 0, the solution 1)")


def _verifier_net(task) -> str:
    """The verifier's network as the table shows it: outside (a Harbor verifier's default in a container) or none."""
    return "outside" if task.evaluator.network == "host" else "none"


def _one_line(text: str) -> str:
    return " ".join(text.split())


IMAGE_W = 28  # the image column: "built:unreachable+standin" and a little


def _read_tasks(source: Path, force_build: bool = False):
    """(tasks, [(name, why refused)]): a directory of Harbor tasks read task by task, anything else whole
    (a source that holds no usable task at all is one ``error:`` line, as before)."""
    from producers.tasks import TaskSourceError, harbor_dirs, harbor_task, load_tasks, split_source

    try:
        path, options = split_source(source)
        force_build = force_build or options.get("force_build", False)
        if not path.is_dir() or len(dirs := harbor_dirs(path)) == 1:
            return load_tasks(path, force_build=force_build), []
    except TaskSourceError as e:
        raise _fail(str(e)) from None
    tasks, refused = [], []
    for d in dirs:
        try:
            tasks.append(harbor_task(d, force_build=force_build))
        except TaskSourceError as e:
            refused.append((d.name, str(e).removeprefix(f"{d.resolve()}: ")))
    return tasks, refused


def _plan_images(tasks: list, refused: list, runtime: str):
    """({task id: ImagePlan}, tasks that can get their image, refused + those that cannot, with why), asked
    of the container engine the check would use; with none installed nothing is asked (no plans)."""
    import asyncio

    from gateway.runtimes import container_engine
    from gateway.runtimes.image_source import plan_images

    imaged = [t for t in tasks if t.environment is not None]
    engine = runtime if runtime in ("podman", "docker") else container_engine()
    if not imaged or not engine:
        return {}, tasks, refused
    plans = dict(zip((t.task_id for t in imaged), asyncio.run(plan_images([t.environment for t in imaged], engine))))
    out = [(t.task_id, plans[t.task_id].why) for t in tasks if t.task_id in plans and plans[t.task_id].refused]
    return plans, [t for t in tasks if not (t.task_id in plans and plans[t.task_id].refused)], refused + out


def register(app: typer.Typer) -> None:
    """Add ``tasks``, ``replay``, ``eval``, ``export`` and ``cat`` to the root command."""
    app.command("tasks")(tasks_command)
    app.command("replay")(replay_command)
    app.command("eval")(eval_command)
    app.command("export")(export_command)
    app.command("cat")(cat_command)
