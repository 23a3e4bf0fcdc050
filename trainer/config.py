"""Every trainer setting, as one flat dataclass of commented defaults (nanoGPT style).

Infrastructure (Kafka, storage, ports) stays in ``infra.settings.Settings``; this holds what the
trainer itself decides. ``TrainConfig.from_overrides`` rejects unknown keys and wrong types, so a typo
on the command line fails loudly instead of silently training with a default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad trainer setting; the message names the key and the value."""


@dataclass
class TrainConfig:
    # -- model --
    model: str = ""  # local HF directory the run starts from (config.json + weights + tokenizer files); the
    # CLI also takes a built-in name (tiny, tiny:SEED, smollm2) and sets this to its cached directory
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype; bf16 autocast is used on CUDA either way
    attn_implementation: str = "auto"  # auto: polar_varlen (trainer/attention.py: per-sequence SDPA on CPU,
    # flash varlen on CUDA; no mask, cost = sum of each sequence's square) | sdpa | flash_attention_2 | eager
    activation_checkpointing: bool = False  # recompute each layer in backward: long traces fit in memory
    temperature: float = 1.0  # the engine's sampling temperature: logprobs are taken of logits / temperature
    # -- LoRA (trainer/lora.py: peft's layers on the frozen base; AdamW state for the adapter only) --
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank, the base frozen; 0: full fine-tuning
    lora_alpha: int = 16  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input while training (0: steps are deterministic)
    lora_target_modules: list[str] = field(default_factory=list)  # module names adapted; []: every attention
    # and MLP projection (q, k, v, o, gate, up, down _proj), the set vLLM serves for most models
    # -- data --
    groups_per_step: int = 4  # groups consumed per optimizer step
    token_budget: int = 4096  # tokens per micro-batch; a longer trace gets a micro-batch of its own
    max_trace_tokens: int = 0  # longest trace trained, the rest cut (counted, logged as a warning); 0: never cut
    share_prefix: bool = False  # feed a group's common prefix (system prompt, tools, task) once per micro-batch
    packing: Literal["packed", "padded"] = "packed"  # padded: one sequence per row, padded, with a mask
    row_len: int = 0  # packed row length; 0: one row of token_budget with polar_varlen (its cost does not
    # depend on rows), else the step's longest sequence (sdpa/eager's dense block mask costs row_len^2)
    max_staleness: int = 4  # groups more than this many policy versions behind the one the engines last
    # loaded are stale (with sync_every=0, behind the trainer's own version)
    stale_mode: Literal["drop", "downweight"] = "drop"
    stale_weight: float = 0.5  # downweight: weight = stale_weight ** (staleness - max_staleness)
    skip_zero_variance: bool = True  # a group whose advantages are all 0 carries no gradient: skip it (False: train it
    # masked, closing its step, unless its task asks for a drop: TaskRequest.zero_signal)
    skip_task_sets: list[str] = field(default_factory=list)  # task sets that never train (held-out evaluation)
    # -- on-policy distillation (trainer/distill.py): per-token advantage reward_weight * A_group +
    # distill_weight * (teacher logprob - rollout logprob) of each sampled token, the negated reverse KL --
    distill_url: str = ""  # the teacher engine's base URL (vLLM or ours: /v1/completions with prompt_logprobs); '' off
    distill_model: str = ""  # the teacher's served model name ('' : the engine's only one)
    distill_weight: float = 1.0
    reward_weight: float = 1.0  # the task reward's share (0: distillation alone, no reward needed)
    distill_timeout_s: float = 300.0  # one teacher call (a step's traces)
    poll_timeout_s: float = 1.0  # one broker poll
    idle_timeout_s: float = 0.0  # stop after this long without a new group (0: wait forever)
    start_from: Literal["earliest", "latest"] = "earliest"  # where a run without a checkpoint starts reading
    consumer_group: str = "polar-trainer"
    # -- several processes (torchrun) --
    strategy: Literal["auto", "fsdp"] = "auto"  # auto: FSDP2 when torchrun starts several processes, one plain
    # model otherwise; fsdp: FSDP2 in one process too (a group of one: the GPU check's sharded step)
    dist_timeout_s: float = 1800.0  # longest any collective may wait for a peer before the run fails
    # (torch's gloo default; nccl's is 600 s): a stuck rank becomes an error naming the collective
    heartbeat_s: float = 30.0  # while rank 0 waits for groups, it tells the other ranks every this
    # often that the step is still coming, so waiting for data never counts against dist_timeout_s
    # -- loss --
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (asymmetric, "clip-higher")
    loss_norm: Literal["token_mean", "seq_mean", "constant"] = "token_mean"  # how token losses are averaged
    # over the step: every token equally, every trajectory equally, or Dr. GRPO's constant (each trajectory's
    # token sum / loss_norm_tokens, averaged over trajectories: no bias towards short or long answers)
    loss_norm_tokens: int = 4096  # constant: the divisor, one number for the whole run (Dr. GRPO: the generation
    # budget, the engine's max_tokens; set it to yours). Not the step's longest: that would vary step to step
    loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"  # the policy loss (trainer/corrections.py): PPO-clip;
    # GSPO's sequence-level ratio and clip; CISPO's clipped, stop-gradient IS weight on log pi
    correction: Literal["none", "tis", "icepop", "token_rs", "seq_mask_geo", "seq_mask_arith"] = "none"  # engine/
    # trainer mismatch correction on rho = pi_prox / pi_rollout (pi_prox: the trainer's logprobs before the
    # step's updates): tis weights tokens by min(rho, tis_cap); icepop by rho inside [icepop_low, icepop_high],
    # 0 outside (IcePop's M(k) = k); token_rs by 1 inside that band, 0 outside (verl's token rejection);
    # seq_mask_geo / _arith drop trajectories whose geometric / arithmetic mean rho leaves [seq_mask_low,
    # seq_mask_high]. Independent of ratio_base (today's "correction on" runs: ratio_base proximal)
    ratio_base: Literal["behaviour", "proximal"] = "behaviour"  # pi_old of the loss's ratio: behaviour, the
    # engine's logprobs (PPO's clip bounds the whole engine/trainer gap); proximal, the trainer's own taken once
    # before the step's updates (AReaL's decoupled PPO: the clip bounds only the policy's drift over the
    # minibatches, a correction handles the engine gap). behaviour is the default: the demo learns with it
    # (bench/offpolicy.py compares the two)
    minibatches: int = 1  # optimizer steps per batch: the step's trajectories split into this many parts
    epochs: int = 1  # passes over the minibatches (updates per batch = minibatches * epochs)
    tis_cap: float = 0.0  # > 0: truncated IS weight min(pi_trainer / pi_rollout, cap) on each token (alone, it
    # turns correction tis on, as before `correction` existed)
    icepop_low: float = 0.5  # IcePop's band [alpha, beta] (the paper's 0.5 and 5)
    icepop_high: float = 5.0
    seq_mask_low: float = 0.5  # seq_mask_geo / seq_mask_arith: the band a sequence's mean ratio must stay in
    seq_mask_high: float = 2.0
    gspo_clip_low: float = 3e-4  # GSPO clips its sequence ratio at [1 - low, 1 + high] (the paper's 3e-4, 4e-4)
    gspo_clip_high: float = 4e-4
    cispo_clip_high: float = 0.28  # CISPO's weight is min(r, 1 + this) (no lower bound, as in MiniMax-M1)
    mismatch_warn_kl: float = 1e-3  # warn (one line) when a step's k3 KL(rollout || trainer) per token passes
    # this: the engine samples from a policy other than the one trained (0: never)
    kl_coef: float = 0.0  # > 0: k3 KL to the frozen starting model
    dual_clip: float = 3.0  # > 1: for A<0 the per-token loss is capped at -dual_clip * A (dual-clip PPO,
    # Ye et al. 2020; verl's clip_ratio_c), so a far off-policy token cannot blow up the gradient; 0 disables
    # -- optimizer --
    lr: float = 1e-5
    lr_schedule: Literal["constant", "cosine"] = "constant"  # RL usually keeps lr constant
    lr_saturation: float = 0.5  # a step whose mean reward (in [0, 1]) is above this trains with a smaller
    # lr, falling linearly to lr * lr_saturation_floor at reward 1 (optim.saturation_scale; issue 48); 1: off
    lr_saturation_floor: float = 0.05
    min_lr: float = 0.0  # cosine decay target
    warmup_steps: int = 0  # linear warmup (either schedule)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0  # 0 disables
    max_steps: int = 0  # 0: run until idle_timeout_s or interrupted
    lr_decay_steps: int = 1000  # cosine horizon when max_steps is 0
    seed: int = 0
    # -- checkpoints and weight sync (the sync settings: read by trainer/sync/syncer.py alone) --
    checkpoint_every: int = 1  # steps between checkpoints (weights, optimizer, state, offsets)
    keep_checkpoints: int = 3  # newest complete checkpoints kept, older ones deleted
    sync_every: int = 1  # steps between PolicyVersion + engine weight updates (0: never)
    max_sync_failures: int = 3  # stop (after a checkpoint) when this many syncs in a row failed: engines
    # stuck on an old policy would make every later step more off-policy (0: never stop)
    engines: list[str] = field(default_factory=list)  # "polar=http://host:port" or "vllm=http://host:port"
    gateway: str = ""  # gateway base URL whose /admin/policy_version is stamped after a sync
    weight_transfer: Literal["storage", "broadcast", "auto"] = "auto"  # how weights reach the engines:
    # storage: each loads the checkpoint URL; broadcast: in memory over vLLM's weight-transfer routes (gloo for
    # our engine; trainer/sync/broadcast.py); auto: broadcast to every engine that answers GET /weight_info, storage
    # for the others (a vLLM server without its dev routes, or without vllm here). An engine that fails a
    # broadcast is marked stale and loads from storage at the next sync. With lora_rank > 0 only the adapter's
    # tensors travel, and only to our engine (vLLM loads adapters from a path only: its engines, and every engine
    # with storage, load the adapter's directory through /v1/load_lora_adapter).
    weight_transfer_timeout_s: float = 60.0  # deadline of every collective and group rendezvous of a broadcast
    weight_transfer_buffer_mb: int = 64  # packed broadcast buffer size (vLLM's packed_buffer_size_bytes)
    weight_transfer_address: str = ""  # address the engines reach the trainer at ('' : derived per engine URL)
    weight_transfer_verify: bool = False  # after each broadcast, /weight_checker compare against the trainer's
    # sha256 of every tensor sent (costs a hash pass on both sides)
    weight_transfer_throttle_s: float = 0.0  # a pause after each broadcast buffer: fault tests (bench/chaos.py)
    # slow a transfer down enough to kill something inside it; 0 in real runs
    model_name: str = "policy"  # PolicyVersion.model
    # -- logging --
    entropy_floor: float = 0.01  # warn (one line, and in train.jsonl) when the trained tokens' mean entropy
    # falls below this: a nearly deterministic policy; also when the mean reward falls by > 0.3 in two steps
    run_dir: str = ""  # JSONL log + TensorBoard events; '' means <data_dir>/trainer/<consumer_group>
    tensorboard: bool = True
    progress: bool = True
    metrics_port: int = 0  # serve Prometheus /metrics on this port, rank 0 (0: off; docs/operations.md)

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> "TrainConfig":
        """Build a config from ``{key: value}``, checking every key and coercing strings to the field type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in overrides.items():
            if key not in fields:
                raise ConfigError(f"unknown trainer setting {key!r}; known: {', '.join(sorted(fields))}")
            values[key] = _coerce(key, raw, typing.get_type_hints(cls)[key])
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Reject settings that cannot work together."""
        checks = [
            (self.groups_per_step >= 1, "groups_per_step", "must be >= 1"),
            (self.token_budget >= 2, "token_budget", "must be >= 2"),
            (0 <= self.row_len <= self.token_budget, "row_len", "must be in [0, token_budget]"),
            (self.max_trace_tokens >= 0, "max_trace_tokens", "must be >= 0 (0: never cut)"),
            (not self.share_prefix or self.attn_implementation in ("auto", "varlen", "polar_varlen"),
             "share_prefix", "needs attn_implementation auto (polar_varlen)"),
            (self.temperature > 0, "temperature", "must be > 0"),
            (0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)"),
            (self.clip_high >= 0, "clip_high", "must be >= 0"),
            (self.tis_cap >= 0, "tis_cap", "must be >= 0"),
            (self.correction != "tis" or self.tis_cap > 0, "tis_cap", "must be > 0 with correction tis"),
            (self.loss_norm_tokens >= 1, "loss_norm_tokens", "must be >= 1 (a constant: the generation budget)"),
            (self.minibatches >= 1, "minibatches", "must be >= 1"),
            (self.epochs >= 1, "epochs", "must be >= 1"),
            (0 <= self.icepop_low < self.icepop_high, "icepop_low", "must be >= 0 and below icepop_high"),
            (0 <= self.seq_mask_low < self.seq_mask_high, "seq_mask_low", "must be >= 0 and below seq_mask_high"),
            (0 <= self.gspo_clip_low < 1, "gspo_clip_low", "must be in [0, 1)"),
            (self.gspo_clip_high >= 0, "gspo_clip_high", "must be >= 0"),
            (self.cispo_clip_high >= 0, "cispo_clip_high", "must be >= 0"),
            (self.mismatch_warn_kl >= 0, "mismatch_warn_kl", "must be >= 0 (0: no warning)"),
            (self.kl_coef >= 0, "kl_coef", "must be >= 0"),
            (not self.distill_url or self.distill_url.startswith(("http://", "https://")), "distill_url",
             "must be an http(s) URL of the teacher engine"),
            (self.distill_weight >= 0 and self.reward_weight >= 0, "distill_weight", "and reward_weight must be >= 0"),
            (self.distill_timeout_s > 0, "distill_timeout_s", "must be > 0"),
            (self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", "must be 0 (off) or > 1"),
            (self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1"),
            (self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1"),
            (self.sync_every >= 0, "sync_every", "must be >= 0"),
            (self.max_sync_failures >= 0, "max_sync_failures", "must be >= 0"),
            (0 < self.lr_saturation <= 1, "lr_saturation", "must be in (0, 1] (1: off)"),
            (0 < self.lr_saturation_floor <= 1, "lr_saturation_floor", "must be in (0, 1]"),
            (self.entropy_floor >= 0, "entropy_floor", "must be >= 0 (0: no warning)"),
            (0 <= self.metrics_port <= 65535, "metrics_port", "must be a port number (0: off)"),
            (0 < self.stale_weight <= 1, "stale_weight", "must be in (0, 1]"),
            (self.dist_timeout_s > 0, "dist_timeout_s", "must be > 0"),
            (self.weight_transfer_timeout_s > 0, "weight_transfer_timeout_s", "must be > 0"),
            (self.weight_transfer_buffer_mb >= 1, "weight_transfer_buffer_mb", "must be >= 1"),
            (self.weight_transfer_throttle_s >= 0, "weight_transfer_throttle_s", "must be >= 0"),
            (0 < self.heartbeat_s < self.dist_timeout_s, "heartbeat_s", "must be in (0, dist_timeout_s)"),
            (self.lora_rank >= 0, "lora_rank", "must be >= 0 (0: full fine-tuning)"),
            (self.lora_alpha > 0, "lora_alpha", "must be > 0"),
            (0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)"),
            (not self.lora_rank or not self.weight_transfer_verify, "weight_transfer_verify",
             "must be false with lora_rank > 0 (/weight_checker compares the base weights, which a LoRA run never sends)"),
            (not self.lora_rank or re.fullmatch(r"[A-Za-z0-9._:-]+", self.model_name) is not None, "model_name",
             "with lora_rank > 0 it names the adapters (<model_name>-v<version>): letters, digits and . _ : - only"),
        ]
        for ok, key, why in checks:
            if not ok:
                raise ConfigError(f"{key}={getattr(self, key)!r}: {why}")
        for spec in self.engines:
            kind, _, url = spec.partition("=")
            if kind not in ("polar", "vllm") or not url.startswith(("http://", "https://")):
                raise ConfigError(f"engines: {spec!r} is not 'polar=http://...' or 'vllm=http://...'")

    def resolve_model_dir(self) -> None:
        """Set ``model`` to the local directory its name means, as the engine and the gateway resolve it (a
        built-in name -> its cached directory, built once); ConfigError in one line when there is none."""
        from infra.models import resolve_model

        try:
            path = resolve_model(self.model)
        except FileNotFoundError as e:  # already one line saying what was tried
            raise ConfigError(str(e)) from None
        if not Path(path).is_dir():  # a hub id: the trainer reads weights from a directory, never the hub
            raise ConfigError(f"model {self.model!r}: no such directory (the trainer does not download hub ids; "
                              "give a local HF directory or a built-in name: tiny, tiny:SEED, smollm2)")
        self.model = path

    def require_model_dir(self) -> None:
        """ConfigError unless ``model`` is a local HF model directory (it has a config.json)."""
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"model={self.model!r}: not a model directory (no config.json)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(key: str, raw: Any, hint: Any) -> Any:
    """Convert ``raw`` (often a CLI string) to the annotated type, or raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    try:
        if origin is Literal:
            if raw not in typing.get_args(hint):
                raise ValueError(f"expected one of {', '.join(map(str, typing.get_args(hint)))}")
            return raw
        if origin is list:
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return [s.strip() for s in items if str(s).strip()]
        if hint is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if hint in (int, float, str):
            if hint is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError("expected an integer")
            return hint(raw)
        if isinstance(hint, types.UnionType):  # pragma: no cover - no such fields today
            return raw
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={raw!r}: {e}") from None
    return raw
