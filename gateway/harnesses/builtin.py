"""polarstream's built-in agent: a small tool-using loop over OpenAI Chat Completions.

It runs as its own process exactly like the real CLIs (the node copies this file into the run's private
HOME and starts it with the runtime's python), so it uses the standard library only. Configuration comes
from the environment the adapter sets: OPENAI_BASE_URL, OPENAI_API_KEY (the session key), POLAR_MODEL,
POLAR_INSTRUCTION and POLAR_AGENT_CONFIG (JSON: max_turns, stream, temperature, max_tokens, system).

Tools: write_file, read_file, run_shell, run_python; each runs in the current directory (the workspace).
Exit codes: 0 the model finished (or max_turns was reached), 2 bad configuration, 3 the API failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

SYSTEM = (
    "You are a coding agent working in the current directory. Use the tools to inspect and change files "
    "and to run commands. When the task is done, answer briefly without calling a tool."
)
TOOL_TIMEOUT_S = 60
MAX_TOOL_OUTPUT = 8000


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props, "required": required}}}


TOOLS = [
    _tool("write_file", "Write text to a file (created or replaced).",
          {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _tool("read_file", "Read a text file.", {"path": {"type": "string"}}, ["path"]),
    _tool("run_shell", "Run a shell command; returns exit code and output.", {"command": {"type": "string"}}, ["command"]),
    _tool("run_python", "Run Python code; returns exit code and output.", {"code": {"type": "string"}}, ["code"]),
]


def _run(argv: list[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"timed out after {TOOL_TIMEOUT_S}s"
    return f"exit code {p.returncode}\n{(p.stdout + p.stderr)[-MAX_TOOL_OUTPUT:]}"


def call_tool(name: str, arguments: str) -> str:
    """Execute one tool call; any problem is returned as text for the model, never raised."""
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
    except ValueError as e:
        return f"error: arguments are not valid JSON ({e})"
    try:
        if name == "write_file":
            path, content = str(args["path"]), str(args["content"])  # both read before the file is touched
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            return f"wrote {len(content)} characters to {path}"
        if name == "read_file":
            with open(str(args["path"])) as f:
                return f.read()[:MAX_TOOL_OUTPUT]
        if name == "run_shell":
            return _run(["/bin/sh", "-c", str(args["command"])])
        if name == "run_python":
            return _run([sys.executable, "-c", str(args["code"])])
    except KeyError as e:
        return f"error: missing argument {e}"
    except OSError as e:
        return f"error: {e}"
    return f"error: unknown tool {name!r}"


class ApiError(Exception):
    pass


def _post(url: str, key: str, body: dict, stream: bool) -> dict:
    """POST with retries on 429/503/connection errors (the gateway's back-pressure), then parse."""
    data = json.dumps(body).encode()
    for attempt in range(6):
        req = urllib.request.Request(url, data=data, method="POST", headers={
            "content-type": "application/json", "authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return _read_stream(resp) if stream else json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code in (429, 503) and attempt < 5:
                time.sleep(min(float(e.headers.get("retry-after") or 1), 10))
                continue
            raise ApiError(f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            if attempt < 5:
                time.sleep(0.5 * (attempt + 1))
                continue
            raise ApiError(f"cannot reach {url}: {e}") from None
    raise ApiError("unreachable")


def _read_stream(resp) -> dict:
    """Fold a Chat Completions SSE stream back into one non-streaming response shape."""
    text, finish, calls = [], None, {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"choices": [{"message": message, "finish_reason": finish}]}


def main() -> int:
    base = os.environ.get("OPENAI_BASE_URL", "").rstrip("/")
    key = os.environ.get("OPENAI_API_KEY", "")
    instruction = os.environ.get("POLAR_INSTRUCTION", "")
    try:
        cfg = json.loads(os.environ.get("POLAR_AGENT_CONFIG") or "{}")
    except ValueError as e:
        print(f"POLAR_AGENT_CONFIG: not valid JSON ({e})", file=sys.stderr)
        return 2
    if not base or not instruction:
        print("OPENAI_BASE_URL and POLAR_INSTRUCTION must be set", file=sys.stderr)
        return 2
    stream = bool(cfg.get("stream"))
    messages = [{"role": "system", "content": cfg.get("system") or SYSTEM}, {"role": "user", "content": instruction}]
    body = {"model": os.environ.get("POLAR_MODEL", "polar"), "tools": TOOLS, "stream": stream}
    for k in ("temperature", "max_tokens"):
        if cfg.get(k) is not None:
            body[k] = cfg[k]
    turns, finish = 0, "max_turns"
    while turns < int(cfg.get("max_turns", 8)):
        turns += 1
        try:
            resp = _post(f"{base}/chat/completions", key, {**body, "messages": messages}, stream)
        except ApiError as e:
            print(json.dumps({"error": str(e), "turns": turns}), flush=True)
            return 3
        msg = resp["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        messages.append({"role": "assistant", "content": msg.get("content"), **({"tool_calls": calls} if calls else {})})
        if not calls:
            finish = "stop"
            print(msg.get("content") or "", flush=True)
            break
        for tc in calls:
            result = call_tool(tc["function"]["name"], tc["function"].get("arguments", ""))
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    print(json.dumps({"turns": turns, "finish": finish}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
