"""Task sources: a user's tasks, in the forms they come in, as ``TaskRequest`` records.

- **JSONL of TaskRequest**: one record per line, as ``polarstream submit`` always took.
- **Flat JSONL or Parquet**: one task per row, ``instruction``, ``workspace`` (a directory or a git URL,
  optional ``ref``), ``test_cmd`` (exit 0 = solved), optional ``id``, ``setup_cmd`` and ``timeout``
  (the agent's seconds). A row becomes a task whose evaluator runs ``test_cmd`` in the final workspace.
- **Harbor / Terminal-Bench task directories**: ``instruction.md``, ``task.toml``, ``tests/test.sh``,
  optional ``solution/solve.sh``, and ``environment/Dockerfile`` and/or ``[environment] docker_image``. A
  directory holding one task, or holding task directories. As published, the task runs in a container
  of its own image (workspace kind ``image``: the image's WORKDIR, /app by default), with the
  ``[environment]`` limits (``memory = "2G"`` or ``memory_mb``, ``storage = "10G"`` or ``storage_mb``,
  ``cpus``); both the image's name and the Dockerfile's context travel (inline when small text, else by
  its path), and the node pulls or builds as Harbor would (gateway/runtimes/image_source.py). The source
  option ``DIR?force_build=1`` (Harbor's ``--force-build``) builds the Dockerfile even so. A task
  may instead give its workspace as a directory (``workspace/``, or ``[metadata] workspace = "PATH"``):
  then it runs under bwrap with no image. Either way the verifier sees ``tests/`` at /tests and a
  writable /logs/verifier (``gateway/evaluators.py``, kind ``harbor``).

Every problem is a ``TaskSourceError`` of one line that names the file (and line) or directory.
"""

from __future__ import annotations

import errno
import json
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import EnvironmentSpec, EvaluatorSpec, TaskRequest, Timeouts, WorkspaceSpec


class TaskSourceError(ValueError):
    """A task source that cannot be read as tasks; the message is one line naming where."""


FLAT_KEYS = {"id", "task_id", "instruction", "workspace", "ref", "setup_cmd", "test_cmd", "timeout", "num_samples", "metadata"}


SOURCE_OPTIONS = ("force_build",)


def split_source(source: str | Path) -> tuple[Path, dict[str, bool]]:
    """A task source and its options: ``DIR?force_build=1`` is DIR with force_build (a path that exists
    as written, ``?`` and all, is only a path). TaskSourceError for an option there is none of."""
    text = str(source)
    if "?" not in text or Path(text).exists():
        return Path(text), {}
    path, _, query = text.rpartition("?")
    options = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key not in SOURCE_OPTIONS or value.lower() not in ("", "1", "true", "yes", "0", "false", "no"):
            raise TaskSourceError(f"{text}: {part!r} is not a source option (options: {', '.join(f'{o}=1' for o in SOURCE_OPTIONS)})")
        options[key] = value.lower() in ("", "1", "true", "yes")
    return Path(path), options


def load_tasks(source: str | Path, *, force_build: bool = False, **defaults: Any) -> list[TaskRequest]:
    """Every task in ``source`` (a file or directory, module docstring; ``DIR?force_build=1`` or
    ``force_build``: build Harbor tasks' Dockerfiles even where their image could be pulled); ``defaults``
    (e.g. ``num_samples``, ``harness``) fill fields a task does not set itself."""
    path, options = split_source(source)
    force_build = force_build or options.get("force_build", False)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(path))
    if path.is_dir():
        return [harbor_task(d, force_build=force_build, **defaults) for d in harbor_dirs(path)]
    if path.suffix == ".parquet":
        return [_row_task(row, f"{path}: row {i}", defaults, f"{path.stem}-{i}") for i, row in enumerate(_parquet_rows(path), 1)]
    return task_lines(path.read_text(), str(path), **defaults)


def task_lines(text: str, where: str, **defaults: Any) -> list[TaskRequest]:
    """JSON lines of TaskRequest or flat rows (one form per line), read from ``where`` (a name for errors)."""
    tasks = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            tasks.append(_line_task(line, f"{where}:{n}", defaults, f"{Path(where).stem}-{n}"))
    if not tasks:
        raise TaskSourceError(f"{where}: no tasks in it")
    return tasks


def harbor_dirs(root: Path) -> list[Path]:
    """``root`` itself when it is a task, else its task subdirectories (sorted); one line when none."""
    if (root / "instruction.md").is_file():
        return [root]
    found = sorted(d for d in root.iterdir() if d.is_dir() and (d / "instruction.md").is_file())
    if not found:
        raise TaskSourceError(f"{root}: not a Harbor task directory (no instruction.md in it or in its subdirectories)")
    return found


