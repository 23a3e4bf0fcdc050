"""The demo, every session in a container: its arith family as tasks that bring an image.

    .venv/bin/python examples/image_arith.py [RUN_DIR] [--seed N] [--steps N]

is ``polarstream demo`` (polarstream/demo/demo.yaml: 24 on-policy steps of 4 problems x 8 samples, the
held-out problems before and after, the built-in harness, the warm-started tiny model) on the same problems
written as Harbor task directories (polarstream/demo/image_tasks.py, into RUN_DIR/tasks): each brings
environment/Dockerfile, so ``runtime: auto`` runs every session in a container of that image (podman or
docker; built once, the first session waits for it) and the verifier, tests/test.sh, in the same container
afterwards. Needs podman (`make system`). Starts Kafka and S3 as `polarstream run` does.

Your own published tasks need no script: `python -m polarstream.demo.image_tasks OUT_DIR` writes these,
and an experiment file with ``train: OUT_DIR/train``, ``eval: OUT_DIR/heldout`` and a model of your own
runs them (`polarstream run`); this script adds the demo's warm start, which knows the family.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from polarstream.demo.image_tasks import image_preset
from polarstream.demo.preset import demo_experiment
from polarstream.driver.configure import run_config
from polarstream.driver.loop import run_experiment


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/image-arith"))
    parser.add_argument("--seed", type=int, default=None, help="the demo's seed (0)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps (the demo's 24)")
    args = parser.parse_args(argv)
    exp = demo_experiment(name="image-arith", seed=args.seed, max_steps=args.steps)
    preset = image_preset()
    cfg = run_config(exp, args.run_dir, preset=preset)  # checks the runtime: the tasks bring an image
    path = run_experiment(exp, cfg, preset=preset)
    if path is not None:
        print(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if not isinstance(v, (dict, list))}))
    return path


if __name__ == "__main__":
    main()
