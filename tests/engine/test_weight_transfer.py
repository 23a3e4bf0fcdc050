"""In-memory weight transfer (engine/transfer.py, trainer/sync/broadcast.py): vLLM's routes and bodies on gloo,
verified bit for bit, and a trainer killed or frozen mid-transfer leaves the engines of its group serving what they
served.

One in-process engine serves the whole module (``module_engine_server``): each test asserts on what it
changes, not on a fresh engine's state; the killed trainer is a small process (torch, no transformers)."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.transfer import InitInfo, UpdateInfo, packed_chunks, tensor_sha256
from schemas.weight_transfer import checksum_key
from trainer.sync.broadcast import WeightTransfer, named_tensors, tensor_meta
from trainer.sync.storage import PolarEngine

ROOT = Path(__file__).parents[2]
# vLLM 0.33's field names (vllm/distributed/weight_transfer/nccl_common.py: NCCLWeightTransferInitInfo;
# nccl_engine.py: NCCLWeightTransferUpdateInfo), written out here so a rename on our side fails this test (the
# wheel itself drives the engine in test_vllm_oracle.py). Since 0.28 the wire parameters ride the init info.
VLLM_INIT_INFO = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
                  "packed_buffer_size_bytes", "packed_num_buffers"}
VLLM_UPDATE_INFO = {"names", "dtype_names", "shapes"}
OURS_INIT_INFO = {"relay"}  # our trainer's groups relay down a chain (engine/transfer.py); vLLM's trainer omits it


def perturbed(model_dir, seed: int, scale: float = 0.05):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def completion_logprob(url, prompt):
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 1.0,
                                                  "seed": 7, "logprobs": 0, "return_token_ids": True}, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


def checksums(url):
    r = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    r.raise_for_status()
    return r.json()["checksums"]


def test_protocol_fields_are_vllms():
    assert {f.name for f in dataclasses.fields(InitInfo)} == VLLM_INIT_INFO | OURS_INIT_INFO
    assert InitInfo(master_address="h", master_port=1, rank_offset=1, world_size=2).relay is False  # vLLM's wire
    assert {f.name for f in dataclasses.fields(UpdateInfo)} == VLLM_UPDATE_INFO
    # vLLM's packed cut: a buffer closes once it holds MORE than the buffer size
    assert packed_chunks([4, 4, 4, 4, 10], 8) == [[0, 1, 2], [3, 4]]
    assert packed_chunks([4], 100) == [[0]]


def test_refusals_change_nothing(module_engine_server, engine_server_factory):
    url = module_engine_server.url
    if httpx.get(f"{url}/weight_info").json()["transfer"]["session"] is not None:
        url = engine_server_factory().url  # the shared engine has a group already (a test ran before): a fresh one
    with httpx.Client(base_url=url, timeout=30) as c:
        before, version = checksums(url), c.get("/policy_version").json()["policy_version"]
        assert c.post("/start_weight_update").status_code == 409  # no group
        assert c.post("/finish_weight_update", json={"weight_version": "9"}).status_code == 409
        r = c.post("/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1"}})
        assert r.status_code == 400
        r = c.post("/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                                      "rank_offset": 1, "world_size": 2, "bogus": 1}})
        assert r.status_code == 400 and "bogus" in r.text
        r = c.post("/update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}})
        assert r.status_code == 409  # no group
        r = c.post("/weight_checker", json={"action": "nope"})
        assert r.status_code == 400
        assert c.get("/policy_version").json()["policy_version"] == version and checksums(url) == before


def test_broadcast_is_bit_exact_and_sampling_follows(module_engine_server, tiny_model_dir, monkeypatch):
    url = module_engine_server.url
    sent: list[tuple[str, dict | None]] = []
    real_post = WeightTransfer._post

    def recording(self, e, path, timeout=None, **kw):
        sent.append((path, kw.get("json")))
        return real_post(self, e, path, timeout, **kw)

    monkeypatch.setattr(WeightTransfer, "_post", recording)
    before = checksums(url)
    model = perturbed(tiny_model_dir, 1)
    groups_before = httpx.get(f"{url}/weight_info").json()["transfer"]["groups_formed"]
    wt = WeightTransfer([PolarEngine(url)], "broadcast", timeout_s=5, buffer_bytes=1 << 20, verify=True)
    try:
        report = wt.sync(model, None, 3)
        assert report["broadcast"] == [url] and not report["stale"] and not report["errors"]
        assert report["buffers"] > 1  # packed into several fixed-size buffers
        # every tensor's sha256 on the engine equals the trainer's
        ours = {checksum_key(n): tensor_sha256(t) for n, t in named_tensors(model)}
        served = checksums(url)
        assert all(served[n] == h for n, h in ours.items()) and set(ours) <= set(served)
        assert served != before
        assert wt.verify_engines() == {url: True}
        r = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": before}, timeout=60).json()
        assert r["match"] is False and r["mismatches"]
        # the next sampled logprob is the trainer's model's
        prompt = [5, 6, 7, 8, 9]
        token, logprob = completion_logprob(url, prompt)
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)[token].item()
        assert logprob == pytest.approx(expected, abs=1e-5)
        info = httpx.get(f"{url}/weight_info").json()
        assert info["weight_version"] == "3" and info["policy_version"] == 3
        # vLLM's RL use: reset, transfer again, compare with the baseline; the group is formed once
        assert httpx.post(f"{url}/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
        wt.sync(model, None, 4)
        assert httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": ours}).json()["match"]
        assert httpx.get(f"{url}/weight_info").json()["transfer"]["groups_formed"] == groups_before + 1
        # Buffers are reused across syncs on both ends: the engine receives into the buffers an update installed
        # two updates ago. Two more syncs, each staged first and checked before its swap: what arrives never
        # lands in the buffers the engine serves from.
        reused = httpx.get(f"{url}/weight_info").json()["transfer"]["buffers_reused"]
        for version, seed in ((5, 2), (6, 3)):
            new = perturbed(tiny_model_dir, seed)
            serving = checksums(url)
            assert wt.prepare(tensor_meta(new))
            wt.send(named_tensors(new))
            assert checksums(url) == serving  # staged, not served
            wt.finish(None, version)
            want = {checksum_key(n): tensor_sha256(t) for n, t in named_tensors(new)}
            assert {n: h for n, h in checksums(url).items() if n in want} == want
        assert httpx.get(f"{url}/weight_info").json()["transfer"]["buffers_reused"] > reused
    finally:
        wt.close()
    # the bodies are vLLM's
    paths = [p for p, _ in sent]
    assert paths[:4] == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"]
    bodies = dict(sent[:4])
    assert set(bodies["/init_weight_transfer_engine"]) == {"init_info"}
    init_info = bodies["/init_weight_transfer_engine"]["init_info"]
    # vLLM's trainer drops the unused rendezvous mode too; ours adds the relay
    assert set(init_info) == VLLM_INIT_INFO - {"nccl_unique_id_b64"} | OURS_INIT_INFO and init_info["relay"] is True
    assert init_info["packed"] is True and init_info["packed_buffer_size_bytes"] == 1 << 20
    assert set(bodies["/update_weights"]) == {"update_info"}
    assert set(bodies["/update_weights"]["update_info"]) == VLLM_UPDATE_INFO
    assert bodies["/update_weights"]["update_info"]["dtype_names"][0] == "float32"
    # later rounds in the same group send the same tensors: they name none (vLLM 0.28+), and still arrive
    updates = [body["update_info"] for p, body in sent if p == "/update_weights"]
    assert len(updates) == 4 and updates[0]["names"]
    assert updates[1:] == [{"names": [], "dtype_names": [], "shapes": []}] * 3
    assert bodies["/finish_weight_update"] == {"weight_version": "3"}
    assert bodies["/start_weight_update"] is None


# The trainer to kill: torch and trainer/sync/broadcast.py only (the weights straight from the safetensors file,
# +0.01), so the process costs a torch import, not a transformers model load.
TRAINER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from safetensors.torch import load_file
    from trainer.sync.broadcast import WeightTransfer
    from trainer.sync.storage import PolarEngine
    state = {{n: t + 0.01 for n, t in load_file({weights!r}).items()}}
    meta = [(n, t.dtype, list(t.shape)) for n, t in state.items()]
    wt = WeightTransfer([PolarEngine(u) for u in {urls!r}], "broadcast", timeout_s=5, buffer_bytes=64 << 10,
                        throttle_s=0.05)
    wt.sync(lambda: (meta, iter(state.items())), None, 7)
    print("finished", flush=True)
""")


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_trainer_lost_mid_transfer_leaves_the_engines_serving_their_weights(sig, module_engine_server, engine_server,
                                                                          tiny_model_dir, monkeypatch):
    """Two engines in the trainer's one group (rank 1 relays to rank 2); the trainer killed (its connections
    close: seen at once) or frozen (seen at the engines' deadline) mid-transfer: both drop the staged tensors and
    serve what they served; a restarted trainer forms the group again and syncs both."""
    monkeypatch.setenv("POLAR_WEIGHT_TRANSFER_TIMEOUT_S", "5")  # the engines' deadline (read per call)
    urls = [module_engine_server.url, engine_server.url]
    url = urls[0]
    buffers_before = httpx.get(f"{urls[1]}/weight_info").json()["transfer"]["buffers"]  # over the engine's life
    script = TRAINER.format(root=str(ROOT), weights=str(tiny_model_dir / "model.safetensors"), urls=urls)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    before = {u: checksums(u) for u in urls}  # while the trainer starts
    token_before = {u: completion_logprob(u, [5, 6, 7]) for u in urls}
    version_before = {u: httpx.get(f"{u}/policy_version").json()["policy_version"] for u in urls}
    try:
        # the last rank receiving: the relay works, and both are mid-transfer
        wait_for(lambda: (lambda t: t["receiving"] and t["buffers"] > buffers_before + 2)(
            httpx.get(f"{urls[1]}/weight_info").json()["transfer"]), 120, "the engines receiving")
        os.kill(proc.pid, sig)
        t0 = time.monotonic()
        for u in urls:
            info = wait_for(lambda: (lambda i: i if not i["transfer"]["receiving"] and i["transfer"]["session"] is None
                                     else None)(httpx.get(f"{u}/weight_info").json()), 20, "the engine to drop the transfer")
            assert info["policy_version"] == version_before[u] and info["transfer"]["staged"] == 0
            assert info["transfer"]["last_error"]
        # killed: a dead peer is seen at once; frozen: at the engines' deadline, not later
        assert time.monotonic() - t0 < (5 if sig == signal.SIGKILL else 5 + 6)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)
    for u in urls:
        assert checksums(u) == before[u]
        assert completion_logprob(u, [5, 6, 7]) == token_before[u]  # serving, the same weights
        assert httpx.post(f"{u}/finish_weight_update", json={"weight_version": "7"}).status_code == 409  # none staged
    # a restarted trainer forms the group again and syncs both engines
    model = perturbed(tiny_model_dir, 2)
    wt = WeightTransfer([PolarEngine(u) for u in urls], "broadcast", timeout_s=5, buffer_bytes=1 << 20, verify=True)
    try:
        assert wt.sync(model, None, 7)["broadcast"] == urls
        assert wt.verify_engines() == {u: True for u in urls}
    finally:
        wt.close()
    assert all(httpx.get(f"{u}/policy_version").json()["policy_version"] == 7 for u in urls)
