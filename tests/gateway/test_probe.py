"""gateway/probe.py against real engines: the same tokenizer passes; another one refuses the start."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from starlette.testclient import TestClient

from gateway.probe import TokenizerMismatch, check_tokenizer
from gateway.upstream import make_upstream

pytestmark = pytest.mark.integration


async def _check(tiny_template, url, model="tiny"):
    up = make_upstream("polar", [url])
    try:
        info = await up.model_info()
        up.served_model = info.id
        return await check_tokenizer(tiny_template.tokenizer, up, info.id, model)
    finally:
        await up.aclose()


def test_the_engines_own_tokenizer_passes(scripted_engine, tiny_template):
    assert asyncio.run(_check(tiny_template, scripted_engine.url)) == ""


def test_a_gateway_with_another_tokenizer_refuses_to_start(tmp_path, tiny_model_dir, tiny_template,
                                                           engine_server_factory, polar_settings):
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]  # two common letters swap ids: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(spec))
    engine = engine_server_factory(model_dir=other)
    with pytest.raises(TokenizerMismatch, match="tokenizer mismatch: gateway tokenizer .* vs engine model"):
        asyncio.run(_check(tiny_template, engine.url))
    app = create_app(polar_settings, GatewayConfig(engine_urls=[engine.url], model=str(tiny_model_dir)),
                     template=tiny_template)
    with pytest.raises(TokenizerMismatch, match="first difference at position"):
        with TestClient(app):  # runs the lifespan: the gateway never serves
            pass


def test_an_engine_reporting_raw_logprobs_is_refused_unless_they_equal_the_sampled_ones(scripted_engine):
    from gateway.probe import LogprobsModeMismatch, check_logprobs_mode
    from gateway.sampling import SamplingPolicy

    async def mode(url):
        up = make_upstream("polar", [url])
        try:
            return (await up.model_info()).logprobs_mode
        finally:
            await up.aclose()

    assert asyncio.run(mode(scripted_engine.url)) == "processed_logprobs"  # our engine says which it returns
    with pytest.raises(LogprobsModeMismatch, match="--logprobs-mode processed_logprobs"):
        check_logprobs_mode("raw_logprobs", SamplingPolicy(temperature=0.7))
    check_logprobs_mode("raw_logprobs", SamplingPolicy())  # temperature 1, no truncation: raw == processed
    check_logprobs_mode("", SamplingPolicy(temperature=0.7))  # vLLM does not say: documented, not checkable
