"""The event contract: every record that crosses a topic.

Each record is a validated pydantic model with ``schema_version`` and ``event_id``. ``TOPIC`` names the
logical topic it lives on and ``key()`` gives its partition key, so producers never guess either.
Derived records (Trajectory, TrainingGroup) get deterministic event ids from their inputs, so a record
re-emitted after a crash is recognisably the same one and consumers can dedupe on ``event_id``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1

Provider = Literal["anthropic.messages", "openai.chat", "openai.responses", "google.generate_content", "engine"]
SessionStatus = Literal["ok", "timeout", "failed", "infra_error", "cancelled"]
ZeroSignal = Literal["mask", "drop"]
# A vocabulary index: a negative one would index from the end, and every reader (the trainer's tensors,
# the parquet export) holds ids as int32.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def float32_digits(x: float) -> float:
    """A logprob at the precision engines compute it in (float32): the 9 significant digits that give
    back every float32, not the 17 that its widening to float64 prints. The same float32 to a trainer,
    and about 8 fewer bytes of JSON per logprob on each topic that carries it."""
    return float(f"{x:.9g}")


def new_event_id() -> str:
    return uuid.uuid4().hex


def derived_event_id(*parts: Any) -> str:
    """Deterministic id for a record built from inputs: same inputs, same id."""
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x1f")
    return h.hexdigest()[:32]


class _Model(BaseModel):
    # No inf/NaN: JSON has no spelling for them (orjson writes null), so such a record would be
    # published but never decode again; lax mode would otherwise accept "inf" strings (tests/fuzz).
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class Record(_Model):
    """Base of every topic record."""

    TOPIC: ClassVar[str] = ""
    schema_version: int = SCHEMA_VERSION
    event_id: str = Field(default_factory=new_event_id, min_length=1)
    created_at: float = Field(default_factory=time.time)

    def key(self) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


# --------------------------------------------------------------------------------------- tasks


class WorkspaceSpec(_Model):
    """Where a session's workspace comes from."""

    # "image": the workspace is what the task's container image holds at ``mount`` (its WORKDIR); there
    # is no host directory, and the task must carry an ``environment``.
    kind: Literal["empty", "dir", "git", "archive", "files", "image"] = "empty"
    source: str = ""  # directory path, git URL, or archive path/URL
    ref: str = ""  # git ref
    files: dict[str, str] = Field(default_factory=dict)  # kind == "files": relative path -> content
    # Where the sandbox shows the workspace, as the task expects it (a Harbor task's WORKDIR, e.g. /app);
    # "" = the runtime's own place (/workspace under bwrap). Only a sandboxing runtime can honour it.
    mount: str = Field("", pattern=r"^(/[A-Za-z0-9._-]+)*$")


class EnvironmentSpec(_Model):
    """The container a task runs in (Harbor's ``environment/`` and ``[environment]``): an image built
    from a Dockerfile, or a prebuilt one, plus the limits ``task.toml`` asks for."""

    image: str = ""  # prebuilt image (task.toml docker_image); else built from the context
    # The build context (Dockerfile at "Dockerfile"), relative path -> text, so a task travels whole
    # through Kafka; a context with binary or large files is named by a directory the nodes can read.
    context: dict[str, str] = Field(default_factory=dict)
    context_dir: str = ""
    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    storage_mb: int | None = Field(None, gt=0)
    gpus: int = Field(0, ge=0)
    build_timeout_s: float = Field(600.0, gt=0)
    # The agent's phase (harness, prepare, a solution): no network but the gateway unless the task or the
    # experiment says so. The verifier's network is its own (EvaluatorSpec.network).
    allow_internet: bool = False
    # Build the context even where ``image`` could be pulled (Harbor's --force-build); both are kept so
    # the node decides where it runs (gateway/runtimes/image_source.py)
    force_build: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> "EnvironmentSpec":
        if not (self.image or self.context or self.context_dir):
            raise ValueError("environment: needs an image, or a build context with a Dockerfile")
        if self.context and "Dockerfile" not in self.context:
            raise ValueError("environment.context: no Dockerfile in it")
        return self


class HarnessSpec(_Model):
    name: str = "builtin"  # claude_code | codex | gemini_cli | qwen_code | opencode | pi | command | builtin
    config: dict[str, Any] = Field(default_factory=dict)
    command: list[str] = Field(default_factory=list)  # for name == "command"


