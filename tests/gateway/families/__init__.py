"""Model-family fixtures the project builds, since no hub is reachable: the built-in tiny model with one
family's special tokens added to its tokenizer (each a single token, as in the family's own vocabulary;
the embeddings grown to cover them) and the family's published chat template (``<family>.jinja`` here,
its source on its first line). The gateway, the engine and real CLIs then see that family's markup,
token for token, on a model that runs on a CPU.

``family_dir(name)`` builds one once into the model cache and returns its directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Family:
    special: tuple[str, ...]  # the family's special tokens (each one id)
    eos: str  # what ends an assistant turn the model writes (the tokenizer's eos)
    stops: tuple[str, ...] = ()  # further tokens generation stops at (generation_config eos_token_id)
    bos: str = ""  # the template's bos_token, where it renders one


FAMILIES: dict[str, Family] = {
    "harmony": Family(("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                       "<|call|>", "<|endoftext|>", "<|startoftext|>"), eos="<|return|>", stops=("<|call|>",)),
    "llama3": Family(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), eos="<|eot_id|>", stops=("<|eom_id|>",),
                     bos="<|begin_of_text|>"),
    "glm45": Family(("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                     "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                     "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
                    eos="<|endoftext|>", stops=("<|user|>", "<|observation|>")),
    "deepseek": Family(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                        "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                        "<｜tool▁output▁end｜>", "<think>", "</think>"),
                       eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
    "kimi_k2": Family(("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "[BOS]",
                       "[EOS]", "[EOT]", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                       "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>",
                       "</think>"), eos="<|im_end|>"),
    "mistral": Family(("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                       "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]",
                       "[CALL_ID]", "[THINK]", "[/THINK]"), eos="</s>", bos="<s>"),
    "minimax_m2": Family(("]~!b[", "]~b]", "[e~[", "]!d~[", "]!p~[", "<minimax:tool_call>", "</minimax:tool_call>",
                          "<think>", "</think>"), eos="[e~["),
}


def template(name: str) -> str:
    """The family's published chat template (the fixture file)."""
    return (HERE / f"{name}.jinja").read_text()


def family_dir(name: str) -> Path:
    """The tiny model dressed as family ``name`` (tokenizer, template, embeddings): built once, cached."""
    from infra.models import build_once, ensure_model
    from infra.settings import CACHE_DIR

    fam = FAMILIES[name]
    tiny = ensure_model("tiny")
    key = hashlib.sha256(json.dumps([tiny.name, name, fam.special, fam.eos, fam.stops, fam.bos,
                                     template(name)]).encode()).hexdigest()[:12]
    return build_once(CACHE_DIR / "models" / f"family-{name}-{key}", lambda out: _build(tiny, name, fam, out))


def _build(tiny: Path, name: str, fam: Family, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny)
    tok.add_special_tokens({"additional_special_tokens": list(fam.special)})
    tok.eos_token = fam.eos
    if fam.bos:
        tok.bos_token = fam.bos
    tok.chat_template = template(name)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    torch.manual_seed(0)  # the new rows are drawn: the same fixture on every machine
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    stops = tok.convert_tokens_to_ids([fam.eos, *fam.stops])
    model.config.eos_token_id = stops[0]
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "polarstream.json").write_text(json.dumps({"builder": "family", "family": name, "base": tiny.name}) + "\n")
