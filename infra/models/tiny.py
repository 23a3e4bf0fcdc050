"""The seeded tiny model: a 2-layer Qwen3 causal LM, its byte-level BPE tokenizer and chat template.

Everything derives from the seed (weights, and the tokenizer through the generated corpus in
``corpus.py``), so two builds with the same seed and spec are byte-identical.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; the defaults are what ``polarstream models build tiny`` makes."""

    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    # Long enough for real harness system prompts (tens of thousands of tokens) to fit.
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    corpus_docs: int = 12000


def _train_tokenizer(seed: int, spec: TinySpec):
    """Byte-level BPE trained on the generated corpus; specials first so their ids are 0, 1, 2."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from .corpus import generate_corpus
    from .tiny_template import ADDED_TOKENS, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text tokenizes
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed, spec.corpus_docs), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, expected {spec.vocab_size}")
    return tok


def build_tiny(out: str | Path, seed: int = 0, spec: TinySpec = TinySpec()) -> Path:
    """Write the tiny model's HF directory to ``out``: deterministic in ``seed`` and ``spec``."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from .tiny_template import CHAT_TEMPLATE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(seed, spec),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    im_end, eot = hf_tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=eot,
    )
    # Initialisation consumes the global RNG in module order; seeding it makes the weights a
    # function of the seed (CPU kernels for normal_/uniform_ are deterministic).
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None)
    model.save_pretrained(out)
    # The template goes inside tokenizer_config.json (not chat_template.jinja) and the class is named
    # PreTrainedTokenizerFast, so transformers 4.x (e.g. a vLLM environment) loads the directory too.
    hf_tok.save_pretrained(out, save_jinja_files=False)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "polarstream.json").write_text(json.dumps({"builder": "tiny", "seed": seed, "spec": asdict(spec)}, indent=2) + "\n")
    return out