class EvaluatorSpec(_Model):
    kind: Literal["command", "files", "python", "harbor", "none"] = "command"
    command: str = ""  # kind == command: reward 1.0 when it exits 0; kind == harbor: the verifier (bash /tests/test.sh)
    # kind == harbor: the task's tests/ (relative path -> content), shown at /tests to the verifier only;
    # the reward is /logs/verifier/reward.txt or reward.json when the verifier writes one, else its exit code
    tests: dict[str, str] = Field(default_factory=dict)
    # The verifier's network: "host" = the outside world (in a session's container: the engine's bridge, never
    # the host's loopback); Harbor tasks with an image get it unless task.toml says allow_internet = false.
    network: Literal["none", "host"] = "none"
    # What the agent left running in a session's container before the verifier opens: kill (default: the
    # verifier judges files, not a process that may still write them or use the verifier's network) or keep
    # (Harbor's behaviour, for tests that query a server the agent started).
    agent_processes: Literal["kill", "keep"] = "kill"
    env: dict[str, str] = Field(default_factory=dict)  # kind == harbor: the verifier's environment ([verifier] env)
    expected_files: dict[str, str] = Field(default_factory=dict)  # kind == files: path -> exact content
    callable: str = ""  # kind == python: "module:function", called with (workspace_path, task)
    timeout_s: float = 60.0


class Timeouts(_Model):
    init_s: float = 300.0
    agent_s: float = 600.0
    eval_s: float = 120.0


class TaskRequest(Record):
    TOPIC: ClassVar[str] = "tasks"
    task_id: str = Field(min_length=1)
    group_id: str = ""  # defaults to task_id; one group per task submission
    instruction: str
    workspace: WorkspaceSpec = Field(default_factory=WorkspaceSpec)
    environment: EnvironmentSpec | None = None  # a container image the task runs in (workspace kind "image")
    prepare: list[str] = Field(default_factory=list)  # shell commands run during INIT
    harness: HarnessSpec = Field(default_factory=HarnessSpec)
    evaluator: EvaluatorSpec = Field(default_factory=EvaluatorSpec)
    num_samples: int = Field(4, ge=1, le=1024)
    min_valid: int = Field(2, ge=1)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    priority: int = 0
    task_set: str = "default"
    metadata: dict[str, Any] = Field(default_factory=dict)
    early_stop: int = Field(0, ge=0)  # cancel the remaining sessions once this many usable ones finished (0: never)
    # What the trainer does with this task's group when its samples all score the same (no signal): mask
    # (train it, moving no weight: it still fills its step) or drop (skip it; the driver sends another task
    # in its place, DAPO's dynamic sampling). Carried on the session events and trajectories to the trainer.
    zero_signal: ZeroSignal = "mask"
    cancelled: str = ""  # non-empty (the reason) on a cancel marker re-published to polar.tasks; nodes honour it

    @model_validator(mode="after")
    def _defaults(self) -> "TaskRequest":
        if not self.group_id:
            self.group_id = self.task_id
        if self.min_valid > self.num_samples:
            raise ValueError(f"min_valid ({self.min_valid}) exceeds num_samples ({self.num_samples})")
        if self.workspace.kind == "image" and self.environment is None:
            raise ValueError("workspace: kind 'image' needs the task's environment (its Dockerfile or image)")
        return self

    def key(self) -> str:
        return self.task_id


class SessionAssigned(Record):
    TOPIC: ClassVar[str] = "sessions"
    session_id: str = Field(min_length=1)
    group_id: str
    task_id: str
    sample_index: int = Field(ge=0)
    attempt: int = Field(0, ge=0)
    session_key: str  # minted, HMAC-signed, scoped to this session
    task: TaskRequest

    def key(self) -> str:
        return self.session_id


# --------------------------------------------------------------------------------------- calls


class PromptDelta(_Model):
    """prompt = (full sequence of call ``base_call_index``)[:base_len] + suffix_ids.

    The full sequence of a call is its prompt ids followed by its completion ids. Encoding a growing
    prompt this way keeps a session's bytes linear in its tokens instead of quadratic.
    """

    base_call_index: int = Field(ge=0)
    base_len: int = Field(ge=0)
    suffix_ids: list[TokenId]


class ToolCallOut(_Model):
    id: str
    name: str
    arguments: str  # JSON text as generated


class CallOutput(_Model):
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    parse_error: str = ""  # tool-call markup that did not parse (returned as text)


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Timings(_Model):
    received_at: float = 0.0
    upstream_ms: float = 0.0
    total_ms: float = 0.0