def harbor_task(task_dir: Path, *, force_build: bool = False, **defaults: Any) -> TaskRequest:
    """One Harbor task directory as a TaskRequest (module docstring)."""
    task_dir = task_dir.resolve()
    where = str(task_dir)
    toml_path = task_dir / "task.toml"
    try:
        conf = tomllib.loads(toml_path.read_text()) if toml_path.is_file() else {}
    except tomllib.TOMLDecodeError as e:
        raise TaskSourceError(f"{toml_path}: not valid TOML ({e})") from None
    meta, env, verifier, agent = (conf.get(k) or {} for k in ("metadata", "environment", "verifier", "agent"))
    test_sh = task_dir / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskSourceError(f"{where}: no tests/test.sh (the verifier Harbor runs)")
    if env.get("gpus"):
        raise TaskSourceError(f"{where}: needs {env['gpus']} GPU(s) ([environment] gpus); polarstream's sandbox has none")
    workspace = _harbor_workspace(task_dir, meta)
    environment = None if workspace else _harbor_environment(task_dir, env, force_build)
    name = str((conf.get("task") or {}).get("name") or task_dir.name)
    try:
        return TaskRequest.model_validate({
            **defaults,
            "task_id": re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or task_dir.name,
            "instruction": (task_dir / "instruction.md").read_text(),
            "workspace": WorkspaceSpec(kind="dir" if workspace else "image" if environment else "empty",
                                       source=str(workspace or ""),
                                       mount=str(meta.get("workdir") or _dockerfile_workdir(task_dir) or "/app")),
            "environment": environment,
            "evaluator": EvaluatorSpec(kind="harbor", command="bash /tests/test.sh", tests=_text_tree(task_dir / "tests"),
                                       timeout_s=float(verifier.get("timeout_sec") or 600.0),
                                       network=_verifier_network(verifier, env, environment is not None),
                                       env={str(k): str(v) for k, v in (verifier.get("env") or {}).items()}),
            "timeouts": Timeouts(**({"agent_s": float(agent["timeout_sec"])} if agent.get("timeout_sec") else {})),
            "metadata": {**defaults.get("metadata", {}), "source": "harbor", "task_dir": where,
                         **({"solution": str(task_dir / "solution")} if (task_dir / "solution").is_dir() else {})},
        })
    except (ValidationError, ValueError) as e:
        raise TaskSourceError(f"{where}: {_first_error(e)}") from None


def _verifier_network(verifier: dict, env: dict, in_container: bool) -> str:
    """The verifier's network as Harbor gives it: ``allow_internet`` (default true) for the whole trial. Ours
    is per phase (the agent's stays off unless the task sets allow_internet), so published verifiers, which
    install curl, uv and pytest first, can run. Only a container can give the outside without the host's
    loopback: a task run under bwrap (a ``workspace/`` of ours) gets it only when it says network_mode = "public"."""
    mode = verifier.get("network_mode")
    if mode is not None:
        return "host" if mode == "public" else "none"
    return "host" if in_container and env.get("allow_internet", True) is not False else "none"


def with_phase_policies(task: TaskRequest, agent_network: str = "task", agent_processes: str = "kill") -> TaskRequest:
    """``task`` under an experiment's network and process policies: ``agent_network`` task (as task.toml says),
    gateway (none but the gateway) or internet (the outside too; a container task only); ``agent_processes``
    kill or keep what the agent left running when the verifier opens."""
    update: dict[str, Any] = {}
    if task.environment is not None and agent_network != "task":
        update["environment"] = task.environment.model_copy(update={"allow_internet": agent_network == "internet"})
    if agent_processes != task.evaluator.agent_processes:
        update["evaluator"] = task.evaluator.model_copy(update={"agent_processes": agent_processes})
    return task.model_copy(update=update) if update else task


def _harbor_workspace(task_dir: Path, meta: dict) -> Path | None:
    """The task's workspace directory, when it gives one (our layout; a published task has none)."""
    given = meta.get("workspace")
    if given:
        ws = (task_dir / str(given)).resolve()
        if not ws.is_dir():
            raise TaskSourceError(f"{task_dir}: [metadata] workspace = {given!r} is not a directory")
        return ws
    if (task_dir / "workspace").is_dir():
        return task_dir / "workspace"
    return None


INLINE_CONTEXT_BYTES = 256 * 1024  # a larger or binary build context travels by its path instead


def _harbor_environment(task_dir: Path, env: dict, force_build: bool = False) -> EnvironmentSpec | None:
    """``environment/`` and ``[environment]`` as an EnvironmentSpec (None: the task has no image). Both
    the image's name and the Dockerfile's context are kept: which one is used is decided where the task
    runs (gateway/runtimes/image_source.py), as Harbor decides it."""
    context_dir = task_dir / "environment"
    image = str(env.get("docker_image") or "")
    dockerfile = (context_dir / "Dockerfile").is_file()
    if not image and not dockerfile:
        return None
    context: dict[str, str] = {}
    if dockerfile:
        files = [p for p in sorted(context_dir.rglob("*")) if p.is_file()]
        if sum(p.stat().st_size for p in files) <= INLINE_CONTEXT_BYTES:
            try:
                context = {str(p.relative_to(context_dir)): p.read_text() for p in files}
            except UnicodeDecodeError:
                context = {}
    cpus, memory, storage = _cpus(env.get("cpus"), task_dir), _size_mb(env, "memory", task_dir), _size_mb(env, "storage", task_dir)
    try:
        return EnvironmentSpec(
            image=image, context=context, context_dir=str(context_dir) if dockerfile and not context else "",
            cpus=cpus, memory_mb=memory, storage_mb=storage, force_build=force_build,
            build_timeout_s=float(env.get("build_timeout_sec") or 600.0), allow_internet=bool(env.get("allow_internet", False)))
    except (ValidationError, ValueError) as e:
        raise TaskSourceError(f"{task_dir}: [environment] {_first_error(e)}") from None


