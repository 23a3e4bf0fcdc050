"""The experiment file: one YAML that describes an RL run, validated by one pydantic model.

``polarstream run exp.yaml`` reads it; ``polarstream run [exp.yaml] --print-config`` prints every field with
its meaning and the file's value (the default where it sets none). An unknown key, a bad value or a task
source that is not there is one line naming the field; what needs more than the file to check (the model,
the tasks themselves, the harness, the runtime) configure.py checks before anything starts. Task sources
are those of ``producers/tasks.py`` (JSONL, Parquet, Harbor directories; the rollout side's ``polarstream
submit`` reads them too) plus ``BUILTIN_SOURCES``: a preset's tasks, which the CLI's registry
(polarstream/presets.py) maps to the preset (``builtin:arith``: the demo's family, split by ``seed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# The task sources a preset provides (train, and its held-out split); polarstream/presets.py maps them
BUILTIN_SOURCES = ("builtin:arith", "builtin:arith-heldout")


class ExperimentError(ValueError):
    """An experiment file that cannot run; the message is one line naming the file and field."""


class WandbSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("polarstream", description="the W&B project")
    entity: str | None = Field(None, description="the W&B entity (team or user); None: your default")
    mode: Literal["offline", "online"] = Field("offline", description="offline writes RUN_DIR/wandb for `wandb sync`")


class OverlongSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(..., gt=0, description="a trajectory's sampled-token budget L_max")
    buffer: int = Field(..., gt=0, description="the last this many tokens of it (L_cache) lose reward linearly")
    penalty: float = Field(1.0, ge=0, description="the reward lost at L_max and beyond")

    @model_validator(mode="after")
    def _fits(self) -> "OverlongSettings":
        if self.buffer > self.max_tokens:
            raise ValueError(f"buffer: {self.buffer} is more than max_tokens {self.max_tokens}")
        return self


class LoraSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, description="the adapter's rank")
    alpha: int = Field(32, gt=0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(default_factory=list, description="module names adapted; [] = every attention "
                                      "and MLP projection (q, k, v, o, gate, up, down _proj)")


class SlurmSettings(BaseModel):
    """``polarstream run --launcher slurm``: what the sbatch script asks of the cluster (polarstream/driver/slurm.py)."""

    model_config = ConfigDict(extra="forbid")

    partition: str = Field("", description="#SBATCH --partition ('' = the cluster's default)")
    account: str = Field("", description="#SBATCH --account ('' = your default)")
    time: str = Field("", description="#SBATCH --time, e.g. 4:00:00 ('' = the partition's limit)")
    nodes: int = Field(1, ge=1, description="#SBATCH --nodes: the engine, gateway node, streams and rollout server "
                       "run on the first, the trainer on the last trainer.nodes of them")
    exclusive: bool = Field(True, description="#SBATCH --exclusive: whole nodes (every component's threads on them)")
    engine_gpus: int = Field(0, ge=0, description="GPUs of the engine's step (srun --gpus; the job asks for them too)")
    trainer_gpus: int = Field(0, ge=0, description="GPUs of the trainer's step on each of its nodes (srun "
                              "--gpus-per-node; trainer.nproc processes share them)")
    python: str = Field("", description="the Python with polarstream installed on the nodes ('' = the one that "
                        "renders the script: a venv on a filesystem the nodes share)")
    sbatch: list[str] = Field(default_factory=list, description="more #SBATCH options, as given to sbatch (e.g. --qos=high)")


class KubernetesSettings(BaseModel):
    """``polarstream run --launcher k8s``: what the manifests ask of the cluster (polarstream/driver/k8s.py)."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field("polarstream:latest", description="the project's image as the cluster pulls it (polarstream "
                       "images project builds it; push it to the cluster's registry)")
    namespace: str = Field("", pattern=r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$",
                           description="every object's namespace ('' = kubectl's current one)")
    nodes: int = Field(1, ge=1, description="gateway-node replicas (a Deployment: each takes sessions from Kafka)")
    streams: int = Field(1, ge=1, description="stream-worker replicas (a Deployment: Faust shares the partitions)")
    engine_gpus: int = Field(0, ge=0, description="nvidia.com/gpu the engine's pod requests (0: a CPU engine)")
    trainer_gpus: int = Field(0, ge=0, description="nvidia.com/gpu each trainer pod requests (one per process: "
                              "trainer: nproc)")
    model_claim: str = Field("", description="a PersistentVolumeClaim holding model:'s directory, mounted read-only "
                             "at its path in every pod that loads it ('' = the image has it, or model: is built in)")
    kafka_image: str = Field("apache/kafka:4.4.0", description="the in-cluster broker's image (unused where "
                             "POLAR_KAFKA_BOOTSTRAP names an external Kafka)")
    s3_image: str = Field("andrewgaul/s3proxy:s3proxy-4.1.0", description="the in-cluster S3 server's image (unused "
                          "where POLAR_S3_ENDPOINT names an external one)")


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9._-]{1,80}$",
                      description="run name: the topic namespace and checkpoint folder start with it (letters, digits, . _ -); "
                      "the same file and --run-dir again continue a killed run")
    model: str = Field("builtin:arith", description="a built-in model (tiny, tiny:SEED, smollm2), a local HF model "
                       "directory (relative to this file), or a hub id already in the local HF cache (nothing is "
                       "downloaded); builtin:arith = the demo's tiny model after its cached warm start on the arith family")
    harness: str = Field("builtin", description="the agent harness every session runs: builtin, pi, qwen_code, claude_code, "
                         "gemini_cli, opencode, codex")
    harness_config: dict[str, Any] = Field(default_factory=dict, description="the harness's own settings (e.g. api: chat for pi)")
    runtime: Literal["auto", "bwrap", "subprocess", "podman", "docker"] = Field(
        "auto", description="the sandbox sessions run in. auto: a task that brings an image (a Harbor task's "
        "environment/Dockerfile) runs in a container of it (podman, else docker), any other task under bwrap when it "
        "works here (else unsandboxed); bwrap and subprocess run no image; podman and docker run only image tasks")
    site_settings: Literal["auto", "off"] = Field(
        "auto", description="auto: the host's CA bundle, proxies and package index (pip config) go into task image "
        "builds and task containers, where it has them (a TLS proxy's CA, a mirror: docs/rollout.md, air-gapped "
        "sites); off: none of them")
    train: str = Field("builtin:arith", description="task source RL trains on: a JSONL file (TaskRequest or flat rows), "
                       "a .parquet file, a Harbor task directory (or a directory of them; DIR?force_build=1 builds their "
                       "Dockerfiles even where their docker_image could be pulled), or builtin:arith")
    eval: str = Field("builtin:arith-heldout", description="task source evaluated before training, every eval_every "
                      "steps and after the last; '' = no evaluation")
    group_size: int = Field(8, ge=1, le=1024, description="samples per task (the GRPO group)")
    groups_per_step: int = Field(4, ge=1, description="task groups per trainer step")
    async_level: int = Field(0, ge=0, le=16, description="S: how many steps' groups may be sampled ahead of the published "
                             "policy; at most S+1 steps are in flight, and the trainer drops groups more than S versions "
                             "behind. 0 = on-policy: a step's tasks go out once the previous step's weights are served")
    order: Literal["epochs", "draws"] = Field("epochs", description="which tasks a step trains: epochs = every train task "
                                              "once per epoch, in a shuffle seeded by seed and the epoch; draws = "
                                              "groups_per_step draws with replacement a step (the demo's order)")
    epochs: int = Field(0, ge=0, description="order: epochs only: stop after this many passes over the train tasks "
                        "(fewer steps than max_steps when they come first; 0: max_steps decides)")
    zero_signal: Literal["mask", "replace"] = Field("mask", description="groups whose samples all scored the same: mask "
                                                    "(they close the step but move no weight) or replace (DAPO's dynamic "
                                                    "sampling: the trainer drops them and another task goes out in each "
                                                    "one's place)")
    replace_cap: int = Field(8, ge=0, description="zero_signal: replace only: replacements a step may drop and replace "
                             "again; later ones are masked, so a step always closes")
    agent_network: Literal["task", "gateway", "internet"] = Field(
        "task", description="the agent's network in a task's container: task (none but the gateway, unless its "
        "task.toml sets allow_internet = true), gateway (none but the gateway, whatever the task says) or internet "
        "(the outside too: an RL policy that can reach it can fetch answers). The verifier's is the task's own "
        "(docs/rollout.md, \"The verifier's network\")")
    agent_processes: Literal["kill", "keep"] = Field(
        "kill", description="what the agent left running in its container when the verifier opens: kill, or keep "
        "(Harbor's behaviour, for tests that query a server the agent started)")
    retire: Literal["none", "solved", "unsolved", "both"] = Field("none", description="curriculum: stop drawing a train "
                                                                  "task whose last retire_after groups were all solved "
                                                                  "(every sample 1), all unsolved (every sample 0), or either")
    retire_after: int = Field(2, ge=1, description="retire: how many of a task's latest groups decide")
    min_completion: float = Field(0.5, gt=0, le=1, description="a group counts once this fraction of its samples "
                                  "finished usable (rounded down, at least 1); the rest are masked. A task that sets its "
                                  "own min_valid keeps it")
    early_stop_at: float = Field(0.0, ge=0, le=1, description="straggler early stop: once this fraction of a group's "
                                 "samples finished usable, cancel the rest (0: never; at least min_completion). A task "
                                 "that sets its own early_stop keeps it")
    eval_every: int = Field(0, ge=0, description="evaluate every N trained steps as well (0: before and after only)")
    eval_samples: int = Field(4, ge=1, description="samples per eval task (pass@1 is their mean)")
    heldout: int = Field(16, ge=1, description="builtin:arith only: problems kept out of training for builtin:arith-heldout")
    max_steps: int = Field(24, ge=1, description="trainer steps to run")
    seed: int = Field(0, description="fixes the model's warm start, the task order and the sampling seeds")
    lr: float = Field(5e-4, gt=0, description="the trainer's learning rate")
    temperature: float = Field(1.0, gt=0, description="sampling temperature, pinned on every call and used by the trainer")
    loss: Literal["ppo_clip", "gspo", "cispo"] = Field("ppo_clip", description="the policy loss: ppo_clip (clip-higher "
                                                      "and dual clip), gspo (sequence-level ratio and clip), cispo "
                                                      "(clipped stop-gradient IS weight); thresholds in trainer: "
                                                      "(gspo_clip_low, cispo_clip_high, ...; docs/trainer.md)")
    correction: Literal["none", "tis", "icepop", "token_rs", "seq_mask_geo", "seq_mask_arith"] = Field(
        "none", description="engine/trainer mismatch correction on pi_prox / pi_rollout: tis (needs trainer: "
        "tis_cap), icepop (weight rho in the token band icepop_low..icepop_high, 0 outside), token_rs (1 in that "
        "band, 0 outside), seq_mask_geo / seq_mask_arith (trajectory mean ratio band seq_mask_low..seq_mask_high); "
        "the loss ratio's base is trainer: ratio_base (behaviour by default; proximal: decoupled PPO)")
    std_normalize: bool = Field(True, description="divide a group's advantages by its reward std (GRPO); false: "
                                "r - mean (Dr. GRPO), which the streams compute")
    overlong: OverlongSettings | None = Field(None, description="DAPO's soft overlong punishment {max_tokens, buffer, "
                                              "penalty}, applied by the streams to each trajectory's reward")
    engine_logit_noise: float = Field(0.0, ge=0, description="the engine adds N(0, sigma^2) noise to its logits "
                                      "(engine --logit-noise): a controlled engine/trainer mismatch, to see the "
                                      "corrections work; 0: off")
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the engine's weights and matmuls (engine --dtype): bfloat16 against the trainer's "
        "float32 is the reduced-precision mismatch a real bf16 engine has, on CPU too")
    trainer: dict[str, Any] = Field(default_factory=dict, description="more TrainConfig settings (trainer/config.py), "
                                    "each passed as --set key=value; not those this file sets itself (lr, "
                                    "max_staleness via async_level, ...); and how it is launched: nproc (processes "
                                    "per machine: torchrun, FSDP2), nodes and rendezvous (host:port of node 0's "
                                    "machine; the others run --only trainer --node-rank R)")
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter on the frozen model instead of every "
                                      "weight (trainer/lora.py); the engines serve each policy version's adapter by name. "
                                      "LoRA wants a larger lr than full fine-tuning (the demo's --lora: 16, 32, lr 1.5e-3)")
    wandb: WandbSettings | None = Field(None, description="also log each step's reward and each eval to Weights & "
                                       "Biases (needs pip install wandb); TensorBoard always gets them, in RUN_DIR/tb")
    run_id: str = Field("", pattern=r"^[A-Za-z0-9._-]{0,120}$", description="the run's id on Kafka and in storage; "
                        "'' = the name and a digest of this file and --run-dir (the same command continues a killed run)")
    rollout_url: str = Field("", description="--driver-only: the rollout server of components that run elsewhere")
    engine_url: str = Field("", description="--driver-only: an engine of that run (the policy version it serves, its stats); "
                            "--only engine: where it serves")
    gateway_url: str = Field("", description="--only: the run's gateway node (where the node serves, or the one the "
                             "trainer stamps its policy version on); --driver-only: a LoRA run's (its stamp names the "
                             "adapter's version)")
    storage_url: str = Field("", description="checkpoints (s3://bucket/prefix or file://...); '' = the local S3 server")
    slurm: SlurmSettings | None = Field(None, description="--launcher slurm: the sbatch script's partition, account, "
                                        "time, nodes, the engine's GPUs (docs/deploy.md)")
    kubernetes: KubernetesSettings | None = Field(None, description="--launcher k8s: the image, namespace, replicas "
                                                  "of the gateway node and stream worker, GPUs (docs/deploy.md)")
    step_timeout_s: float = Field(300.0, gt=0, description="a step whose groups are not trained within this many seconds "
                                  "(times S+1) stops the run")

    @model_validator(mode="after")
    def _sources(self) -> "Experiment":
        for field in ("train", "eval"):
            source = getattr(self, field)
            # DIR?force_build=1: a task source with its options (producers/tasks.py split_source)
            if source and not source.startswith("builtin:") and not Path(source).exists() and not Path(source.partition("?")[0]).exists():
                raise ValueError(f"{field}: {source!r}: no such file or directory")
            if source.startswith("builtin:") and source not in BUILTIN_SOURCES:
                raise ValueError(f"{field}: {source!r}: the built-in sources are {', '.join(BUILTIN_SOURCES)}")
        if self.train.startswith("builtin:arith") != self.model.startswith("builtin:arith") and self.model.startswith("builtin:"):
            raise ValueError(f"model: {self.model!r} is the arith family's warm start; train on builtin:arith")
        return self


