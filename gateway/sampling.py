"""Which sampling settings reach the engine: the run's, not the harness's, for sessions that train.

The trainer recomputes each sampled token's logprob from the full softmax at one temperature. A
harness picks its own (Gemini CLI sends temperature 1, top_p 0.95, top_k 64), and an engine reports
logprobs of the distribution it sampled from (vLLM with ``--logprobs-mode processed_logprobs``, our
engine always), so a harness's truncation would bias every importance ratio without anything failing.
So the gateway *pins* the run's settings for sessions that belong to a group (rollout sessions), and
records on every call what the harness asked (``request.sampling``) and what the engine used
(``CallRecorded.sampling``). Sessions without a group (ad-hoc, open mode) and a gateway started with
``--sampling pass`` (evaluation) keep the harness's settings; a call whose settings differ from the
run's is recorded with ``matches_run=False`` and the stream processors never train on its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas import EngineSampling
from schemas.session_keys import SessionClaims

from .canonical import Sampling


@dataclass(frozen=True)
class SamplingPolicy:
    mode: Literal["pin", "pass"] = "pin"
    temperature: float = 1.0  # the trainer's temperature (TrainerConfig.temperature)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if self.mode not in ("pin", "pass"):
            raise ValueError(f"sampling mode {self.mode!r}: expected pin or pass")
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k: must be >= 0 (0 = off), got {self.top_k}")

    def effective(self, requested: Sampling, claims: SessionClaims) -> EngineSampling:
        """What the engine samples this call with."""
        if self.mode == "pin" and claims.group_id:
            return EngineSampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, pinned=True)
        temperature = 1.0 if requested.temperature is None else max(requested.temperature, 0.0)
        top_p = 1.0 if requested.top_p is None else min(max(requested.top_p, 0.0), 1.0)
        top_k = requested.top_k if requested.top_k and requested.top_k > 0 else 0
        if top_p == 0:  # providers accept 0 (keep only the likeliest token); vLLM and SGLang want (0, 1]
            top_p, top_k = 1.0, 1
        matches = abs(temperature - self.temperature) < 1e-6 and top_p == self.top_p and top_k == self.top_k
        return EngineSampling(temperature=temperature, top_p=top_p, top_k=top_k, matches_run=matches)
