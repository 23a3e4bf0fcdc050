"""LoRA adapters through vLLM's runtime API: the engine's logprobs with an adapter equal peft's own
model's (1e-5), adapters and the base mixed in one decode batch, unload while a request runs."""

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from infra.process import free_port
from tests.plugins.engine import start_engine_server
from tests.plugins.lora import lora_logprobs, make_adapter

PROMPT = "Create a file named hello.txt that contains hi"
TOL = 1e-5


@pytest.fixture(scope="module")
def adapters(peft_adapters):
    return peft_adapters


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    server = start_engine_server(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def generate(client, model, seed=3, max_tokens=12):
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0,
                                             "seed": seed, "logprobs": 0, "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return r.json()["model"], choice["prompt_token_ids"], choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])


def check(adapters, key, prompt_ids, ids, got):
    want = lora_logprobs(adapters[key][1], prompt_ids, ids)
    assert (got - want).abs().max().item() <= TOL


def load(client, name, path, **extra):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def test_load_serve_and_list(client, adapters, served):
    for name in ("a", "b"):
        r = load(client, name, adapters[name][0])
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' added successfully."
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["a"]["parent"] == cards["b"]["parent"] == "tiny" and cards["tiny"]["parent"] is None
    outs = {}
    for key in ("a", "b", None):
        model, prompt_ids, ids, got = generate(client, key or "tiny")
        assert model == (key or "tiny")
        check(adapters, key, prompt_ids, ids, got)
        outs[key] = got
    # each adapter changes the distribution (the same seed, different logprobs)
    assert (outs["a"][0] - outs[None][0]).abs() > 1e-3 and (outs["b"][0] - outs[None][0]).abs() > 1e-3
    r = client.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "a"
    # a second load under a taken name is vLLM's 400; load_inplace replaces it
    r = load(client, "a", adapters["a"][0])
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in r.json()["error"]["message"]
    assert load(client, "a", adapters["a"][0], load_inplace=True).status_code == 200


def test_mixed_batch(client, adapters, served):
    """Adapters a, b and the base admitted in the same step, so every decode step mixes the three."""
    for name in ("a", "b"):
        if name not in served.engine.adapters.loaded:
            assert load(client, name, adapters[name][0]).status_code == 200
    batcher = served.engine.batcher
    before = batcher.stats["max_rows"]
    results = {}
    batcher.pause("wait")
    try:
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, generate(client, k or "tiny", seed=11)))
                   for k in ("a", "b", None)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(batcher._pending) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        batcher.resume()
    for t in threads:
        t.join(60)
    assert before < 3 <= batcher.stats["max_rows"]  # the earlier tests ran one request at a time
    for key, (_, prompt_ids, ids, got) in results.items():
        check(adapters, key, prompt_ids, ids, got)


def test_unload(client, adapters, served):
    if "b" not in served.engine.adapters.loaded:
        assert load(client, "b", adapters["b"][0]).status_code == 200
    batcher, result = served.engine.batcher, {}
    batcher.pause("wait")  # the request is queued with adapter b when b is unloaded
    try:
        t = threading.Thread(target=lambda: result.setdefault("b", generate(client, "b", seed=5)))
        t.start()
        deadline = time.monotonic() + 30
        while not batcher._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    finally:
        batcher.resume()
    t.join(60)
    _, prompt_ids, ids, got = result["b"]
    check(adapters, "b", prompt_ids, ids, got)  # it finished with the adapter it was admitted with
    # the name is gone: vLLM's 404s
    r = client.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and err["message"].startswith("The model `b` does not exist.")
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"] == {"message": "The lora adapter 'b' cannot be found.",
                                                          "type": "NotFoundError", "param": None, "code": 404}
    assert "b" not in {c["id"] for c in client.get("/v1/models").json()["data"]}


def test_bad_adapters(client, tmp_path):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = load(client, "x", tmp_path / "nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("No adapter found")
    r = load(client, "tiny", tmp_path)
    assert r.status_code == 400 and "conflicts with a served base model" in r.json()["error"]["message"]


def test_prefix_cache_is_kept_per_adapter(client, adapters, served):
    """A long prompt twice with adapter a: the second reuses a's KV and still matches peft; the base
    then reuses nothing of a's (its logprobs would be wrong if it did)."""
    if "a" not in served.engine.adapters.loaded:
        assert load(client, "a", adapters["a"][0]).status_code == 200
    prompt = "Write a function that adds two numbers, then a test for it, then run the test and report. " * 2
    stats = served.engine.batcher.stats

    def run(model):
        hits = stats["prefix_hit_tokens"]
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0,
                                                 "seed": 1, "logprobs": 0, "return_token_ids": True, "ignore_eos": True})
        (choice,) = r.json()["choices"]
        check(adapters, None if model == "tiny" else model, choice["prompt_token_ids"], choice["token_ids"],
              torch.tensor(choice["logprobs"]["token_logprobs"]))
        return stats["prefix_hit_tokens"] - hits

    run("a")
    assert run("a") > 16
    assert run("tiny") == 0


def test_engine_started_with_lora_modules_serves_them(tiny_model_dir, adapters, monkeypatch):
    """``polarstream engine --enable-lora --max-lora-rank 8 --lora-modules a=DIR``: adapter a is served by
    name from the start, as with vLLM's flags. The real CLI and app; only uvicorn's socket is left out."""
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from polarstream.cli import app as cli_app

    started = {}
    # the engine runs its own uvicorn Server (engine.app.make_server: it ends held requests on SIGTERM)
    monkeypatch.setattr("engine.app.make_server",
                        lambda app, **kw: SimpleNamespace(run=lambda: started.setdefault("app", app)))
    r = CliRunner().invoke(cli_app, ["engine", "--model", str(tiny_model_dir), "--port", str(free_port()),
                                     "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
                                     "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a'][0]}"])
    assert r.exit_code == 0, r.output
    with TestClient(started["app"]) as c:  # runs the lifespan: the engine starts and loads its --lora-modules
        assert {m["id"]: m["parent"] for m in c.get("/v1/models").json()["data"]} == {"tiny": None, "a": "tiny"}
        model, prompt_ids, ids, got = generate(c, "a")
        assert model == "a"
        check(adapters, "a", prompt_ids, ids, got)


def test_lora_rank_limit(tiny_model_dir, adapters, tmp_path, client):
    """--enable-lora brings vLLM's default --max-lora-rank 16: a rank-32 adapter is refused as vLLM words it
    (without LoRA flags this engine sets no limit); a --lora-modules entry that cannot load stops the start."""
    make_adapter(tiny_model_dir, tmp_path / "r32", 3, r=32, lora_alpha=8, target_modules=["q_proj"])
    assert load(client, "big", tmp_path / "r32").status_code == 200  # the module's engine: no flags
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "big"}).status_code == 200
    server = start_engine_server(tiny_model_dir, enable_lora=True)
    try:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path / "r32")})
        assert r.status_code == 400 and r.json()["error"]["message"] == "LoRA rank 32 is greater than max_lora_rank 16."
        assert httpx.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": str(adapters["a"][0])}).status_code == 200  # r=4
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match=r"--lora-modules big=.*r32: LoRA rank 32 is greater than max_lora_rank 8\."):
        start_engine_server(tiny_model_dir, max_lora_rank=8, lora_modules=[("big", str(tmp_path / "r32"))])
