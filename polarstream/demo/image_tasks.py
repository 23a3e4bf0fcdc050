"""The demo's arith family as published tasks: Harbor task directories that each bring an image.

    .venv/bin/python -m polarstream.demo.image_tasks OUT_DIR [--seed 0] [--heldout 16] [--n N]

writes OUT_DIR/train/<id>/ and OUT_DIR/heldout/<id>/, the demo's split (arith.split) of the 81 sums, as
Harbor lays a task out: ``instruction.md`` (the demo's instruction, word for word, so the demo's warm
start knows it), ``task.toml``, ``environment/Dockerfile`` (one content for every task, so it builds
once), ``tests/test.sh`` (the demo's test of answer.txt, its outcome written to /logs/verifier/reward.txt)
and ``solution/solve.sh``. ``polarstream run`` takes either folder as a task source (train:, eval:), and
``runtime: auto`` runs each session in a container of the image (podman or docker).

``image_preset`` is the demo's preset (polarstream/demo/preset.py: its harness settings, its warm start of
the tiny model, its report line) on these tasks instead of its workspace tasks, for ``polarstream.driver.run``:
the same run as the demo's, every session in a container.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import arith

if TYPE_CHECKING:
    from polarstream.driver.config import RunConfig
    from polarstream.driver.preset import MakePreset, Preset

# Every task's build context: the same bytes, so the image is built once (images.py keys it by content).
# The builtin harness runs with the image's python3: Debian's slim image has none, so it is installed
# where missing (the offline stand-in, gateway/runtimes/images.py, has it already).
DOCKERFILE = """\
FROM debian:bookworm-slim
RUN command -v python3 >/dev/null || (apt-get update && apt-get install -y --no-install-recommends python3 \\
    && rm -rf /var/lib/apt/lists/*)
WORKDIR /app
"""

TASK_TOML = """\
version = "1.0"

[metadata]
family = "arith"
question = "{question}"

[agent]
timeout_sec = 60.0

[verifier]
timeout_sec = 10.0

[environment]
build_timeout_sec = 600.0
memory_mb = 512
# Harbor's switch for the whole trial: the test reads a file, so neither phase needs the outside (and the
# session's container starts without a network, instead of on the bridge, cut off, reconnected to verify)
allow_internet = false
"""

# The demo's evaluator (arith._problem): answer.txt, spaces and newlines dropped, is the sum
TEST_SH = """\
#!/bin/bash
# The demo's test (polarstream/demo/arith.py): /app/answer.txt, spaces and newlines dropped, is {answer}.
if [ "$(tr -d ' \\n' < /app/{file} 2>/dev/null)" = {quoted} ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

SOLVE_SH = """\
#!/bin/bash
printf '%s' {quoted} > /app/{file}
"""


def task_name(question: str) -> str:
    """A task's directory name and id: "3 + 5" -> "add-3-5"."""
    return "add-" + "-".join(re.findall(r"\d+", question))


def write_task(task_dir: Path, question: str, answer: str) -> Path:
    """One problem as a Harbor task directory (module docstring)."""
    shutil.rmtree(task_dir, ignore_errors=True)
    for sub in ("environment", "tests", "solution"):
        (task_dir / sub).mkdir(parents=True)
    # no newline after it: the prompt is the demo's to the character (the warm start was taught on it)
    (task_dir / "instruction.md").write_text(arith.instruction(question))
    (task_dir / "task.toml").write_text(TASK_TOML.format(question=question))
    (task_dir / "environment" / "Dockerfile").write_text(DOCKERFILE)
    quoted = shlex.quote(answer)
    for path, text in ((task_dir / "tests" / "test.sh", TEST_SH), (task_dir / "solution" / "solve.sh", SOLVE_SH)):
        path.write_text(text.format(answer=answer, quoted=quoted, file=arith.ANSWER_FILE))
        path.chmod(0o755)
    return task_dir


def write_tasks(out_dir: Path, seed: int = 0, heldout: int = 16, n: int | None = None) -> tuple[Path, Path]:
    """The demo's split for ``seed`` as task directories: (out_dir/train, out_dir/heldout). ``n``: only the
    first n train problems and n // 4 held-out ones (at least 1), for a quick run."""
    train, held = arith.split(seed, heldout)
    if n is not None:
        train, held = train[:n], held[:max(1, n // 4)]
    dirs = out_dir / "train", out_dir / "heldout"
    for d, problems in zip(dirs, (train, held)):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for question, answer in problems:
            write_task(d / task_name(question), question, answer)
    return dirs


def image_preset(tasks_dir: Path | None = None, n: int | None = None) -> "MakePreset":
    """The demo's preset (its harness, warm start and report) on the image tasks of ``write_tasks`` for the
    run's seed and held-out count, written to ``tasks_dir`` (default RUN_DIR/tasks); ``n`` as there."""

    def make(cfg: "RunConfig") -> "Preset":
        from producers.tasks import load_tasks

        from .preset import arith_preset

        demo = arith_preset(cfg)
        train_dir, held_dir = write_tasks(tasks_dir or cfg.run_dir / "tasks", cfg.seed, cfg.heldout, n)
        return replace(demo, train=load_tasks(train_dir), heldout=load_tasks(held_dir))

    return make


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m polarstream.demo.image_tasks",
                                     description="Write the demo's arith family as Harbor task directories that "
                                                 "bring an image: OUT_DIR/train and OUT_DIR/heldout.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="the split's seed (the demo's seed)")
    parser.add_argument("--heldout", type=int, default=16, help="problems held out (the demo's 16)")
    parser.add_argument("--n", type=int, default=None, help="only the first N train problems and N/4 held-out ones")
    args = parser.parse_args(argv)
    train, held = write_tasks(args.out_dir, args.seed, args.heldout, args.n)
    print(f"{train}: {sum(1 for _ in train.iterdir())} tasks; {held}: {sum(1 for _ in held.iterdir())} tasks")


if __name__ == "__main__":
    main()
