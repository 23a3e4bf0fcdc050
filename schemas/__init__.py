"""The event contract: the only thing components share."""

from .codec import RecordDecodeError, decode, document, encode
from .packed import is_packed
from .delta import DeltaError, encode_prompt, full_sequence, resolve_prompt
from .parts import Parts, RecordTooLarge, join_parts, split_record
from .records import (
    RECORD_BY_TOPIC,
    RECORD_TYPES,
    SCHEMA_VERSION,
    CallOutput,
    CallRecorded,
    ChainInfo,
    EngineSampling,
    EnvironmentSpec,
    EvaluatorSpec,
    HarnessSpec,
    JudgeVerdict,
    PolicyVersion,
    PromptDelta,
    Record,
    SessionAssigned,
    SessionEvent,
    TaskRequest,
    TeacherScores,
    Timeouts,
    Timings,
    ToolCallOut,
    Trace,
    TrainingGroup,
    Trajectory,
    Usage,
    VerifierFault,
    WorkspaceSpec,
    derived_event_id,
    float32_digits,
    new_event_id,
)

__all__ = [
    "CallOutput", "CallRecorded", "ChainInfo", "DeltaError", "EngineSampling", "EnvironmentSpec", "EvaluatorSpec", "HarnessSpec", "JudgeVerdict",
    "Parts", "PolicyVersion", "PromptDelta", "RECORD_BY_TOPIC", "RECORD_TYPES", "Record", "RecordDecodeError",
    "RecordTooLarge", "SCHEMA_VERSION", "SessionAssigned", "SessionEvent", "TaskRequest", "TeacherScores", "Timeouts",
    "Timings", "ToolCallOut", "Trace", "TrainingGroup", "Trajectory", "Usage", "VerifierFault", "WorkspaceSpec", "decode",
    "derived_event_id", "document", "encode", "encode_prompt", "float32_digits", "full_sequence", "is_packed", "join_parts", "new_event_id",
    "resolve_prompt", "split_record",
]
