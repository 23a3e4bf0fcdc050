"""How the stream processors build training data: builder, advantages, deadlines.

These knobs shape the records the streams emit, so the ones that change output bytes feed the
deterministic event ids (``fingerprint``): two workers with different knobs never emit records that
look like re-emissions of each other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .judge import JudgeConfig

Builder = Literal["per_request", "prefix_merging"]
Advantage = Literal["grpo", "loo", "no_std"]

# advantage preset -> (baseline, divide by the group std)
ADVANTAGE_PRESETS: dict[str, tuple[Literal["mean", "leave_one_out"], bool]] = {
    "grpo": ("mean", True),  # GRPO: (r - mean) / (std + eps)
    "loo": ("leave_one_out", True),  # Polar: r - mean(others), over one shared group std + eps
    "no_std": ("mean", False),  # Dr. GRPO: r - mean, no std division
}


class StreamsConfig(BaseModel):
    """Settings of one streams deployment; every worker of a consumer group must use the same."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    builder: Builder = "prefix_merging"
    side_calls: Literal["trace", "drop"] = "trace"  # a side call becomes its own trace, or is left out
    advantage: Advantage = "grpo"
    epsilon: float = Field(1e-6, gt=0)
    zero_variance: Literal["keep", "drop"] = "keep"  # keep: emitted with zero_variance=True, advantages 0
    timeout_reward: float = 0.0  # agent-budget timeouts stay trainable with this reward
    # DAPO's soft overlong punishment (advantages.overlong_penalty) on a trajectory's sampled tokens, added to
    # its reward before the advantages: 0 for up to max_tokens - buffer tokens, then down linearly to -penalty
    # at max_tokens, and -penalty beyond (overlong_max_tokens 0: off)
    overlong_max_tokens: int = Field(0, ge=0)
    overlong_buffer: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0)
    # Deadlines (wall-clock seconds, checked on ticks). A group emits at its deadline when it has at
    # least min_valid usable members; one that never gets there is dropped at group_expire_s.
    group_deadline_s: float = Field(600.0, gt=0)
    group_expire_s: float = Field(86400.0, gt=0)
    # A finished session still missing calls is assembled anyway (masked) after this much time, both on
    # the wall clock and in the calls topic (see sessions.decide), or after the timeout regardless.
    missing_calls_grace_s: float = Field(30.0, ge=0)
    missing_calls_timeout_s: float = Field(300.0, ge=0)
    session_expire_s: float = Field(86400.0, gt=0)  # calls but no finished event: dropped after this
    done_retention_s: float = Field(3600.0, ge=0)  # how long "already emitted" markers catch late duplicates
    tick_interval_s: float = Field(2.0, gt=0)
    # A call whose token data is larger cannot be kept in state: left out (counted, logged), its session
    # masked. Outputs are bounded by their topics' max.message.bytes instead.
    max_record_bytes: int = Field(32 * 1024 * 1024, gt=0)
    # Tables keep references to their inputs; the inputs themselves are cached in memory up to these
    # sizes (calls as decoded, members at their encoded bytes) and read back from their topics on a miss
    # (streams/source_log.py).
    call_cache_bytes: int = Field(1024 * 1024 * 1024, ge=0)  # as decoded: ~40 bytes per token id
    member_cache_bytes: int = Field(16 * 1024 * 1024, ge=0)  # decoded, a member takes ~5x its bytes
    # A judge between the outcome rewards and the advantages (streams/judge_stage.py); None: outcome only.
    judge: JudgeConfig | None = None

    @model_validator(mode="after")
    def _overlong(self) -> "StreamsConfig":
        if self.overlong_max_tokens and not 0 < self.overlong_buffer <= self.overlong_max_tokens:
            raise ValueError(f"overlong_buffer: {self.overlong_buffer} must be in (0, overlong_max_tokens]")
        return self

    @property
    def baseline(self) -> Literal["mean", "leave_one_out"]:
        return ADVANTAGE_PRESETS[self.advantage][0]

    @property
    def std_normalized(self) -> bool:
        return ADVANTAGE_PRESETS[self.advantage][1]

    def trajectory_fingerprint(self) -> str:
        """The knobs that change a Trajectory's bytes."""
        return f"{self.builder}|side={self.side_calls}|timeout_reward={self.timeout_reward!r}"

    def group_fingerprint(self) -> str:
        """The knobs that change a TrainingGroup's bytes (its members carry the trajectory ones)."""
        overlong = (f"|overlong={self.overlong_max_tokens},{self.overlong_buffer},{self.overlong_penalty!r}"
                    if self.overlong_max_tokens else "")  # off: the ids of every existing group are unchanged
        judged = f"|judge={self.judge.fingerprint()}" if self.judge is not None else ""  # as overlong: off, unchanged
        return f"{self.advantage}|eps={self.epsilon!r}|zv={self.zero_variance}{overlong}{judged}"
