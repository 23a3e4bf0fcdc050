"""engine/lora.py's pure parts and the per-adapter prefix cache, on hand-computed cases."""

import pytest
import torch

from engine.cli import parse_lora_module
from engine.lora import Adapter, AdapterError, check_config, delta, pair_weights, scaling_of
from engine.prefix_cache import PrefixCache


def adapter(A, B, scaling, module="m"):
    return Adapter("x", "", len(A), scaling, {module: (torch.tensor(A, dtype=torch.float32), torch.tensor(B, dtype=torch.float32))})


P = adapter([[1.0, 1.0]], [[1.0], [2.0]], 0.5)  # r=1: delta = 0.5 * B (x0 + x1)
Q = adapter([[1.0, -1.0]], [[0.0], [1.0]], 2.0)  # delta = 2 * B (x0 - x1)
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 1.0]])


def test_delta_applies_each_adapter_to_its_own_rows():
    assert delta("m", X, [P, None, Q]).tolist() == [[0.5, 1.0], [0.0, 0.0], [0.0, 4.0]]
    assert delta("m", X, [P, P, P]).tolist() == [[0.5, 1.0], [0.5, 1.0], [2.0, 4.0]]
    assert delta("other", X, [P, None, Q]).tolist() == 0.0  # a module the adapters do not target: nothing added


def test_scaling_and_refused_options():
    assert scaling_of({"r": 4, "lora_alpha": 8}) == (4, 2.0)
    assert scaling_of({"r": 4, "lora_alpha": 8, "use_rslora": True}) == (4, 4.0)
    with pytest.raises(AdapterError, match="use_dora"):
        check_config({"r": 4, "use_dora": True})
    with pytest.raises(AdapterError, match="modules_to_save"):
        check_config({"r": 4, "modules_to_save": ["lm_head"]})
    check_config({"r": 4, "bias": "none", "rank_pattern": {}, "peft_type": "LORA"})


def test_pair_weights_checks_names_and_shapes():
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(3, 2)
    a, b = torch.ones(1, 3), torch.ones(2, 1)
    out = pair_weights({"base_model.model.proj.lora_A.weight": a, "base_model.model.proj.lora_B.weight": b}, model, 1)
    assert list(out) == ["proj"] and out["proj"][0].shape == (1, 3)
    with pytest.raises(AdapterError, match="do not fit"):
        pair_weights({"base_model.model.proj.lora_A.weight": a, "base_model.model.proj.lora_B.weight": torch.ones(3, 1)}, model, 1)
    with pytest.raises(AdapterError, match="not a linear layer"):
        pair_weights({"base_model.model.nope.lora_A.weight": a, "base_model.model.nope.lora_B.weight": b}, model, 1)
    with pytest.raises(AdapterError, match="needs both"):
        pair_weights({"base_model.model.proj.lora_A.weight": a}, model, 1)


def test_prefix_cache_entries_belong_to_their_adapter():
    cache, tokens = PrefixCache(1 << 20), list(range(20))
    layers = [(torch.zeros(1, 1, 20, 2), torch.zeros(1, 1, 20, 2))]
    cache.put(tokens, layers, P)
    assert cache.lookup(tokens + [99])[0] == 0  # the base never reuses an adapter's KV
    assert cache.lookup(tokens + [99], Q)[0] == 0
    assert cache.lookup(tokens + [99], P)[0] == 20
    cache.put(tokens, layers)  # the base's own entry is not dropped as "extended" by P's
    cache.drop_namespace(P)
    assert cache.lookup(tokens + [99], P)[0] == 0 and cache.lookup(tokens + [99])[0] == 20


def test_lora_modules_entries_read_as_vllm_reads_them():
    assert parse_lora_module("run1-v3=s3://b/run1/lora") == ("run1-v3", "s3://b/run1/lora")
    assert parse_lora_module('{"name": "a", "path": "/x/a", "base_model_name": "tiny"}') == ("a", "/x/a")
    for bad, why in (("a", "expected name=path"), ("=/x", "both a name and a path"), ('{"name": "a"}', "both a name"),
                     ('{"name": "a", "path": "/x", "rank": 4}', "takes name, path")):
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)
