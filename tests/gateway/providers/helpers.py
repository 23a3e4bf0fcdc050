"""Test helpers for the provider adapters: fixture bodies, SSE decoding, a fixed response."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.canonical import ChatResponse, ToolCall

FIXTURES = Path(__file__).parent / "fixtures"


def body(name: str) -> dict[str, Any]:
    """A request body recorded from a real harness (trimmed; see fixtures/README.md)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def events(stream: bytes) -> list[tuple[str | None, Any]]:
    """SSE bytes -> [(event name or None, decoded data)]; ``[DONE]`` stays a string."""
    out = []
    for frame in stream.decode().split("\n\n"):
        if not frame.strip():
            continue
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        text = "\n".join(data)
        out.append((name, text if text == "[DONE]" else json.loads(text)))
    return out


def tool_response(**overrides: Any) -> ChatResponse:
    """A finished answer with reasoning, text and two tool calls (keys in the model's own order)."""
    fields: dict[str, Any] = dict(
        id="abc123",
        model="served-model",
        text="I'll write the file.",
        reasoning="The user wants hello.txt.",
        tool_calls=[
            ToolCall("call_1", "Bash", '{"description": "Write hi", "command": "echo hi > hello.txt"}'),
            ToolCall("call_2", "Read", '{"file_path": "/tmp/hello.txt"}'),
        ],
        finish_reason="tool_calls",
        prompt_tokens=120,
        completion_tokens=42,
        created=1_795_000_000.0,
    )
    fields.update(overrides)
    return ChatResponse(**fields)
