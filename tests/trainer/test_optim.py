"""The optimizer side of a step: no-signal steps leave the weights bit-identical; what weight decay touches."""

import math

import torch
from transformers import AutoModelForCausalLM

from tests.plugins.trainer import make_group
from trainer.config import TrainConfig
from trainer.loss import LossConfig
from trainer.optim import param_groups, skip_update_reason
from trainer.packing import assign_weights, pack, samples_from_group
from trainer.step import accumulate_gradients, train_step


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _step(model, opt, rewards):
    """One trainer step, the trainer's own (step.train_step): weights, pack, forward/backward, clip, AdamW or
    a skip. Returns the weighted samples and (gradient norm, skip reason)."""
    group = make_group("g", [[11, 12, 13], [21, 22]], rewards, logprob=-5.0)
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, token_budget=1024, lr_saturation=1.0)  # the rate of opt, always
    out = train_step(model, opt, samples_from_group(group, 1024)[0], cfg, reward_mean=sum(rewards) / len(rewards))
    return out.samples, (out.grad_norm, out.no_update)


def test_a_step_without_signal_leaves_the_weights_bit_identical(trainer_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    start = _weights(model)
    _, (norm, reason) = _step(model, opt, [1.0, 0.0])  # advantages +-0.5: a real update
    assert reason is None and norm > 0
    after_first = _weights(model)
    assert any(not torch.equal(start[k], after_first[k]) for k in start)

    samples, (norm, reason) = _step(model, opt, [1.0, 1.0])  # zero variance: every advantage 0
    assert reason == "no_signal" and norm == 0.0
    after_second = _weights(model)
    assert all(torch.equal(after_first[k], after_second[k]) for k in start)
    assert all(p.grad is None for p in model.parameters())  # nothing left to leak into the next step

    # what today's unconditional optimizer.step() does on that zero gradient: AdamW still moves
    accumulate_gradients(model, pack(samples, 1024), LossConfig())
    opt.step()
    assert any(not torch.equal(after_second[k], v) for k, v in model.state_dict().items())


def test_skip_update_reason():
    group = make_group("g", [[11, 12], [21]], [1.0, 0.0])
    samples = assign_weights(samples_from_group(group, 1024)[0], "token_mean")
    assert skip_update_reason(samples, 0.3) is None
    assert skip_update_reason(samples, 0.0) == "zero_grad"  # e.g. every token clipped
    assert skip_update_reason(samples, math.nan) == "nonfinite_grad"
    assert skip_update_reason(samples, math.inf) == "nonfinite_grad"
    flat = assign_weights(samples_from_group(make_group("g", [[11], [21]], [0.5, 0.5]), 1024)[0], "token_mean")
    assert skip_update_reason(flat, 0.3) == "no_signal"  # KL noise alone is not signal
    assert skip_update_reason([], 0.0) == "no_signal"
    weightless = [s.__class__(**{**s.__dict__, "weight": 0.0}) for s in samples]  # e.g. stale weight 0
    assert skip_update_reason(weightless, 0.3) == "no_signal"


def test_weight_decay_skips_norms_biases_and_embeddings(trainer_model_dir):
    model = AutoModelForCausalLM.from_pretrained(trainer_model_dir, attn_implementation="sdpa")
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in kept  # tied to lm_head in the tiny model: listed once
    assert {n for n in kept if "norm" in n} == {n for n, _ in model.named_parameters() if "norm" in n}
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "model.layers.1.mlp.down_proj.weight" in decayed
    assert not decayed & kept and len(decayed | kept) == len(list(model.parameters()))

    class WithBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin, self.ln = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    m = WithBias()
    decay, no_decay = param_groups(m, 0.1)
    assert [id(p) for p in decay["params"]] == [id(m.lin.weight)]
    assert {id(p) for p in no_decay["params"]} == {id(m.emb.weight), id(m.lin.bias), id(m.ln.weight), id(m.ln.bias)}

    # a step on zero gradients with decay on: only the decayed matrices shrink
    opt = torch.optim.AdamW(param_groups(m, 0.5), lr=0.1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(before[n], p)}
    assert moved == {"lin.weight"}
