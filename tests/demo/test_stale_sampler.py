"""rl_run's sampler (``polarstream.demo.learning._Engine``) for issue 74's off-policy runs: one version stale
(S = 1) samples with the weights from before the last step's updates, and a bf16 engine with a bf16 copy."""

from __future__ import annotations

import torch

from polarstream.demo.learning import _Engine
from trainer.attention import load_model


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_on_policy_fp32_samples_with_the_trained_model_itself(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float32, "auto")
    assert _Engine(model, 0, "float32").sampler() is model


def test_one_version_stale_samples_with_the_weights_before_the_last_step(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float32, "auto")
    first = next(model.parameters()).detach().clone()
    engine = _Engine(model, 1, "float32")
    assert torch.equal(next(engine.sampler().parameters()), first)  # step 0: no older version yet
    _bump(model, 0.5)
    engine.trained()  # after step 0's updates: the engine still serves version 0
    assert torch.equal(next(engine.sampler().parameters()), first)
    second = next(model.parameters()).detach().clone()
    _bump(model, 0.5)
    engine.trained()  # after step 1: version 1, one behind the trained version 2
    assert torch.equal(next(engine.sampler().parameters()), second)
    assert not torch.equal(second, next(model.parameters()))


def test_a_bf16_engine_samples_from_a_bf16_copy_of_the_current_weights(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float32, "auto")
    engine = _Engine(model, 0, "bfloat16")
    _bump(model, 0.25)
    engine.trained()
    sampler = engine.sampler()
    assert sampler is not model and next(sampler.parameters()).dtype == torch.bfloat16
    assert torch.equal(next(sampler.parameters()), next(model.parameters()).to(torch.bfloat16))
