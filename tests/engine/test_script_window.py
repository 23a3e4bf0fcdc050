"""Scripted mode with ``script_window``: forced turns scored in one pass over the prompt's tail.

The same ids and vLLM-shaped fields as the full path; logprobs equal the full path's when the window
covers the prompt and are the model's own over the window (checked by teacher forcing) when it does not.
"""

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.test_scripted import SCRIPT, TOOLS

LONG = "Create hello.txt containing hi. " + " ".join(f"word{i}" for i in range(400))


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    from tests.plugins.engine import start_engine_server

    path = tmp_path_factory.mktemp("script") / "script.yaml"
    path.write_text(SCRIPT)
    servers = {w: start_engine_server(tiny_model_dir, script=path, script_window=w) for w in (0, 64, 100_000)}
    yield servers
    for s in servers.values():
        s.stop()


def chat(server, content: str, **kw) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "tools": TOOLS, "logprobs": True,
            "return_token_ids": True, "temperature": 0.7, **kw}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(body: dict) -> torch.Tensor:
    return torch.tensor([e["logprob"] for e in body["choices"][0]["logprobs"]["content"]])


def test_window_covering_the_prompt_equals_the_full_prefill(engines):
    full, wide = chat(engines[0], LONG), chat(engines[100_000], LONG)
    assert wide["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    assert wide["prompt_token_ids"] == full["prompt_token_ids"]
    assert wide["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "tool_calls"
    def message(body):  # tool-call ids are random per response
        m = body["choices"][0]["message"]
        return {**m, "tool_calls": [c["function"] for c in m["tool_calls"]]}

    assert message(wide) == message(full)
    assert (logprobs(wide) - logprobs(full)).abs().max() <= 1e-4
    assert engines[100_000].engine.batcher.stats["scripted_window_jobs"] >= 1
    assert engines[0].engine.batcher.stats["scripted_window_jobs"] == 0


def test_short_window_scores_the_tail_only(engines, tiny_model_dir):
    full, short = chat(engines[0], LONG), chat(engines[64], LONG)
    ids, prompt = short["choices"][0]["token_ids"], short["prompt_token_ids"]
    assert ids == full["choices"][0]["token_ids"] and len(prompt) > 300
    assert short["usage"]["completion_tokens"] == len(ids)
    # the model's own logprobs given only the last 64 prompt tokens (at their real positions)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    start = len(prompt) - 64
    seq = prompt[start:] + ids
    with torch.no_grad():
        logits = model(torch.tensor([seq]), position_ids=torch.arange(start, start + len(seq))[None]).logits[0]
    want = torch.log_softmax(logits[63:-1] / 0.7, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    got = logprobs(short)
    assert (got - want).abs().max() <= 1e-4
    assert (got - logprobs(full)).abs().max() > 1e-3  # a different (shorter) context: not the full prefill's


def test_window_respects_max_tokens_and_n(engines):
    body = chat(engines[64], LONG, max_tokens=3, n=2)
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert all(len(c["token_ids"]) == 3 for c in body["choices"])
    assert body["choices"][0]["token_ids"] == chat(engines[0], LONG)["choices"][0]["token_ids"][:3]


def test_a_prompt_in_another_familys_markup_is_read_by_the_turns_it_holds_as_sampled():
    """No ChatML: k = the script's turns found in the prompt, in order; the tail after the last is what
    ``match`` reads (engine/script.py parse_sampled)."""
    from engine.script import parse_sampled

    turns = ["<tool_call>a</tool_call>", "[TOOL_CALLS]b[ARGS]{}", "done"]
    assert parse_sampled("<|user|>go<|assistant|>", turns) == (0, "<|user|>go<|assistant|>")
    prompt = "<|user|>go<|assistant|><tool_call>a</tool_call><|observation|>result 1<|assistant|>"
    assert parse_sampled(prompt, turns) == (1, "<|observation|>result 1<|assistant|>")
    prompt += "[TOOL_CALLS]b[ARGS]{}</s>[TOOL_RESULTS]result 2[/TOOL_RESULTS]"
    assert parse_sampled(prompt, turns) == (2, "</s>[TOOL_RESULTS]result 2[/TOOL_RESULTS]")
