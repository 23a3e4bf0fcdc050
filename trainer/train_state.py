"""The train state (model and AdamW moments) as a DCP checkpoint (``torch.distributed.checkpoint``):
each rank writes its own shards straight to the checkpoint URL through fsspec (``s3://`` or ``file://``),
and any number of ranks reads it back, each taking the slices its own sharding needs. So a run saved on
2 ranks resumes on 1, or on 4, and a single process's checkpoint resumes under FSDP2.

Model and optimizer go through ``get_state_dict``/``set_state_dict``: canonical parameter names
(no FSDP or activation-checkpointing wrappers in them) and an optimizer state keyed by those
names, which is what makes the state portable across world sizes.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from infra.settings import Settings

DIR = "train_state"  # <checkpoint>/train_state/: .metadata and one .distcp file per rank


def _io(url: str, settings: Settings, write: bool):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = settings.storage_options(url)
    if write:  # sync_files: each file is flushed before DCP reports it written
        return FsspecWriter(url, single_file_per_rank=True, sync_files=True, overwrite=True, **options)
    return FsspecReader(url, **options)


@contextmanager
def _one_process_is_fine():
    """DCP warns when it runs without a process group; one process saving and loading is our plain case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _options(model: torch.nn.Module):
    """A LoRA model's state is its adapter (the frozen base is the starting model's, read from --model).
    Not strict: the model is filled from the adapter alone (DCP's load already fails on a missing key)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from .lora import is_lora_model

    return StateDictOptions(ignore_frozen_params=True, strict=False) if is_lora_model(model) else None


def _model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, options):
    """``get_state_dict``; with LoRA, the adapter only: ignore_frozen_params still lists a tied head
    (``lm_head.weight``, the frozen embedding under its second name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .lora import is_adapter_param

    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if options is not None:
        model_state = {k: v for k, v in model_state.items() if is_adapter_param(k)}
    return model_state, optim_state


def save(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: Settings) -> None:
    """Write the model and optimizer state under ``url`` (every rank calls it; a collective)."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = _model_state(model, optimizer, _options(model))
    with _one_process_is_fine():
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=_io(url, settings, write=True))


def load(url: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: Settings) -> None:
    """Fill ``model`` and ``optimizer`` (already built for this world size) from the state under ``url``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # get_state_dict gives a fresh optimizer its state (zero moments) so that DCP has tensors to load into
    options = _options(model)
    model_state, optim_state = _model_state(model, optimizer, options)
    state = {"model": model_state, "optim": optim_state}
    with _one_process_is_fine():
        dcp.load(state, storage_reader=_io(url, settings, write=False))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
