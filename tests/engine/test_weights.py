"""Weight updates from file:// and s3:// checkpoints, pause/resume/drain, and the policy version."""

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from infra import storage


def greedy(client, prompt="Hello there", n=8):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.headers["x-policy-version"], r.json()["policy_version"]


@pytest.fixture(scope="module")
def new_checkpoint(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight perturbed, saved in HF layout the way the trainer saves it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp_path_factory.mktemp("ckpt") / "step-1"
    model.save_pretrained(out)
    return out


def test_update_weights_changes_outputs_and_version(engine_server, new_checkpoint, tiny_model_dir):
    with httpx.Client(base_url=engine_server.url, timeout=60) as c:
        before, header, field = greedy(c)
        assert header == "0" and field == 0
        r = c.post("/update_weights", json={"checkpoint_url": f"file://{new_checkpoint}", "version": 1})
        assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 1 and r.json()["status"] == "ok"
        after, header, field = greedy(c)
        assert after != before and header == "1" and field == 1
        assert c.get("/policy_version").json()["policy_version"] == 1
        assert not c.get("/is_paused").json()["is_paused"]  # serving resumed by itself
        # loading the original weights back restores the original outputs exactly
        r = c.post("/update_weights", json={"update_info": {"checkpoint_url": str(tiny_model_dir / "model.safetensors")}})
        assert r.json()["policy_version"] == 2  # no version given: current + 1
        assert greedy(c)[0] == before


def test_bad_checkpoints_are_refused_and_change_nothing(engine_server, tmp_path):
    from safetensors.torch import save_file

    with httpx.Client(base_url=engine_server.url, timeout=60) as c:
        before = greedy(c)
        for url, words in [(f"file://{tmp_path}/missing", "no checkpoint"),
                           (f"file://{tmp_path}", "neither model.safetensors"),
                           ("ftp://host/x", "unsupported scheme")]:
            r = c.post("/update_weights", json={"checkpoint_url": url, "version": 5})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, tmp_path / "model.safetensors")
        r = c.post("/update_weights", json={"checkpoint_url": f"file://{tmp_path}", "version": 5})
        assert r.status_code == 400 and "lacks" in r.json()["error"]["message"]
        (tmp_path / "model.safetensors").write_bytes(b"garbage")
        r = c.post("/update_weights", json={"checkpoint_url": f"file://{tmp_path}/model.safetensors", "version": 5})
        assert r.status_code == 400 and "not a readable safetensors" in r.json()["error"]["message"]
        assert greedy(c) == before


@pytest.mark.integration
def test_update_weights_from_s3(engine_server_factory, polar_settings, new_checkpoint):
    url = storage.join(polar_settings.checkpoint_url, "step-1")
    for f in new_checkpoint.iterdir():
        storage.write_bytes(storage.join(url, f.name), f.read_bytes(), polar_settings)
    server = engine_server_factory(settings=polar_settings)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/update_weights", json={"checkpoint_url": url, "version": 7})
        assert r.status_code == 200, r.text
        ids, header, _ = greedy(c)
    local = engine_server_factory()
    with httpx.Client(base_url=local.url, timeout=60) as c:
        c.post("/update_weights", json={"checkpoint_url": f"file://{new_checkpoint}", "version": 7})
        assert greedy(c)[:2] == (ids, header)


async def test_pause_holds_new_requests_and_update_drains(engine_server, new_checkpoint):
    async with httpx.AsyncClient(base_url=engine_server.url, timeout=60) as c:
        batcher = engine_server.engine.batcher
        running = asyncio.create_task(c.post("/v1/completions", json={"prompt": "long", "max_tokens": 30, "ignore_eos": True}))
        while not batcher.running:
            await asyncio.sleep(0.005)
        # a weight update waits for the running request, which finishes on the old weights
        update = asyncio.create_task(c.post("/update_weights", json={"checkpoint_url": f"file://{new_checkpoint}", "version": 3}))
        old = await running
        assert old.json()["policy_version"] == 0 and len(old.json()["choices"][0]["text"]) > 0
        assert (await update).json()["policy_version"] == 3
        # paused with keep: a new request waits in the queue until resume (wait and abort answer 503: below)
        assert (await c.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await c.get("/is_paused")).json() == {"is_paused": True}
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
        while not batcher._pending:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        assert not held.done() and not batcher.running
        await c.post("/resume")
        r = await held
        assert r.status_code == 200 and r.headers["x-policy-version"] == "3"


async def test_pause_abort_ends_running_requests(engine_server):
    async with httpx.AsyncClient(base_url=engine_server.url, timeout=60) as c:
        running = asyncio.create_task(c.post("/v1/completions", json={"prompt": "long", "max_tokens": 2000, "ignore_eos": True,
                                                                      "return_token_ids": True}))
        while not engine_server.engine.batcher.running:
            await asyncio.sleep(0.005)
        assert (await c.post("/pause", params={"mode": "abort"})).json() == {"status": "paused"}
        (choice,) = (await running).json()["choices"]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 2000
        # as vLLM: while paused in abort (its default) or wait mode, new requests are answered 503, not held
        refused = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503, refused.text
        await c.post("/resume")
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200
        assert (await c.post("/pause")).json() == {"status": "paused"}  # mode abort by default
        assert (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 2})).status_code == 503
        await c.post("/resume")
        assert (await c.post("/pause", params={"mode": "wait"})).json() == {"status": "paused"}
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 503
        await c.post("/resume")
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200


async def test_a_storage_update_honours_a_keep_pause(engine_server, new_checkpoint):
    """Both weight routes swap through one helper that keeps the pause the engine was given: under ``keep``
    the frozen request is not drained (the old route re-paused with ``wait`` and hung on it), the engine
    stays paused after the swap, and the request goes on after /resume."""
    async with httpx.AsyncClient(base_url=engine_server.url, timeout=60) as c:
        batcher = engine_server.engine.batcher
        running = asyncio.create_task(c.post("/v1/completions", json={"prompt": "long", "max_tokens": 40, "ignore_eos": True}))
        while not batcher.running:
            await asyncio.sleep(0.005)
        assert (await c.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        version = batcher.policy_version + 1
        r = await c.post("/update_weights", json={"checkpoint_url": f"file://{new_checkpoint}", "version": version})
        assert r.status_code == 200 and r.json()["policy_version"] == version, r.text
        assert r.json()["pause_s"] >= 0
        assert (await c.get("/is_paused")).json() == {"is_paused": True}
        assert batcher.running and not running.done()  # frozen, not drained
        await c.post("/resume")
        done = await running
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
