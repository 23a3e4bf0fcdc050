"""LoRA adapters served on top of the base model, several at once, mixed within one batch.

An adapter is read from PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``) in a
local directory or at an fsspec URL (``s3://...``), as ``engine/weights.py`` reads full checkpoints.
For every targeted ``nn.Linear`` it adds ``(alpha / r) * B (A x)`` to the base output (``alpha /
sqrt(r)`` with ``use_rslora``), which is what PEFT's ``lora.Linear`` computes at inference (dropout is
off in eval mode).

Why a small layer of our own rather than peft's ``PeftModel``: peft applies one active adapter to the
whole batch, while our decode step batches every live sequence, and those may belong to different
adapters (and to the base). Here each targeted module carries one forward hook; before every forward
the batcher names, per batch row, the adapter of that row (``Adapters.rows``), and the hook adds each
adapter's delta to its own rows only. A batch of base rows costs one attribute check per module.

A job holds its ``Adapter`` object, not its name: unloading removes the name at once (new requests
naming it get vLLM's 404), while requests already admitted finish with the tensors they started with.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors

from infra.settings import Settings
from infra.storage import filesystem

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
VLLM_MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank once LoRA is enabled (vllm/config/lora.py)
_PREFIX = "base_model.model."  # PEFT's key prefix (the PeftModel wrapping the causal LM)


def is_lora_key(key: str) -> bool:
    """A PEFT LoRA tensor name (``....lora_A.weight``, ``....lora_B.<adapter>.weight``)."""
    return key.endswith(".weight") and (".lora_A." in key or ".lora_B." in key)


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass(eq=False)  # identity: two loads of the same files are two adapters (their KV differs by name only)
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # module -> (A (r, in), B (out, r))

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)


def scaling_of(config: dict) -> tuple[int, float]:
    """(r, scaling) of a PEFT LoRA config: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if r <= 0:
        raise AdapterError(f"{CONFIG_FILE}: r must be positive, got {r}")
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def check_config(config: dict) -> None:
    """Refuse PEFT options this engine does not apply (serving them silently wrong would poison rollouts)."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise AdapterError(f"{CONFIG_FILE}: {', '.join(bad)} not supported by this engine")


def read_adapter(name: str, url: str, model: torch.nn.Module, settings: Settings) -> Adapter:
    """The adapter stored at ``url``, checked against ``model`` and moved to its device and dtype."""
    fs, path = filesystem(url, settings)
    base = path.rstrip("/")
    if not fs.exists(f"{base}/{CONFIG_FILE}"):
        raise AdapterError(f"No adapter found at {url}: it holds no {CONFIG_FILE}")
    if not fs.exists(f"{base}/{WEIGHTS_FILE}"):
        raise AdapterError(f"No adapter found at {url}: it holds no {WEIGHTS_FILE}")
    try:
        config = json.loads(fs.cat_file(f"{base}/{CONFIG_FILE}"))
    except ValueError as e:
        raise AdapterError(f"{url}/{CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{url}/{CONFIG_FILE} is not a JSON object")
    check_config(config)
    rank, scaling = scaling_of(config)
    try:
        tensors = load_safetensors(fs.cat_file(f"{base}/{WEIGHTS_FILE}"))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise AdapterError(f"{url}/{WEIGHTS_FILE}: not a readable safetensors file ({e})") from None
    return Adapter(name, url, rank, scaling, pair_weights(tensors, model, rank))


def adapter_from_tensors(name: str, source: str, config: dict, tensors: dict[str, torch.Tensor],
                         model: torch.nn.Module) -> Adapter:
    """An adapter whose tensors arrived by the in-memory weight transfer (PEFT keys, as in
    ``adapter_model.safetensors``) with the ``adapter_config.json`` content sent beside them; checked as
    ``read_adapter`` checks files. ``source`` names where it came from (``/v1/models``' root)."""
    if not isinstance(config, dict):
        raise AdapterError(f"lora_config must be the {CONFIG_FILE} object, got {type(config).__name__}")
    check_config(config)
    rank, scaling = scaling_of(config)
    return Adapter(name, source, rank, scaling, pair_weights(tensors, model, rank))


def pair_weights(tensors: dict[str, torch.Tensor], model: torch.nn.Module, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT keys (``base_model.model.<module>.lora_A.weight``, also with an adapter name before
    ``.weight``) -> {module: (A, B)}, every shape checked against the model's linear layers."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        body = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in body and body.endswith(".weight"):
                halves.setdefault(body.split(marker)[0], {})[part] = t
                break
        else:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight of a linear layer")
    if not halves:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    out = {}
    param = next(model.parameters())
    for module, ab in sorted(halves.items()):
        if module not in linears:
            raise AdapterError(f"adapter targets {module!r}, which is not a linear layer of the served model")
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{module}: adapter has {sorted(ab)} but needs both lora_A and lora_B")
        lin, a, b = linears[module], ab["lora_A"], ab["lora_B"]
        if tuple(a.shape) != (rank, lin.in_features) or tuple(b.shape) != (lin.out_features, rank):
            raise AdapterError(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit r={rank} on a "
                               f"({lin.out_features}, {lin.in_features}) layer")
        out[module] = (a.to(param.device, param.dtype), b.to(param.device, param.dtype))
    return out


class Adapters:
    """The loaded adapters by name, and the hooks that apply them to the rows of each forward pass."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self._hooked: set[str] = set()
        self._rows = threading.local()  # the engine thread's current batch: one Adapter | None per row

    def get(self, name: str) -> Adapter | None:
        return self.loaded.get(name)

    def hook(self, adapter: Adapter) -> None:
        """Hook the modules ``adapter`` targets (once per module). Call between steps: hooks must not
        change while a forward runs."""
        modules = dict(self.model.named_modules())
        for name in adapter.weights:
            if name not in self._hooked:
                modules[name].register_forward_hook(self._hook(name))
                self._hooked.add(name)

    def add(self, adapter: Adapter) -> None:
        """Serve ``adapter`` under its name (replacing one of the same name); its modules are hooked."""
        assert set(adapter.weights) <= self._hooked, "hook() the adapter between steps first"
        self.loaded[adapter.name] = adapter

    def remove(self, name: str) -> Adapter | None:
        return self.loaded.pop(name, None)

    @contextmanager
    def rows(self, per_row: Sequence[Adapter | None]) -> Iterator[None]:
        """Apply ``per_row[i]`` to batch row i in the forward passes run inside this block."""
        self._rows.value = None if all(a is None for a in per_row) else list(per_row)
        try:
            yield
        finally:
            self._rows.value = None

    def _hook(self, module: str):
        def hook(mod: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            per_row = getattr(self._rows, "value", None)
            if per_row is None:
                return None
            return output + delta(module, inputs[0], per_row)
        return hook


def delta(module: str, x: torch.Tensor, per_row: list[Adapter | None]) -> torch.Tensor:
    """Sum over adapters of ``scaling * B (A x)`` on their own rows of ``x`` (rows = dim 0)."""
    out = None
    groups: dict[int, tuple[Adapter, list[int]]] = {}
    for i, a in enumerate(per_row):
        if a is not None and module in a.weights:
            groups.setdefault(id(a), (a, []))[1].append(i)
    for a, rows in groups.values():
        A, B = a.weights[module]
        if len(rows) == x.shape[0]:  # the whole batch (every prefill): no gather
            d = (x @ A.T) @ B.T * a.scaling
            out = d if out is None else out + d
            continue
        idx = torch.tensor(rows, device=x.device)
        d = (x.index_select(0, idx) @ A.T) @ B.T * a.scaling
        if out is None:
            out = torch.zeros(*x.shape[:-1], B.shape[0], dtype=d.dtype, device=x.device)
        out.index_add_(0, idx, d)
    return out if out is not None else torch.zeros((), dtype=x.dtype, device=x.device)
