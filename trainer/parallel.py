"""How the trainer's model is spread over its processes: FSDP2 when torchrun starts several, one plain
model otherwise.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps 1/world of every parameter, gradient and AdamW
moment on each rank and gathers a layer's weights only while that layer runs, so a model that does not
fit one device trains on several. The model is built in the order FSDP2 needs (../shared/docs/fsdp2-dcp.md):

1. on the meta device (no memory), activation checkpointing per decoder layer;
2. ``fully_shard`` per decoder layer, then the root (embeddings, final norm and a tied head are the root's);
3. ``to_empty`` on the real device, the rotary tables recomputed (buffers are not in the weights files);
4. each rank reads only its own slice of every tensor from the HF safetensors (DCP's HF reader).

Gradients are summed over ranks, not averaged: the per-token weights are normalized over the whole step
on every rank alike (packing.assign_weights), so the sum is the step's gradient. FSDP2's AVG reduce on
gloo once summed silently (pytorch #162338); asking for the sum ourselves leaves nothing to that path.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STRATEGIES = ("auto", "fsdp")  # auto: FSDP2 when torchrun starts several processes, one plain model otherwise


@dataclass(frozen=True)
class Placement:
    """Where this process trains: its rank among ``world``, its device, and how the model is spread."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    strategy: str = "single"  # single (one plain model) or fsdp

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """A process group is up (every rank, and FSDP2 on one rank, take part in collectives)."""
        return self.strategy == "fsdp"


def place(strategy: str = "auto", timeout_s: float = 1800.0, cpu: bool = False) -> Placement:
    """Join torchrun's process group when torchrun started us (FSDP2); ``fsdp`` in one process shards over
    a group of one (the GPU check's world-size-1 FSDP2 step). ``cpu``: CPU and gloo even where CUDA is."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    cuda = torch.cuda.is_available() and not cpu
    launched = dist.is_torchelastic_launched()
    if not launched and strategy == "auto":
        device = torch.device("cuda:0") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        return Placement(device=device)
    backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
    if launched:  # every collective fails after timeout_s instead of hanging (see config.py dist_timeout_s)
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Placement(rank, world, device, "fsdp")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, by the class names transformers keeps whole (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (no _no_split_modules)")
    return layers


def build_model(model_dir: str | Path, placement: Placement, dtype: torch.dtype, attn: str,
                activation_checkpointing: bool = False, weights: bool = True, lora=None) -> torch.nn.Module:
    """The model to train, in train mode on ``placement.device``: a plain one, or FSDP2-sharded.
    ``weights=False``: the architecture of ``model_dir`` without reading its weights files, for a resume
    whose train state fills every parameter next (a large model is read once, not twice).
    ``lora``: a TrainConfig with ``lora_rank > 0``: peft's LoRA layers on the frozen base (trainer/lora.py),
    injected before sharding, the adapter at its seeded initial value."""
    from . import lora as lora_mod
    from .attention import load_model

    lora = lora if lora is not None and lora_mod.enabled(lora) else None
    if placement.strategy == "fsdp":
        return _fsdp_model(model_dir, placement, dtype, attn, activation_checkpointing, weights, lora)
    if lora is not None:  # a LoRA train state holds the adapter only: the base is always read
        model = lora_mod.apply_lora(load_model(model_dir, dtype, attn, activation_checkpointing), lora)
        lora_mod.init_adapter(model, lora.seed)
        return model.to(placement.device).train()
    if weights:
        return load_model(model_dir, dtype, attn, activation_checkpointing).to(placement.device).train()
    return _unloaded_model(model_dir, placement.device, dtype, attn, activation_checkpointing).train()


def _unloaded_model(model_dir, device: torch.device, dtype: torch.dtype, attn: str, activation_checkpointing: bool):
    """Built from the config on ``device`` (initialized, so every buffer is right); its weights come later."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .attention import NAME, register

    impl = register() if attn in ("auto", "varlen", NAME) else attn
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype,
                                                 attn_implementation=impl)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _fsdp_model(model_dir, placement: Placement, dtype: torch.dtype, attn: str, activation_checkpointing: bool,
                weights: bool = True, lora=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from .attention import NAME, register

    impl = register() if attn in ("auto", "varlen", NAME) else attn
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    if activation_checkpointing:  # before sharding: the recomputed layer gathers its weights again
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:  # before sharding: each adapter is sharded with the decoder layer that holds it
        from .lora import apply_lora

        apply_lora(model, lora)
    # An explicit CPU mesh on a CUDA host would otherwise put the shards on the GPU (pytorch #132471).
    mesh = init_device_mesh(placement.device.type, (placement.world,))
    # bf16 compute with fp32 gradient reduction on CUDA; fp32 throughout on CPU (gloo's mixed precision is untested upstream)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if placement.device.type == "cuda" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # the sum over ranks (see the module docstring), as a plain SUM (gloo has no pre-multiplied sum); each
    # sharded layer reduces its own gradients, so each is told (the root alone left the layers averaged)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=placement.device)
    _rotary_tables(model, placement.device)
    if weights or lora is not None:  # a LoRA train state holds the adapter only: the base is read here
        load_slices(model, model_dir)
    if lora is not None:
        from .lora import init_adapter

        init_adapter(model, lora.seed)
    return model.train()


def _rotary_tables(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute the rotary embeddings' frequency tables: non-persistent buffers, so not in the weights
    files, and ``to_empty`` left them uninitialized."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_type") and hasattr(m, "config"):
            fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
            inv_freq, m.attention_scaling = fn(m.config, device)
            m.inv_freq = inv_freq.to(device)
            if hasattr(m, "original_inv_freq"):
                m.original_inv_freq = inv_freq.clone().to(device)


def load_slices(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Fill a sharded model from an HF safetensors directory: each rank reads only its slice of each
    tensor (DCP's HF reader opens the files with ``get_slice``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from .lora import is_adapter_param

    # a LoRA model's base weights sit under peft's base_layer; its adapter is not in the files
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if not is_adapter_param(k)}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding's own tensor: files of tied models omit it
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(model_dir)))


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most ``max_norm`` (as torch's
    ``clip_grad_norm_``: by max_norm / (norm + 1e-6) when above it); returns the norm before clipping.

    Under FSDP2 each rank holds a shard of every gradient: the squares of the local shards are summed
    over ranks (in float64), so the norm is the whole model's on every rank. torch's own function on
    DTensor gradients returned one rank's share here (2 gloo ranks: 0.76 of the true norm)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    sharded = [g for g in grads if hasattr(g, "to_local")]
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in sharded:
        squares += g.to_local().double().pow(2).sum()
    if sharded and dist.is_initialized():
        dist.all_reduce(squares)
    for g in grads:
        if not hasattr(g, "to_local"):
            squares += g.double().pow(2).sum()
    norm = float(squares.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:  # a non-finite norm is not clipped: the caller skips that update (optim.skip_update_reason)
        for g in grads:
            g.mul_(coef)
    return norm


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds of parameters, their gradients and the optimizer's state (local shards only)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in (optimizer.state.values() if optimizer is not None else ()):
        total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total