def _size_mb(env: dict, key: str, task_dir: Path) -> int | None:
    """``<key>_mb`` (Harbor's template) or ``<key> = "2G"`` (Terminal-Bench 2.0's spelling), in MB as
    Harbor reads them (G = 1024 M); both given must agree."""
    mb, text = env.get(f"{key}_mb"), env.get(key)
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int)):
        raise TaskSourceError(f"{task_dir}: [environment] {key}_mb = {mb!r} is not a whole number of MB")
    if text is None:
        return mb
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])i?B?\s*", text, re.I) if isinstance(text, str) else None
    if not m:
        raise TaskSourceError(f"{task_dir}: [environment] {key} = {text!r} is not a size like '2G' or '512M'")
    parsed = int(float(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 2**20}[m.group(2).upper()])
    if mb is not None and mb != parsed:
        raise TaskSourceError(f"{task_dir}: [environment] {key} = {text!r} and {key}_mb = {mb} disagree; give one")
    return parsed


def _cpus(value: Any, task_dir: Path) -> float | None:
    """``cpus = 1`` (or 1.5); a string of a number as well, since TOML writers differ."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TaskSourceError(f"{task_dir}: [environment] cpus = {value!r} is not a number") from None


def _dockerfile_workdir(task_dir: Path) -> str:
    dockerfile = task_dir / "environment" / "Dockerfile"
    if not dockerfile.is_file():
        return ""
    found = re.findall(r"^\s*WORKDIR\s+(\S+)\s*$", dockerfile.read_text(), re.M | re.I)
    return found[-1] if found and found[-1].startswith("/") else ""


def _text_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            try:
                out[str(p.relative_to(root))] = p.read_text()
            except UnicodeDecodeError:
                raise TaskSourceError(f"{p}: not UTF-8 text (tests/ travels inside the task record)") from None
    return out


def _line_task(line: str, where: str, defaults: dict, fallback_id: str) -> TaskRequest:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskSourceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise TaskSourceError(f"{where}: expected a JSON object")
    return _row_task(data, where, defaults, fallback_id) if "test_cmd" in data else _validate({**defaults, **data}, where)


def _row_task(row: dict, where: str, defaults: dict, fallback_id: str) -> TaskRequest:
    """A flat row (``instruction``, ``workspace``, ``test_cmd``...) as a TaskRequest (id: ``fallback_id`` when it has none)."""
    unknown = set(row) - FLAT_KEYS
    if unknown:
        raise TaskSourceError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (flat tasks take {', '.join(sorted(FLAT_KEYS))})")
    for key in ("instruction", "test_cmd"):
        if not row.get(key):
            raise TaskSourceError(f"{where}: {key}: missing")
    ws = str(row.get("workspace") or "")
    is_git = ws.endswith(".git") or ws.startswith(("https://", "http://", "git@", "ssh://"))
    if ws and not is_git and not Path(ws).is_dir():
        raise TaskSourceError(f"{where}: workspace: {ws!r} is not a directory or a git URL")
    task: dict[str, Any] = {
        **defaults,
        "task_id": str(row.get("id") or row.get("task_id") or fallback_id),
        "instruction": row["instruction"],
        "workspace": {"kind": "git" if is_git else "dir", "source": ws if is_git else str(Path(ws).resolve()),
                      "ref": str(row.get("ref") or "")} if ws else {"kind": "empty"},
        "prepare": [row["setup_cmd"]] if row.get("setup_cmd") else [],
        "evaluator": {"kind": "command", "command": row["test_cmd"]},
        "metadata": {**defaults.get("metadata", {}), **(row.get("metadata") or {}), "source": "flat"},
    }
    if row.get("timeout"):
        task["timeouts"] = {"agent_s": float(row["timeout"])}
    if row.get("num_samples"):
        task["num_samples"] = int(row["num_samples"])
    return _validate(task, where)


def _validate(data: dict, where: str) -> TaskRequest:
    try:
        return TaskRequest.model_validate(data)
    except ValidationError as e:
        raise TaskSourceError(f"{where}: {_first_error(e)}") from None


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        return f"{field}: {err['msg']}" if field else err["msg"]
    return str(e).splitlines()[0]


def _parquet_rows(path: Path) -> Iterable[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors have no common base worth naming
        raise TaskSourceError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return table.to_pylist()
