"""What a run of the driver is: ``RunConfig``.

``polarstream run`` reads an experiment file (experiment.py) into a RunConfig (configure.py), and the demo
is such a file shipped with the package (polarstream/demo/demo.yaml); the loop (loop.py) runs it with the
preset that hands it its tasks (preset.py), and the report (report.py) writes what it gave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from schemas import TaskRequest


@dataclass
class RunConfig:
    """One run of the driver (loop.py): a user's experiment file as configure.py reads it into this, or the
    demo's. The warm-start settings (``sft_*``, ``p_tool``, ``shape_sft_steps``, ``min_pass_rate``) are the
    arith preset's (polarstream/demo/): the driver passes them through to its hooks and the report."""

    name: str = "demo"  # the experiment's name: on the console, in the report and on the reward plot
    steps: int = 24
    tasks_per_step: int = 4
    samples: int = 8
    heldout: int = 16  # problems of the family kept out of RL, evaluated before and after training
    heldout_samples: int = 4  # samples per held-out problem (pass@1 is their mean)
    harness: str = "builtin"
    api: str = "anthropic"  # the API a real CLI speaks where it has a choice (shape.APIS)
    shape_sft_steps: int = 150  # a real CLI's warm start: steps in its shape, on top of the built-in one
    runtime: str = "auto"  # auto: podman for tasks that bring an image, bwrap for the others (subprocess without bwrap)
    site_settings: str = "auto"  # the host's CA, proxies and package index into task containers (off: not)
    seed: int = 0
    lr: float = 5e-4
    temperature: float = 1.0
    sft_steps: int = 500  # at 300 the tiny model still added wrongly 12-22% of the time (README)
    sft_lr: float = 3e-3
    sft_batch: int = 16  # harness conversations per warm-start step
    sft_drills: int = 64  # short drills of the sums per warm-start step
    p_tool: float = 0.25
    min_pass_rate: float = 0.03  # a warm start whose train pass rate is lower gives RL too little to learn from
    step_timeout_s: float = 300.0
    async_level: int = 0  # S: steps sampled ahead of the served policy (schedule.py); 0 = on-policy
    eval_every: int = 0  # held-out eval every N steps as well as before and after
    task_set: str = "demo-arith"
    # A user's own run (polarstream run): their model and tasks instead of a preset's warm start and tasks
    model: str = ""  # the local model directory every component loads (infra.models.local_model_dir): no warm start
    train_tasks: list[TaskRequest] | None = None  # templates: each step draws tasks_per_step of them (None: the preset's)
    eval_tasks: list[TaskRequest] | None = None
    harness_config: dict = field(default_factory=dict)
    # The run's name on Kafka and in storage. Given (polarstream run), the same command continues the run
    # after a crash: it reads where the run stands back from the topics. Empty: a new run every time.
    run_id: str = ""
    order: str = "draws"  # which tasks a step trains (schedule.py step_batches): draws or epochs
    # --driver-only: the components run elsewhere; {"rollout": URL, "engine": URL} is all the driver needs
    attach: dict[str, str] = field(default_factory=dict)
    trainer_settings: dict[str, str] = field(default_factory=dict)  # more trainer --set key=value (polarstream run)
    loss: str = "ppo_clip"  # the trainer's loss and correction (trainer/corrections.py)
    correction: str = "none"
    std_normalize: bool = True  # false: the streams compute r - mean (--advantage no_std)
    overlong: dict = field(default_factory=dict)  # {max_tokens, buffer, penalty}: the streams' overlong shaping
    engine_logit_noise: float = 0.0  # the engine's --logit-noise
    engine_dtype: str = "float32"  # the engine's --dtype (bfloat16: a reduced-precision mismatch)
    lora: dict = field(default_factory=dict)  # the experiment's lora: {rank, alpha, dropout, target_modules}; {}: full weights
    min_completion: float = 0.5  # a group counts once this fraction of its samples is usable
    early_stop_at: float = 0.0  # > 0: cancel a group's stragglers once this fraction is usable
    zero_signal: str = "mask"  # groups without signal: mask, or replace (drop; another task in each one's place)
    replace_cap: int = 8  # replace: replacements a step may drop again; later ones are masked
    wandb: dict = field(default_factory=dict)  # {project, entity, mode}: also log to Weights & Biases
    retire: str = "none"  # curriculum: stop drawing tasks always solved, never solved, or both (schedule.py)
    retire_after: int = 2  # ... judged on their last this many groups
    # --only: start these of components.COMPONENTS here and drive nothing (the rest, and the driver, run elsewhere: their
    # URLs are in attach); they serve the ports of their URLs in attach, so the other machines find them
    only: frozenset[str] = frozenset()
    # The trainer's processes (the file's trainer: nproc, nodes, rendezvous): more than one runs it under torchrun
    # (FSDP2). nodes > 1: each machine starts nproc of them with --only trainer --node-rank R (this one's R), and
    # rank 0's machine hosts the rendezvous at host:port (torchrun's static rendezvous: node 0 is global rank 0).
    trainer_nproc: int = 1
    trainer_nodes: int = 1
    trainer_rendezvous: str = ""
    node_rank: int = 0
    run_dir: Path = field(default_factory=lambda: Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