class ChainInfo(_Model):
    """How the gateway built this prompt relative to the session's earlier calls."""

    extends_call_index: int | None = None  # prompt ids = that call's prompt + sampled ids + appended tokens
    break_reason: str = ""  # why a new chain started: "", "first_call", "rewritten_history", "system_changed",
    # "tools_changed", "compaction", "retokenized", "side_call", ...


class EngineSampling(_Model):
    """The sampling settings the engine used for a call (``request.sampling`` holds what the harness asked)."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = off (the full vocabulary)
    pinned: bool = False  # the gateway replaced the harness's settings with the run's
    matches_run: bool = True  # the run's settings: the logprobs are what the trainer recomputes; else masked


class CallRecorded(Record):
    TOPIC: ClassVar[str] = "calls"
    session_id: str = Field(min_length=1)
    group_id: str = ""
    task_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    call_index: int = Field(ge=0)  # a restarted gateway numbers an earlier session's calls on from its boot base
    boot_id: str = ""  # the gateway process that recorded the call (a new one at every start)
    provider: Provider
    model: str = ""  # what the harness asked for
    served_model: str = ""
    policy_version: int = 0
    harness: str = ""
    side_call: bool = False
    request: dict[str, Any] = Field(default_factory=dict)  # normalized: messages, tools, sampling
    prompt_ids: list[TokenId] | None = None  # full prompt, or None when prompt_delta is set
    prompt_delta: PromptDelta | None = None
    completion_ids: list[TokenId] = Field(default_factory=list)
    completion_logprobs: list[float] = Field(default_factory=list)  # as the gateway records them: float32_digits
    finish_reason: str = ""
    output: CallOutput = Field(default_factory=CallOutput)
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    chain: ChainInfo = Field(default_factory=ChainInfo)
    error: str = ""
    # Credentials the gateway scrubbed (gateway/redact.py, docs/security.md): kind -> count in this
    # event's new content ("output.<kind>" for the model's own text), and [start, end) ranges of the
    # full prompt's ids that are placeholders, so training or export can mask them.
    redactions: dict[str, int] = Field(default_factory=dict)
    scrubbed_spans: list[list[int]] = Field(default_factory=list)
    sampling: EngineSampling | None = None  # None: recorded before the gateway reported it

    @model_validator(mode="after")
    def _consistent(self) -> "CallRecorded":
        if (self.prompt_ids is None) == (self.prompt_delta is None):
            raise ValueError("prompt_ids: exactly one of prompt_ids and prompt_delta must be set")
        if len(self.completion_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"completion_logprobs: {len(self.completion_logprobs)} logprobs for "
                f"{len(self.completion_ids)} completion ids"
            )
        if self.prompt_delta is not None and self.prompt_delta.base_call_index >= self.call_index:
            raise ValueError("prompt_delta.base_call_index: must refer to an earlier call of the session")
        return self

    def key(self) -> str:
        return self.session_id


class VerifierFault(_Model):
    """Why a verifier could not judge (gateway/verifier_faults.py): its cause and the output lines that show it."""

    cause: Literal["tls", "dns", "network", "interpreter", "install", "timeout"]
    evidence: list[str] = Field(default_factory=list)

    def summary(self) -> str:
        """One line for a session's detail: the cause and the first line that shows it."""
        return f"verifier fault ({self.cause}): {self.evidence[0] if self.evidence else ''}"[:300]


class SessionEvent(Record):
    TOPIC: ClassVar[str] = "session-events"
    session_id: str = Field(min_length=1)
    group_id: str = ""
    task_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    num_samples: int = 1
    min_valid: int = 1
    kind: Literal["started", "harness_exited", "evaluated", "finished"]
    status: SessionStatus | None = None  # set on harness_exited / finished
    reward: float | None = None  # set on evaluated / finished
    metrics: dict[str, float] = Field(default_factory=dict)
    num_calls: int | None = None  # on finished: calls the gateway recorded, so assembly knows all are in
    harness: str = ""
    task_set: str = "default"
    zero_signal: ZeroSignal = "mask"  # the task's (TaskRequest.zero_signal)
    detail: str = ""
    # on finished (status infra_error): the verifier never got to judge, and why; absent on older records
    verifier_fault: VerifierFault | None = None

    def key(self) -> str:
        return self.session_id


# --------------------------------------------------------------------------------------- training data


