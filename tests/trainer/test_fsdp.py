"""FSDP2 on 2 CPU ranks (gloo) takes the same step as one process on the same samples: every parameter's
gradient, the gradient norm and the loss sums agree to 1e-5 in fp32, for per-request and prefix-merged
traces and for seq_mean, for each loss and correction (issue 65) with its clip acting (the ratio against a
proximal policy off the current one: issue 74), on the tiny model, whose head is tied to its embedding. After an update the
ranks export the weights (each writes its own shard file): transformers and our engine load the
directory and give the trained model's logits (issue 50)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.models import ensure_model

from tests.trainer.fsdp_step import CASES, PROBE, micro_batches, samples, step

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCRIPT = Path(__file__).with_name("fsdp_step.py")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Each case's step on 2 ranks (one torchrun for all cases: a rank's start-up is most of the time)."""
    out = tmp_path_factory.mktemp("fsdp") / "grads.pt"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(ensure_model("tiny")), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("builder, loss_norm, variant", CASES)
def test_a_sharded_step_equals_one_process(sharded, builder, loss_norm, variant):
    from transformers import AutoConfig

    from trainer.attention import load_model

    model_dir = ensure_model("tiny")
    assert AutoConfig.from_pretrained(model_dir).tie_word_embeddings  # the case FSDP2 setups get wrong
    model = load_model(model_dir, torch.float32, "auto").train()
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    grads, norm, sums = step(model, micro_batches(samples(builder, loss_norm, vocab)), "cpu", variant)
    got = sharded[f"{builder}/{loss_norm}/{variant}"]
    assert got["strategy"] == "fsdp"
    assert set(got["grads"]) == set(grads)
    # each parameter's gradient to 1e-5, relative to its own size (a layer averaged over ranks is off by 0.5)
    worst = max(((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in grads.items())
    assert worst <= 1e-5, f"largest relative gradient difference {worst:.2e}"
    assert got["norm"] == pytest.approx(norm, rel=1e-5) and norm > 0
    for key in ("loss", "tokens", "corrected", "clipped", "ratio"):
        assert got["sums"][key] == pytest.approx(sums[key], abs=1e-5, rel=1e-6), key
    assert 0 < sums["clipped"] < sums["tokens"], sums  # the clip acts on some tokens: the case tests it
    if variant in ("icepop", "seq_mask_geo"):  # the band masks some tokens, not all: the case tests the mask
        assert 0 < sums["corrected"] < sums["tokens"], sums


def _export_dir(sharded) -> Path:
    return Path(sharded["export_dir"])


def test_the_sharded_export_loads_in_transformers_and_the_engine_with_the_trained_logits(sharded, engine_server):
    import httpx
    from transformers import AutoModelForCausalLM

    files = sharded["export_files"]
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # one per rank
    assert {"model.safetensors.index.json", "config.json", "tokenizer.json"} <= set(files)
    export = _export_dir(sharded)
    trained = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = trained(torch.tensor([PROBE])).logits
    assert (logits - sharded["logits"]).abs().max().item() <= 1e-5
    start = AutoModelForCausalLM.from_pretrained(ensure_model("tiny")).eval()
    with torch.no_grad():
        assert (start(torch.tensor([PROBE])).logits - logits).abs().max().item() > 1e-3  # the update moved them
    # our engine loads the directory through /update_weights; the logprobs it samples with are the trained model's
    with httpx.Client(base_url=engine_server.url, timeout=60) as c:
        r = c.post("/update_weights", json={"checkpoint_url": f"file://{export}", "version": 1})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": PROBE, "max_tokens": 4, "temperature": 0, "logprobs": 0,
                                            "return_token_ids": True})
        assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        full = torch.log_softmax(trained(torch.tensor([PROBE + ids])).logits[0].double(), -1)
    expected = [full[len(PROBE) - 1 + i, tok].item() for i, tok in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(served, expected)) <= 1e-5, (served, expected)
