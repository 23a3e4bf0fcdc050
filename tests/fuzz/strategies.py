"""Hypothesis strategies for what harnesses (and hostile clients) send to the gateway's four APIs.

A generated request is a ``Case``: the provider, the path, headers and the raw body bytes, plus the
family it was drawn from, so a report can say which kind of bad input produced which answer:

- ``valid``: a well-formed conversation (system prompt, tools with odd schemas, assistant turns with
  tool calls, results whose ids match nothing, special tokens in text) rendered in the provider's wire
  format, streaming or not. The gateway should answer these 200 (or a context-length 400).
- ``mutated``: a valid body with one subtree replaced by arbitrary JSON, deleted, or an unknown field
  added: wrong types, missing fields and unknown fields, deep inside the body.
- ``raw``: bytes that are not a JSON object: bad JSON, invalid UTF-8, truncated bodies, arrays, scalars,
  wrong content types and encodings.
- ``huge``: oversized strings, long arrays (messages, tools) and deep nesting, around the gateway's limits.

The conversation is drawn once in a provider-neutral form and rendered by four small functions, so the
same histories (and tool-call echoes) reach every API.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.fuzz.json_paths import paths

DEEP = "__deep_nesting__"  # placeholder replaced by deeply nested JSON text
PROVIDERS = ("anthropic.messages", "openai.chat", "openai.responses", "google.generate_content")
SPECIAL = ["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<think>", "{{ messages }}", "\x00", "\ufeff",
           "data: [DONE]\n\n", '{"name": "x"}', "\u202e", "🐟"]
TEXT = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), st.sampled_from(SPECIAL))
NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,12}", fullmatch=True)
SCALAR = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
JSON = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=10)
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {}}),
    st.builds(lambda props: {"type": "object", "properties": {k: {"type": "string"} for k in props}, "required": props},
              st.lists(NAME, max_size=3, unique=True)),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "$ref", "anyOf"]), JSON, max_size=3),
)


@dataclass
class Call:
    id: str
    name: str
    args: dict[str, Any]


@dataclass
class Turn:
    role: str  # user | assistant | tool
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    call_id: str = ""  # tool: the call it answers (may match nothing)
    name: str = ""


@dataclass
class Conversation:
    system: str
    tools: list[tuple[str, str, dict[str, Any]]]
    turns: list[Turn]
    max_tokens: int | None
    temperature: float | None
    stream: bool
    options: bool = False  # add the optional fields each API has (tool choice, stops, thinking...)


@dataclass
class Case:
    """One request: what to send, and which family of input it came from."""

    provider: str
    family: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    """A provider-neutral conversation: user first, then rounds of assistant calls and tool results."""
    tools = draw(st.lists(st.tuples(NAME, TEXT, SCHEMA), max_size=4, unique_by=lambda t: t[0]))
    names = [t[0] for t in tools] or ["missing_tool"]
    turns = [Turn("user", draw(TEXT) or "hi")]
    for r in range(draw(st.integers(0, 3))):
        calls = [Call(draw(st.sampled_from([f"call_{r}_{k}", draw(NAME)])), draw(st.sampled_from(names) | NAME),
                      draw(st.dictionaries(NAME, SCALAR, max_size=3))) for k in range(draw(st.integers(0, 2)))]
        turns.append(Turn("assistant", draw(TEXT), calls))
        for c in calls:  # an echo whose id matches nothing now and then
            turns.append(Turn("tool", draw(TEXT), call_id=draw(st.just(c.id) | NAME), name=c.name))
        turns.append(Turn("user", draw(TEXT) or "go on"))
    return Conversation(
        system=draw(st.just("") | TEXT), tools=tools, turns=turns,
        max_tokens=draw(st.none() | st.integers(1, 64)),
        temperature=draw(st.none() | st.floats(0, 2)), stream=draw(st.booleans()), options=draw(st.booleans()),
    )


# ------------------------------------------------------------------------------- wire renderers


def anthropic(c: Conversation) -> tuple[str, dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for t in c.turns:
        if t.role == "user":
            msgs.append({"role": "user", "content": t.text})
        elif t.role == "assistant":
            blocks = ([{"type": "text", "text": t.text}] if t.text else []) + [
                {"type": "tool_use", "id": k.id, "name": k.name, "input": k.args} for k in t.calls]
            msgs.append({"role": "assistant", "content": blocks or t.text})
        else:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": t.call_id, "content": t.text}]})
    body: dict[str, Any] = {"model": "claude-fuzz", "max_tokens": c.max_tokens or 32, "messages": msgs, "stream": c.stream}
    if c.system:
        body["system"] = [{"type": "text", "text": c.system, "cache_control": {"type": "ephemeral"}}]
    if c.tools:
        body["tools"] = [{"name": n, "description": d, "input_schema": s} for n, d, s in c.tools]
    if c.temperature is not None:
        body["temperature"] = min(c.temperature, 1.0)
    if c.options:
        body.update(tool_choice={"type": "auto"}, stop_sequences=["\n\nHuman:"], top_k=5, metadata={"user_id": "u"},
                    thinking={"type": "enabled", "budget_tokens": 1024})
    return "/v1/messages", body


def chat(c: Conversation) -> tuple[str, dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": c.system}] if c.system else []
    for t in c.turns:
        if t.role == "user":
            msgs.append({"role": "user", "content": t.text})
        elif t.role == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": t.text or None}
            if t.calls:
                m["tool_calls"] = [{"id": k.id, "type": "function",
                                    "function": {"name": k.name, "arguments": json.dumps(k.args)}} for k in t.calls]
            msgs.append(m)
        else:
            msgs.append({"role": "tool", "tool_call_id": t.call_id, "content": t.text})
    body: dict[str, Any] = {"model": "gpt-fuzz", "messages": msgs, "stream": c.stream}
    if c.tools:
        body["tools"] = [{"type": "function", "function": {"name": n, "description": d, "parameters": s}} for n, d, s in c.tools]
    if c.max_tokens:
        body["max_tokens"] = c.max_tokens
    if c.temperature is not None:
        body["temperature"] = c.temperature
    if c.options:
        body.update(tool_choice="auto", stop=["</s>"], seed=7, top_p=0.9, stream_options={"include_usage": True},
                    response_format={"type": "text"}, reasoning_effort="low", max_completion_tokens=16)
    return "/v1/chat/completions", body


def responses(c: Conversation) -> tuple[str, dict[str, Any]]:
    items: list[dict[str, Any]] = [{"type": "message", "role": "developer", "content": c.system}] if c.system else []
    for t in c.turns:
        if t.role == "user":
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": t.text}]})
        elif t.role == "assistant":
            if t.text:
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t.text}]})
            items += [{"type": "function_call", "call_id": k.id, "name": k.name, "arguments": json.dumps(k.args)} for k in t.calls]
        else:
            items.append({"type": "function_call_output", "call_id": t.call_id, "output": t.text})
    body: dict[str, Any] = {"model": "gpt-fuzz", "input": items, "stream": c.stream}
    if c.tools:
        body["tools"] = [{"type": "function", "name": n, "description": d, "parameters": s} for n, d, s in c.tools]
    if c.max_tokens:
        body["max_output_tokens"] = c.max_tokens
    if c.options:
        body.update(instructions="be brief", tool_choice="auto", reasoning={"effort": "low"}, text={"format": {"type": "text"}},
                    store=False, include=["reasoning.encrypted_content"], parallel_tool_calls=False)
    return "/v1/responses", body


def google(c: Conversation) -> tuple[str, dict[str, Any]]:
    contents: list[dict[str, Any]] = []
    for t in c.turns:
        if t.role == "user":
            contents.append({"role": "user", "parts": [{"text": t.text}]})
        elif t.role == "assistant":
            parts = ([{"text": t.text}] if t.text else []) + [
                {"functionCall": {"id": k.id, "name": k.name, "args": k.args}} for k in t.calls]
            contents.append({"role": "model", "parts": parts or [{"text": ""}]})
        else:
            contents.append({"role": "user", "parts": [{"functionResponse": {"id": t.call_id, "name": t.name,
                                                                             "response": {"output": t.text}}}]})
    body: dict[str, Any] = {"contents": contents}
    if c.system:
        body["systemInstruction"] = {"parts": [{"text": c.system}]}
    if c.tools:
        body["tools"] = [{"functionDeclarations": [{"name": n, "description": d, "parametersJsonSchema": s} for n, d, s in c.tools]}]
    config = {k: v for k, v in (("maxOutputTokens", c.max_tokens), ("temperature", c.temperature)) if v is not None}
    if c.options:
        config.update(stopSequences=["END"], topK=3.0, topP=0.9, thinkingConfig={"includeThoughts": True, "thinkingBudget": 64})
        body["toolConfig"] = {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [n for n, _, _ in c.tools][:1]}}
    if config:
        body["generationConfig"] = config
    method = "streamGenerateContent?alt=sse" if c.stream else "generateContent"
    return f"/v1beta/models/gemini-fuzz:{method}", body


RENDER = {"anthropic.messages": anthropic, "openai.chat": chat, "openai.responses": responses, "google.generate_content": google}


def mutate(doc: Any, where: tuple, how: str, new: Any) -> Any:
    """``doc`` with the node at ``where`` replaced by ``new``, deleted, or given an unknown field."""
    doc = copy.deepcopy(doc)
    if not where:
        return new if how == "replace" else doc
    node = doc
    for key in where[:-1]:
        node = node[key]
    if how == "delete":
        del node[where[-1]]
    elif how == "unknown" and isinstance(node[where[-1]], dict):
        node[where[-1]]["x_fuzz_unknown"] = new
    else:
        node[where[-1]] = new
    return doc


def _case(provider: str, family: str, path: str, body: Any, stream: bool, **kw: Any) -> Case:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Case(provider, family, path, raw, {"content-type": "application/json", **kw.pop("headers", {})}, stream)


def _stream_of(path: str, body: Any) -> bool:
    return "streamGenerateContent" in path or (isinstance(body, dict) and body.get("stream") is True)


@st.composite
def valid(draw: st.DrawFn, provider: str) -> Case:
    path, body = RENDER[provider](draw(conversations()))
    return _case(provider, "valid", path, body, _stream_of(path, body))


@st.composite
def mutated(draw: st.DrawFn, provider: str) -> Case:
    path, body = RENDER[provider](draw(conversations()))
    where = draw(st.sampled_from(paths(body)))
    body = mutate(body, where, draw(st.sampled_from(["replace", "delete", "unknown"])), draw(JSON))
    return _case(provider, "mutated", path, body, _stream_of(path, body))


@st.composite
def raw(draw: st.DrawFn, provider: str) -> Case:
    path, body = RENDER[provider](draw(conversations()))
    text = json.dumps(body).encode()
    kind = draw(st.sampled_from(["truncated", "garbage", "invalid_utf8", "not_object", "content_type", "encoding", "empty"]))
    headers: dict[str, str] = {}
    if kind == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif kind == "garbage":
        text = draw(st.binary(max_size=64))
    elif kind == "invalid_utf8":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c"])) + text[at:]
    elif kind == "not_object":
        text = json.dumps(draw(st.lists(JSON, max_size=2) | SCALAR)).encode()
    elif kind == "content_type":
        headers["content-type"] = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                                        "application/json; charset=latin-1", ""]))
    elif kind == "encoding":
        headers["content-encoding"] = draw(st.sampled_from(["gzip", "br", "deflate", "zstd", "identity, gzip"]))
    else:
        text = b""
    stream = kind in ("content_type", "encoding") and _stream_of(path, body)  # the body itself is intact
    return _case(provider, f"raw.{kind}", path, text, stream, headers=headers)


@st.composite
def huge(draw: st.DrawFn, provider: str, max_body: int = 1 << 20) -> Case:
    """Around the limits: long strings, many messages or tools, deep nesting in a schema or arguments."""
    conv = draw(conversations())
    kind = draw(st.sampled_from(["string", "messages", "tools", "deep_schema", "deep_args", "deep_body"]))
    n = draw(st.integers(1, 4))
    if kind == "string":
        conv.turns[0].text = "x" * draw(st.sampled_from([10_000, 200_000, max_body + 1]))
    elif kind == "messages":
        conv.turns += [Turn("user", "m")] * draw(st.sampled_from([300, 1_500]))
    elif kind == "tools":
        conv.tools = [(f"t{i}", "", {"type": "object", "properties": {}}) for i in range(draw(st.sampled_from([100, 300])))]
    else:
        conv.tools = conv.tools or [("deep", "", {"type": "object", "properties": {}})]
        if kind == "deep_schema":
            conv.tools[0] = (conv.tools[0][0], "", {"type": "object", "properties": {"x": DEEP}})
        elif kind == "deep_args":
            conv.turns[1:1] = [Turn("assistant", "", [Call("call_deep", conv.tools[0][0], {"x": DEEP})])]
    path, body = RENDER[provider](conv)
    if kind == "deep_body":
        body["metadata"] = DEEP
    text = json.dumps(body)
    if kind.startswith("deep"):  # spliced in as text: json.dumps itself refuses ~1000 levels
        depth = draw(st.sampled_from([100, 300, 600, 1_000, 1_100]))
        deep = '{"a":' * depth + '"leaf"' + "}" * depth if n % 2 else "[" * depth + "1" + "]" * depth
        text = text.replace(f'"{DEEP}"', deep).replace(f'\\"{DEEP}\\"', deep.replace('"', '\\"'))
    return _case(provider, f"huge.{kind}", path, text.encode(), _stream_of(path, body))


MIX = {"valid": (valid, 0.3), "mutated": (mutated, 0.3), "raw": (raw, 0.2), "huge": (huge, 0.2)}


def requests(provider: str) -> st.SearchStrategy[Case]:
    """Any family for one API (hypothesis favours the first branches: ``collect_mix`` keeps the shares)."""
    return st.one_of(*(make(provider) for make, _ in MIX.values()))


# ------------------------------------------------------------------------------- drawing cases

# Registered, never loaded: loading a profile would change every other hypothesis test in the run.
settings.register_profile("polar-fuzz-ci", max_examples=150, derandomize=True, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.generate])
settings.register_profile("polar-fuzz-long", max_examples=10_000, derandomize=False, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.generate])


def profile() -> settings:
    """The fuzz profile: ``POLAR_FUZZ_PROFILE`` (default ``polar-fuzz-ci``: deterministic, 150 per API)."""
    return settings.get_profile(os.environ.get("POLAR_FUZZ_PROFILE", "polar-fuzz-ci"))


def collect(strategy: st.SearchStrategy[Case], n: int, *, seed_value: int | None = None) -> list[Case]:
    """``n`` examples of ``strategy``, drawn by hypothesis itself (deterministic unless ``seed_value``)."""
    out: list[Case] = []

    @settings(profile(), max_examples=n, derandomize=seed_value is None)
    @given(strategy)
    def draw_one(case: Case) -> None:
        out.append(case)

    if seed_value is not None:
        draw_one = seed(seed_value)(draw_one)
    draw_one()
    return out


def collect_mix(provider: str, n: int, *, seed_value: int | None = None) -> list[Case]:
    """``n`` cases for ``provider`` in the ``MIX`` shares, interleaved so every stretch of a run has each family."""
    groups = [collect(make(provider), max(1, round(n * share)), seed_value=seed_value) for make, share in MIX.values()]
    mixed = [c for row in itertools.zip_longest(*groups) for c in row if c is not None]
    return mixed[:n]
