"""The gateway's own configuration (what ``polarstream gateway`` flags set).

Cluster-wide values (Kafka, topic prefix, admin token, session secret) live in ``infra.settings``;
this holds what is particular to one gateway process and its engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .limits import Limits
from .redact import RedactConfig
from .sampling import SamplingPolicy


@dataclass
class GatewayConfig:
    engine_urls: list[str]  # several: one session sticks to one (SGLang: list the workers, not the router)
    model: str  # tokenizer + chat template: a local HF directory
    upstream: Literal["polar", "vllm", "sglang"] = "polar"
    served_model: str = ""  # model name sent to the engine; '' = the engine's first /v1/models entry
    chat_template: str | None = None  # template text overriding the tokenizer's own
    tool_parser: str = ""  # vLLM's --tool-call-parser name; '' = picked from the template (gateway/toolparse)
    reasoning_parser: str = ""  # vLLM's --reasoning-parser name; '' = the tool parser's family's
    history: Literal["sampled", "template"] = "sampled"  # earlier turns as sampled (token-in) or as the template renders them
    open_mode: bool = False  # accept any key: ad-hoc sessions, one per key
    publish_mode: Literal["sync", "async"] = "sync"  # sync: answer only once the event is durably in Kafka
    publish_timeout_s: float = 10.0  # sync mode: how long to wait for the broker before answering 503
    retry_after_s: int = 5  # Retry-After on 503s (Kafka down, paused too long, session busy)
    max_body_bytes: int = 32 * 1024 * 1024
    upstream_timeout_s: float = 900.0
    connect_timeout_s: float = 5.0
    default_max_tokens: int = 4096  # when the harness names no limit (vLLM's own default would be 16)
    max_model_len: int | None = None  # None = ask the engine at start-up
    policy_version: int = 0  # stamped on calls whose engine does not report one; /admin/policy_version
    drain_timeout_s: float = 300.0  # admin pause: how long to wait for in-flight calls to finish
    hold_timeout_s: float = 600.0  # while paused, how long a new call waits before a 503
    pause_deadline_s: float = 900.0  # admin pause: the gateway resumes by itself after this long (logged)
    tombstones: str = ""  # file of closed sessions that a restart keeps refusing (gateway/tombstones.py); '' = memory only
    max_sessions: int = 10_000  # each holds its last request's history (tens of KB); nodes DELETE finished ones
    template_kwargs: dict[str, object] = field(default_factory=dict)  # extra chat-template variables
    limits: Limits = field(default_factory=Limits)  # request, session and key limits (gateway/limits.py)
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)  # the run's settings, pinned (gateway/sampling.py)
    redact: RedactConfig = field(default_factory=RedactConfig)  # credentials scrubbed before recording (gateway/redact.py)
