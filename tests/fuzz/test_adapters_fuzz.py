"""The gateway's request path without sockets: body checks, the four parsers and renderers, the record.

For any generated body: ``read_json``'s checks (depth) and the adapter's parser either accept it or raise a
4xx ``RequestError``; what they accept renders (JSON and SSE) and its normalized request encodes the way
the event will (orjson, as ``schemas.codec.encode`` does). Any other exception is a finding.
"""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given, settings

from gateway.canonical import ChatResponse, RequestError, ToolCall
from gateway.limits import Limits, check_body, check_request
from gateway.providers import ADAPTERS, parse_route

from .strategies import PROVIDERS, profile, requests

LIMITS = Limits()
ANSWER = ChatResponse(id="evt1", model="m", text="done", reasoning="because",
                      tool_calls=[ToolCall("call_1", "write_file", '{"path": "a", "content": "b"}')], finish_reason="tool_calls")


def through_adapter(case) -> str:
    """What the gateway does with ``case`` up to the engine call; returns 'parsed' or 'refused <status>'."""
    try:
        body = orjson.loads(case.body)
    except orjson.JSONDecodeError:
        return "refused 400"
    if not isinstance(body, dict):
        return "refused 400"
    route = parse_route(case.path.split("?")[0], case.headers, body)
    adapter = ADAPTERS[route.provider]
    try:
        check_body(body, LIMITS)
        req = adapter.parse_request(body, model=route.model, stream=route.stream)
        check_request(req, LIMITS)
    except RequestError as e:
        assert 400 <= e.status < 500, e.message
        adapter.render_error(e)
        return f"refused {e.status}"
    orjson.dumps({"messages": [dataclasses.asdict(m) for m in req.messages], "tools": [dataclasses.asdict(t) for t in req.tools],
                  "sampling": dataclasses.asdict(req.sampling), "extras": req.extras})
    orjson.dumps(adapter.render_response(req, ANSWER))
    assert b"".join(adapter.render_stream(req, ANSWER))
    return "parsed"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_any_body_is_parsed_or_refused_with_a_4xx(provider):
    seen: set[str] = set()

    @settings(profile(), max_examples=profile().max_examples // 2)
    @given(requests(provider))
    def check(case):
        seen.add(through_adapter(case))

    check()
    assert "parsed" in seen and any(s.startswith("refused 4") for s in seen), seen
