"""A model name or path -> what can be loaded, and the one tokenizer loader, with one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .builtin import ensure_model, parse_builtin

# A directory the gateway, its node and the viewer can load a tokenizer and chat template from holds one of these.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")

# What the hub accepts as a repo id: ``name`` or ``org/name`` (no ``--`` or ``..``, checked apart).
_HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?(?:/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?)?")


def is_hub_id(name: str) -> bool:
    """True when ``name`` could be a Hugging Face repo id (``org/name``), so a lookup on the hub makes sense."""
    return len(name) <= 96 and _HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None, *, needs: tuple[str, ...] = ("config.json",)) -> str:
    """Built-in name -> its cached directory; a local model directory or a hub id is returned unchanged.

    A local directory must hold one of ``needs`` (a model's config.json; the gateway asks for tokenizer
    files). FileNotFoundError says what was tried when the name is none of the three."""
    if Path(name_or_path).exists():
        if not any((Path(name_or_path) / f).is_file() for f in needs):
            raise FileNotFoundError(f"model {name_or_path!r}: not a model directory (no {' or '.join(needs)})")
        return name_or_path
    try:
        builtin = parse_builtin(name_or_path)
    except ValueError as e:
        raise FileNotFoundError(f"model {name_or_path!r}: {e}") from None
    if builtin is not None:
        return str(ensure_model(name_or_path, cache_dir))
    if not is_hub_id(name_or_path):
        raise FileNotFoundError(f"model {name_or_path!r}: no such directory (tried it as a local path; it is not a hub id "
                                "like org/name, nor a built-in name: tiny, tiny:SEED, smollm2)")
    return name_or_path


def resolve_tokenizer_model(name_or_path: str) -> str:
    """``resolve_model`` for what loads only a tokenizer and chat template (the gateway, its node, the viewer):
    a local directory needs tokenizer files, not weights."""
    return resolve_model(name_or_path, needs=TOKENIZER_FILES)


def local_model_dir(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """The local directory every component of a run loads the model from: a built-in name's cached directory
    (built once), a local model directory (absolute), or a hub id's snapshot in the local Hugging Face cache.

    Nothing is downloaded: a run starts several processes, and each asking the hub on its own would be
    slow where it works and fail late where it does not. FileNotFoundError of one line saying what was tried."""
    found = resolve_model(name_or_path, cache_dir)
    if Path(found).exists():
        return Path(found).absolute()
    from huggingface_hub import snapshot_download  # a hub id: only its snapshot already on this machine
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(found, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"model {name_or_path!r}: no such directory, not a built-in name (tiny, tiny:SEED, "
                                f"smollm2), and no hub id {found!r} in the local Hugging Face cache (nothing is "
                                "downloaded)") from None
    return Path(resolve_model(str(snapshot)))  # a snapshot of only some files is not a model either


def model_load_error(name_or_path: str, path: str, e: OSError) -> FileNotFoundError:
    """The one-line error for a model that transformers could not load from ``path``, saying what was tried."""
    reason = " ".join(str(e).split())[:300]
    if Path(path).is_dir():
        return FileNotFoundError(f"model {name_or_path!r}: cannot load the local directory {path}: {reason}")
    return FileNotFoundError(f"model {name_or_path!r}: not a local directory, and the Hugging Face hub did not provide it "
                             f"(tried hub id {path!r}): {reason}")


def load_tokenizer(name_or_path: str | Path, *, download: bool = False) -> Any:
    """The tokenizer of a local model directory, or of a hub id already in the local HF cache.

    Only ``download=True`` asks the hub (the engine serving a hub id); transformers' OSError then
    reaches the caller, which names the model (``model_load_error``). Without it the hub is never
    asked, and a missing tokenizer is one FileNotFoundError line."""
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is loaded

    if download:
        return AutoTokenizer.from_pretrained(name_or_path)
    # OSError is transformers' word for "no tokenizer there"; a directory without tokenizer files is a
    # ValueError ("Couldn't instantiate the backend tokenizer"). Either way: what was tried, in one line.
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as e:
        where = "the local directory" if Path(name_or_path).is_dir() else "the local Hugging Face cache for hub id"
        raise FileNotFoundError(f"model {str(name_or_path)!r}: no tokenizer in {where} {str(name_or_path)!r} "
                                f"(nothing is downloaded): {' '.join(str(e).split())[:300]}") from e
