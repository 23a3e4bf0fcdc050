"""The SGLang client end to end (through an SGLang-shaped front of the real engine), and count-tokens routes."""

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.canonical import Message
from gateway.server import ThreadedServer
from tests.plugins.gateway import read_calls


def sglang_front(engine_url: str) -> Starlette:
    """SGLang's native ``/generate`` wire format in front of our engine (its ids and logprobs are real)."""
    seen: list[dict] = []

    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        sp = body["sampling_params"]
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(engine_url + "/v1/completions", json={
                "model": "tiny", "prompt": body["input_ids"], "max_tokens": sp["max_new_tokens"], "logprobs": 0,
                "return_token_ids": True, **({"temperature": sp["temperature"]} if "temperature" in sp else {})})
        choice = r.json()["choices"][0]
        triples = [[lp, tid, None] for lp, tid in zip(choice["logprobs"]["token_logprobs"], choice["token_ids"])]
        finish = {"type": "length", "length": len(triples)} if choice["finish_reason"] == "length" else {"type": "stop", "matched": 2}
        return JSONResponse({"text": choice["text"], "output_ids": choice["token_ids"], "prompt_token_ids": body["input_ids"],
                             "meta_info": {"id": body.get("rid", ""), "finish_reason": finish, "weight_version": "3",
                                           "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(triples),
                                           "output_token_logprobs": triples}})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": 65536}]})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/v1/models", models)])
    app.state.seen = seen
    return app


def test_sglang_upstream_records_ids_logprobs_and_weight_version(polar_settings, scripted_engine, gateway_factory):
    front = sglang_front(scripted_engine.url)
    with ThreadedServer(front) as sg:
        gw = gateway_factory(polar_settings, sg.url, upstream="sglang")
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {gw.key('sg')}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "Create hello.txt"}], "temperature": 0.5,
                             "tools": [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]})
    assert r.status_code == 200, r.text
    (sent,) = front.state.seen
    assert sent["return_logprob"] is True and sent["logprob_start_len"] == -1 and sent["rid"] == "sg-0"
    assert sent["sampling_params"]["temperature"] == 0.5 and sent["sampling_params"]["skip_special_tokens"] is False
    (call,) = read_calls(polar_settings, 1, session_id="sg")
    assert call.prompt_ids == sent["input_ids"]
    assert call.policy_version == 3 and len(call.completion_logprobs) == len(call.completion_ids) > 0
    assert call.output.tool_calls[0].name == "write_file"


@pytest.mark.parametrize("path,body,field", [
    ("/v1/messages/count_tokens", {"model": "c", "messages": [{"role": "user", "content": "hi"}]}, "input_tokens"),
    ("/v1beta/models/g:countTokens", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, "totalTokens"),
    ("/v1/responses/input_tokens", {"model": "m", "input": "hi"}, "input_tokens"),
])
def test_count_tokens_matches_the_rendered_prompt_and_records_nothing(polar_settings, scripted_engine, gateway_factory,
                                                                     tiny_template, path, body, field):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    r = httpx.post(gw.url + path, json=body, headers={"x-api-key": gw.key("count")}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()[field] == len(tiny_template.prompt_ids([Message("user", "hi")]))
    assert gw.gw.sessions.find("count") is None


def test_top_p_zero_is_sent_to_the_engine_as_top_k_one(polar_settings, scripted_engine, gateway_factory):
    """OpenAI and Anthropic accept ``top_p: 0`` (only the likeliest token); vLLM refuses it, so it becomes ``top_k: 1``."""
    seen: list[dict] = []

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        async with httpx.AsyncClient(timeout=120) as c:  # the real engine validates what it is sent
            r = await c.post(scripted_engine.url + "/v1/completions", json=body)
        return JSONResponse(r.json(), status_code=r.status_code)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": 65536}]})

    front = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
    with ThreadedServer(front) as up:
        gw = gateway_factory(polar_settings, up.url)
        r = httpx.post(gw.url + "/v1/responses", timeout=120, headers={"Authorization": f"Bearer {gw.key('p0')}"},
                       json={"model": "m", "input": "Create hello.txt", "top_p": 0, "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    (sent,) = seen
    assert sent["top_k"] == 1 and sent.get("top_p", 1.0) == 1.0  # vLLM and SGLang want top_p in (0, 1]
