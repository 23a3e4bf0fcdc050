"""How new weights reach the engines. train() sees one object, ``Syncer`` (syncer.py), which hands a ``Payload``
(payload.py: full weights or a LoRA adapter) to storage (engines load an export's URL: ``storage``), in memory
over a process group (``broadcast``, our engine's and vLLM's routes) or vLLM's own trainer API (``vllm_api``)."""

from typing import Any

__all__ = ["Payload", "Syncer"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the modules beside them (broadcast, vllm_api) also run in vLLM's own venv
    # (tests/trainer/vllm_sync.py), which has no Kafka client for the Syncer's publisher.
    if name == "Syncer":
        from .syncer import Syncer

        return Syncer
    if name == "Payload":
        from .payload import Payload

        return Payload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
