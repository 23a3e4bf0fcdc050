"""Whatever a harness sends, a parser answers with a ChatRequest or a RequestError: never a crash.

Bodies are the real harness fixtures with one subtree replaced by arbitrary JSON, so the fuzzing
reaches deep fields (a tool_result's content, a functionCall's args) rather than failing at the top.
"""

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.canonical import ChatRequest, RequestError
from gateway.providers import ADAPTERS
from tests.fuzz.json_paths import paths

from .helpers import body, tool_response

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
CASES = [
    ("anthropic.messages", "claude_code_tool_turn"),
    ("openai.chat", "qwen_code_tool_turn"),
    ("openai.responses", "codex_tool_turn"),
    ("google.generate_content", "gemini_cli_tool_turn"),
]


DELETE = object()


def replaced(doc: Any, where: tuple, new: Any) -> Any:
    """``doc`` with the value at ``where`` replaced by ``new`` (or removed, for ``DELETE``)."""
    if not where:
        return None if new is DELETE else new
    doc = copy.deepcopy(doc)
    node = doc
    for key in where[:-1]:
        node = node[key]
    if new is DELETE:
        del node[where[-1]]
    else:
        node[where[-1]] = new
    return doc


def assert_well_typed(req: ChatRequest) -> None:
    """Everything the core reads has the type the canonical form promises."""
    for m in req.messages:
        assert m.role in ("system", "user", "assistant", "tool")
        assert all(isinstance(v, str) for v in (m.content, m.tool_call_id, m.name, m.reasoning))
        assert isinstance(m.is_error, bool)
        for c in m.tool_calls:
            assert all(isinstance(v, str) for v in (c.id, c.name, c.arguments))
    for t in req.tools:
        assert isinstance(t.name, str) and isinstance(t.description, str) and isinstance(t.parameters, dict)
    s = req.sampling
    assert s.max_tokens is None or (isinstance(s.max_tokens, int) and s.max_tokens >= 1)
    assert all(v is None or isinstance(v, float) for v in (s.temperature, s.top_p))
    assert all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (s.top_k, s.seed))
    assert all(isinstance(x, str) for x in s.stop)
    assert isinstance(req.model, str) and isinstance(req.tool_choice, str) and isinstance(req.stream, bool)


@pytest.mark.parametrize("provider, fixture", CASES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mutation_parses_or_is_refused_cleanly(provider, fixture, data):
    adapter = ADAPTERS[provider]
    original = body(fixture)
    where = data.draw(st.sampled_from(paths(original)))
    doc = replaced(original, where, data.draw(st.just(DELETE) | JSON))
    try:
        req = adapter.parse_request(doc, model="m", stream=None) if provider.startswith("google") else adapter.parse_request(doc)
    except RequestError as e:
        assert e.status == 400 and ":" in e.message  # names a field
        return
    assert_well_typed(req)
    # whatever parsed must render: the answer path never meets a shape it cannot handle
    assert adapter.render_response(req, tool_response())
    assert b"".join(adapter.render_stream(req, tool_response()))