class Trace(_Model):
    """One training sequence: token ids with a loss mask and the rollout (behaviour) logprobs."""

    call_indices: list[int]
    token_ids: list[TokenId]
    loss_mask: list[Literal[0, 1]]  # 1 on sampled tokens, 0 on prompt / interstitial tokens
    logprobs: list[float]  # rollout logprob on sampled tokens, 0.0 elsewhere
    policy_versions: list[int] = Field(default_factory=list)  # one per call in call_indices
    break_reason: str = ""  # why this trace did not continue an earlier one
    side_call: bool = False

    @model_validator(mode="after")
    def _aligned(self) -> "Trace":
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"loss_mask/logprobs: lengths {len(self.loss_mask)}/{len(self.logprobs)} differ from token_ids ({n})"
            )
        return self


def _check_parts(record: "Trajectory | TrainingGroup") -> None:
    if record.part >= record.parts:
        raise ValueError(f"part {record.part} of {record.parts}: the index must be below the count")
    if (record.parts > 1) != bool(record.part_of):
        raise ValueError("part_of: the whole record's event id, set exactly when parts > 1")


class Trajectory(Record):
    TOPIC: ClassVar[str] = "trajectories"
    session_id: str
    group_id: str
    task_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    num_samples: int = 1
    min_valid: int = 1
    status: SessionStatus = "ok"
    reward: float = 0.0
    usable: bool = True  # False: masked out of its group (infrastructure failure, broken assembly)
    metrics: dict[str, float] = Field(default_factory=dict)
    harness: str = ""
    task_set: str = "default"
    zero_signal: ZeroSignal = "mask"  # the task's (TaskRequest.zero_signal)
    builder: Literal["per_request", "prefix_merging"] = "prefix_merging"
    traces: list[Trace] = Field(default_factory=list)
    stats: dict[str, float] = Field(default_factory=dict)  # calls, traces, merged, breaks, tokens...
    # A trajectory too large for one record goes out as ``parts`` records (schemas/parts.py), each with
    # some of its traces and all of its other fields; ``part_of`` is then the whole one's event id.
    part: int = Field(0, ge=0)
    parts: int = Field(1, ge=1)
    part_of: str = ""

    @model_validator(mode="after")
    def _parts(self) -> "Trajectory":
        _check_parts(self)
        return self

    def key(self) -> str:
        return self.group_id


class TrainingGroup(Record):
    TOPIC: ClassVar[str] = "groups"
    group_id: str
    task_id: str = ""
    trajectories: list[Trajectory]  # usable members only, sorted by sample_index
    advantages: list[float]  # aligned with trajectories
    masked: list[str] = Field(default_factory=list)  # session ids left out of the group
    baseline: Literal["mean", "leave_one_out"] = "mean"
    std_normalized: bool = True
    zero_variance: bool = False
    reward_mean: float = 0.0
    reward_std: float = 0.0
    policy_versions: list[int] = Field(default_factory=list)
    # As for Trajectory: a group too large for one record goes out as ``parts`` records, each with some of
    # its trajectories (a trajectory too large for a part alone, as its parts); ``masked`` is in part 0.
    part: int = Field(0, ge=0)
    parts: int = Field(1, ge=1)
    part_of: str = ""

    @model_validator(mode="after")
    def _aligned(self) -> "TrainingGroup":
        if len(self.advantages) != len(self.trajectories):
            raise ValueError(
                f"advantages: {len(self.advantages)} values for {len(self.trajectories)} trajectories"
            )
        _check_parts(self)
        return self

    @property
    def no_signal(self) -> bool:
        """Every advantage is 0: the group moves no weight (the trainer's and the driver's one test)."""
        return all(a == 0 for a in self.advantages)

    def key(self) -> str:
        return self.group_id


class PolicyVersion(Record):
    TOPIC: ClassVar[str] = "policy"
    model: str
    version: int = Field(ge=0)
    checkpoint_url: str
    step: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    # The weight sync that brought this version to the engines (the trainer's ``sync`` event: mode, sync_s,
    # engine_pause_s, the engines by path, adapter). Empty on the record published once the version is
    # trained, before any engine loads it; the trainer publishes the version again with it once they serve
    # it, so a driver on another machine reads each step's sync from the topic, not from the trainer's disk.
    sync: dict[str, Any] = Field(default_factory=dict)

    def key(self) -> str:
        return self.model


RECORD_TYPES: dict[str, type[Record]] = {
    cls.__name__: cls
    for cls in (TaskRequest, SessionAssigned, CallRecorded, SessionEvent, Trajectory, TrainingGroup, PolicyVersion)
}
RECORD_BY_TOPIC: dict[str, type[Record]] = {cls.TOPIC: cls for cls in RECORD_TYPES.values()}
