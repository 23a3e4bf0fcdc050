"""Prefix caching: reused KV gives the same tokens and logprobs as computing everything."""

import httpx
import torch

from engine.prefix_cache import PrefixCache, common_prefix
from tests.plugins.engine import start_engine_server


def kv(n: int, fill: float = 0.0):
    return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill))]


def test_lookup_takes_the_longest_common_prefix_and_leaves_one_token():
    cache = PrefixCache(max_bytes=1 << 20)
    a = list(range(100, 140))
    cache.put(a, kv(40, 1.0))
    cache.put(list(range(100, 120)) + [7] * 30, kv(50, 2.0))
    m, layers = cache.lookup(a[:30] + [1, 2, 3])
    assert m == 30 and layers[0][0].shape[2] == 30 and float(layers[0][0][0, 0, 0, 0]) == 1.0
    m, _ = cache.lookup(a)  # a whole stored sequence as the prompt: one token is still computed
    assert m == 39
    assert cache.lookup(list(range(100, 110)) + [5] * 20) == (0, None)  # 10 < MIN_REUSE
    assert common_prefix(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])) == 2


def test_extending_entries_replace_their_prefixes_and_lru_evicts():
    one = 2 * 2 * 4 * 4  # bytes per token in kv(): K and V, 2 heads, dim 4, float32
    cache = PrefixCache(max_bytes=one * 100)
    cache.put(list(range(20)), kv(20))
    cache.put(list(range(30)), kv(30))  # extends the first: it replaces it
    assert len(cache) == 1
    cache.put([9] * 60, kv(60))
    cache.put([8] * 30, kv(30))  # over budget: the least recently used entry goes
    assert len(cache) == 2 and cache.lookup(list(range(30)) + [1]) == (0, None)


def test_second_turn_reuses_the_first_and_matches_a_cold_engine(served, tiny_model_dir):
    body = {"max_tokens": 8, "temperature": 0.9, "seed": 4, "logprobs": 0, "return_token_ids": True}
    with httpx.Client(base_url=served.url, timeout=60) as c:
        first = c.post("/v1/completions", json={"prompt": list(range(300, 330)), **body}).json()["choices"][0]
        prompt = first["prompt_token_ids"] + first["token_ids"] + [11, 12, 13]
        stats = served.engine.batcher.stats
        hits = stats["prefix_hit_tokens"]
        warm = c.post("/v1/completions", json={"prompt": prompt, **body}).json()["choices"][0]
        assert stats["prefix_hit_tokens"] - hits == 30 + 8 - 1  # all but the last sampled token
    cold_server = start_engine_server(tiny_model_dir, prefix_cache_mb=0)
    try:
        cold = httpx.post(f"{cold_server.url}/v1/completions", json={"prompt": prompt, **body}, timeout=60).json()["choices"][0]
    finally:
        cold_server.stop()
    assert warm["token_ids"] == cold["token_ids"]
    assert max(abs(a - b) for a, b in zip(warm["logprobs"]["token_logprobs"], cold["logprobs"]["token_logprobs"])) <= 1e-4
