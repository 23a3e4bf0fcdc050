"""The builtin agent's tools and its SSE folding (the loop itself runs end to end in tests/node)."""

from __future__ import annotations

import io
import json

from gateway.harnesses import builtin


def test_tools_act_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert builtin.call_tool("write_file", json.dumps({"path": "sub/a.txt", "content": "42"})).startswith("wrote 2")
    assert (tmp_path / "sub" / "a.txt").read_text() == "42"
    assert builtin.call_tool("read_file", '{"path": "sub/a.txt"}') == "42"
    out = builtin.call_tool("run_shell", '{"command": "cat sub/a.txt; exit 3"}')
    assert out.startswith("exit code 3") and "42" in out
    assert "exit code 0\n7" in builtin.call_tool("run_python", '{"code": "print(3 + 4)"}')


def test_tool_problems_come_back_as_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # write_file's relative paths land here, not in the checkout
    assert builtin.call_tool("write_file", "{not json").startswith("error: arguments are not valid JSON")
    assert builtin.call_tool("write_file", '{"path": "x"}') == "error: missing argument 'content'"
    assert builtin.call_tool("launch_rockets", "{}") == "error: unknown tool 'launch_rockets'"
    assert builtin.call_tool("read_file", '{"path": "/nonexistent/file"}').startswith("error:")


def test_write_file_without_content_leaves_the_file_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept.txt").write_text("before")
    assert builtin.call_tool("write_file", '{"path": "kept.txt"}') == "error: missing argument 'content'"
    assert (tmp_path / "kept.txt").read_text() == "before"


def test_stream_folds_tool_call_deltas():
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "write_file", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a",'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ' "content": "b"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 3}},
    ]
    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    resp = builtin._read_stream(io.BytesIO(body))
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a", "content": "b"}'}}]
