"""What the trainer tells the gateway at each weight sync: the policy version to stamp on a run's later
calls and, for LoRA runs, the adapter that serves them (``POST /admin/policy_version``).

A contract between the trainer (trainer/sync/storage.py) and the gateway (gateway/admin.py), hence in
schemas/. A run is known to the gateway by its topic prefix (``settings.topic_prefix``, where its calls
are recorded), which its session keys carry as their ``run`` claim (schemas/session_keys.py); '' is the
gateway's own run. With ``lora_name`` set, the gateway sends that name as the engine request's ``model``
(vLLM selects a loaded adapter by it), whatever model the harness asked for; '' keeps the base model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PolicyStamp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    lora_name: str = Field("", max_length=256)  # the adapter loaded in the engines for this version; '' = full weights
    run: str = Field("", max_length=256)  # the run's topic prefix; '' = the gateway's own
