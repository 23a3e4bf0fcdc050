"""What one sync hands the engines: a policy version's full weights or its LoRA adapter, as one type.

Every path (storage, in-memory broadcast, vLLM's trainer API) takes a ``Payload`` and asks it the few things
in which the two differ (its tensors, where it is exported, what an engine calls it), so each path is one
code path, not a weights branch and an adapter branch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from .. import checkpoint, lora
from .broadcast import named_tensors, tensor_meta

Meta = list[tuple[str, torch.dtype, list[int]]]


@dataclass
class Payload:
    """One policy version for the engines. ``meta`` and ``tensors`` produce, without and with gathering, the
    named tensors an in-memory transfer sends (under FSDP2 ``tensors`` is a collective: every rank iterates it);
    ``url`` is where the storage path loads it from."""

    kind: Literal["weights", "adapter"]
    version: int
    meta: Callable[[], Meta]
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    url: str | None = None
    name: str | None = None  # adapter: the engines' name of this version's adapter (a request selects it by model)
    config: dict[str, Any] | None = field(default=None, repr=False)  # adapter: PEFT's adapter_config.json

    @classmethod
    def of(cls, model: torch.nn.Module, version: int, model_name: str, adapter: dict[str, Any] | None,
           url: str | None = None) -> "Payload":
        """``model``'s weights, or its adapter when the run trains one (``adapter``: its PEFT config)."""
        if adapter is None:
            return cls("weights", version, partial(tensor_meta, model), partial(named_tensors, model), url)
        return cls("adapter", version, partial(lora.adapter_meta, model), partial(lora.adapter_tensors, model), url,
                   lora.adapter_name(model_name, version), adapter)

    @property
    def adapter(self) -> bool:
        return self.kind == "adapter"

    def export_dir(self, root: str) -> str:
        """Where this version's export lives: every version's adapter in a directory of its own (engines load
        it by name), weights beside them."""
        return (checkpoint.adapters_dir if self.adapter else checkpoint.weights_dir)(root, self.version)

    def export(self, root: str, model: torch.nn.Module, model_dir: str | Path, settings: Any,
               meta: dict[str, Any]) -> str:
        """Write the export (every rank: a collective) and return its URL."""
        url = self.export_dir(root)
        if self.adapter:
            return checkpoint.export_adapter(url, model, self.config, settings, meta)
        return checkpoint.export_weights(url, model, model_dir, settings, meta)

    def log_fields(self) -> dict[str, Any]:
        """What a sync's log line says about the payload (the driver reads ``adapter``)."""
        return {"adapter": True} if self.adapter else {}