def load_experiment(path: Path | None, **overrides: Any) -> Experiment:
    """The experiment in ``path`` (None: the defaults, the arith family) with ``overrides`` (CLI flags) on top;
    relative task sources are read from the file's folder. ExperimentError of one line on any problem."""
    data: dict[str, Any] = {}
    where = str(path) if path else "experiment"
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f", line {mark.line + 1}" if mark else ""
            raise ExperimentError(f"{where}{at}: malformed YAML ({getattr(e, 'problem', None) or e})") from None
        if not isinstance(data, dict):
            raise ExperimentError(f"{where}: expected a mapping of settings, got {type(data).__name__}")
        for field in ("train", "eval"):
            source = data.get(field)
            if isinstance(source, str) and source and not source.startswith("builtin:") and not Path(source).is_absolute():
                data[field] = str((Path(path).parent / source).resolve())
        # a model directory beside the file, as its task sources are; a name that is none (tiny, org/name) stays
        model = data.get("model")
        if isinstance(model, str) and model and (Path(path).parent / model).is_dir():
            data["model"] = str((Path(path).parent / model).resolve())
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Experiment.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        value = err.get("input")  # a word or number the user wrote: the line names it
        given = f" (got {value!r})" if isinstance(value, (str, int, float)) and len(repr(value)) <= 80 else ""
        msg = err["msg"].removeprefix("Value error, ") + ("" if err["type"] in ("extra_forbidden", "missing") else given)
        if err["loc"] and isinstance(overrides.get(err["loc"][0]), (str, int, float)):  # a flag's, not the file's
            where = "the command line"
        raise ExperimentError(f"{where}: {field}: {msg}" if field else f"{where}: {msg}") from None


def print_config(exp: Experiment | None = None, where: str = "") -> str:
    """Every field as YAML with its meaning as a comment above it: ``exp``'s effective settings (read from
    ``where``, the defaults filled in), or without it the defaults."""
    if exp is None:
        lines = ["# polarstream run: the experiment file (polarstream/driver/experiment.py). Every key is optional."]
    else:
        lines = [f"# polarstream run: {where or 'the experiment'}, every setting as the run takes it (defaults filled in)."]
    values = (exp or Experiment()).model_dump(mode="json")
    for name, field in Experiment.model_fields.items():
        lines.append(f"# {field.description}")
        lines.append(yaml.safe_dump({name: values[name]}, default_flow_style=True, sort_keys=False).strip().removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"
