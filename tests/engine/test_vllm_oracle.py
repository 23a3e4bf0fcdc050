"""vLLM 0.33's own trainer-side code updates our engine (the wheel is the oracle, in its own venv).

tests/engine/vllm_trainer.py runs in the vLLM peer venv (``make vllm-peer``) with vLLM's
``HTTPVLLMWeightSyncClient``, ``ModuleSource`` and ``WeightTransferTrainerFactory.trainer_init`` /
``send_weights`` (a gloo endpoint registered through its factory: NCCL needs a GPU). Whatever it sends, our
engine, in our venv, must take: the wire parameters in the init info, a second round that names no tensors, a
finish without a version, the shutdown. Then the engine's next logprob is the trainer's model's to 1e-5."""

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from schemas.weight_transfer import checksum_key, tensor_sha256

HERE = Path(__file__).parent


def test_vllm_trainer_engine_and_http_client_update_our_engine(vllm_python, engine_server, tiny_model_dir, tmp_path):
    url = engine_server.url
    before = httpx.get(f"{url}/weight_info").json()
    proc = subprocess.run([str(vllm_python), str(HERE / "vllm_trainer.py"), url, str(tiny_model_dir), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]

    calls = json.loads((tmp_path / "calls.json").read_text())
    assert [p for p, _ in calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                     "finish_weight_update", "start_weight_update", "update_weights",
                                     "finish_weight_update", "shutdown_weight_transfer_engine"]
    init_info = calls[0][1]["init_info"]
    assert init_info["packed"] is True and init_info["packed_buffer_size_bytes"] == 1 << 20  # at init, not per round
    assert calls[2][1]["update_info"]["names"] and calls[5][1] == {"update_info": {"names": [], "dtype_names": [],
                                                                                    "shapes": []}}
    info = httpx.get(f"{url}/weight_info").json()
    t = info["transfer"]
    assert t["updates"] == before["transfer"]["updates"] + 2 and t["session"] is None  # two rounds, then it left
    assert t["groups_formed"] == before["transfer"]["groups_formed"] + 1 and t["aborted"] == before["transfer"]["aborted"]
    assert info["policy_version"] == before["policy_version"] + 2  # a finish without a version: the next one

    # the engine serves what vLLM's trainer sent in its second round (named by nothing but the first round's list)
    sent = load_file(str(tmp_path / "sent.safetensors"))
    baseline = {checksum_key(n): tensor_sha256(v) for n, v in sent.items()}
    r = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=60).json()
    assert r == {"match": True, "mismatches": []}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(sent, strict=False)  # the tied head follows the embedding
    prompt = [5, 6, 7, 8, 9]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "seed": 7, "logprobs": 0,
            "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(expected[choice["token_ids"][0]].item(), abs=1e-5)
