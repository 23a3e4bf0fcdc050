"""A real CLI's conversation as the model sees it, captured once, so the warm start can teach in it.

The built-in harness's prompt is ours, so its warm start writes its conversations directly
(``warmstart.conversation``). A real CLI brings its own system prompt, tools and framing of the task
(pi: a 2.4 KB prompt, four tools, ``write`` instead of ``write_file``). A warm start on the built-in
shape leaves the model answering pi in prose, so RL sees reward 0 everywhere.

``Shape`` holds what one scripted session of the CLI sent through the gateway (``polarstream/capture.py``):
the normalized messages of its first call (system prompt, the task as the CLI frames it, tools) and of
its second call (after a ``write`` of answer.txt: the tool result as the CLI phrases it). Conversations
for any problem of the family are those messages with the instruction and the written content swapped
in, rendered by the same chat template the gateway uses (``gateway.template.to_hf_message``), so the
warm start trains on the tokens the model will see at run time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from . import arith

# harness -> (its file-writing tool, that tool's path argument). Codex has no such tool (it edits by
# apply_patch through its shell), so it is not offered.
WRITE_TOOLS = {
    "pi": ("write", "path"),
    "opencode": ("write", "filePath"),
    "claude_code": ("Write", "file_path"),
    "gemini_cli": ("write_file", "file_path"),
    "qwen_code": ("write_file", "file_path"),
}
# harness -> the APIs the demo can run it over, its default first (pi and opencode take an ``api`` option).
APIS = {
    "pi": ("anthropic", "chat", "responses", "google"),
    "opencode": ("chat", "anthropic", "responses"),
    "claude_code": ("anthropic",),
    "gemini_cli": ("google",),
    "qwen_code": ("chat",),
}


def api_option(harness: str, api: str) -> dict[str, Any]:
    """The ``api`` harness option, for a CLI that has a choice (the others' adapters take none)."""
    return {"api": api} if len(APIS[harness]) > 1 else {}


def harness_config(harness: str, api: str) -> dict[str, Any]:
    """The harness options a demo session runs with: its API where it has a choice, and pi's answer cap."""
    config = api_option(harness, api)
    if harness == "pi":  # 48 tokens, as the built-in harness's (why: README, preset._preset)
        config["max_tokens"] = 48
    return config


# What the scripted capture session writes: distinctive, so the tool result's mention of it (and of its
# length) can be found and replaced.
CAPTURE_QUESTION, CAPTURE_CONTENT = "4 + 3", "31415926"


def write_tool(harness: str) -> tuple[str, str]:
    try:
        return WRITE_TOOLS[harness]
    except KeyError:
        raise ValueError(f"harness {harness!r}: the demo supports builtin and {', '.join(sorted(WRITE_TOOLS))} "
                         "(each writes answer.txt with its own file tool)") from None


def _hf(m: dict[str, Any]) -> dict[str, Any]:
    """A recorded (canonical) message as the gateway hands it to the chat template."""
    from gateway.canonical import Message, ToolCall
    from gateway.template import to_hf_message

    calls = [ToolCall(c["id"], c["name"], c["arguments"]) for c in m.get("tool_calls") or []]
    return to_hf_message(Message(m["role"], m.get("content") or "", calls, m.get("tool_call_id", ""), m.get("name", ""),
                                 m.get("reasoning", ""), m.get("is_error", False)))


@dataclass(frozen=True)
class Shape:
    """One CLI's captured conversation (``capture.capture`` builds it; ``to_json``/``from_json`` cache it)."""

    harness: str
    api: str
    version: str
    first: list[dict[str, Any]]  # the first call's normalized messages: system..., the task
    after_write: list[dict[str, Any]]  # what the CLI appends after its write call: the tool result(s)
    tools: list[dict[str, Any]]  # normalized tools (name, description, parameters)
    write_call_id: str = "call_0"

    @property
    def tool(self) -> str:
        return write_tool(self.harness)[0]

    def instruction(self, question: str) -> str:
        return arith.instruction(question, tool=self.tool)

    def hf_tools(self) -> list[dict[str, Any]]:
        from gateway.canonical import Tool
        from gateway.template import to_hf_tool

        return [to_hf_tool(Tool(t["name"], t.get("description", ""), t.get("parameters") or {})) for t in self.tools]

    def messages(self, question: str) -> list[dict[str, Any]]:
        """The first call's messages for ``question``, as the chat template gets them."""
        captured, new = self.instruction(CAPTURE_QUESTION), self.instruction(question)
        return [_hf({**m, "content": (m.get("content") or "").replace(captured, new)}) for m in self.first]

    def conversation(self, question: str, answer: str, use_tool: bool = True) -> list[dict[str, Any]]:
        """One session answering ``question``: the working, then either the turn ends (prose) or it
        writes answer.txt with the CLI's tool, gets the CLI's tool result and closes with "Done."."""
        head = self.messages(question)
        working = f"{question} = {answer}."
        if not use_tool:
            return [*head, {"role": "assistant", "content": working}]
        name, path_key = write_tool(self.harness)
        args = json.dumps({path_key: arith.ANSWER_FILE, "content": answer})
        call = {"id": self.write_call_id, "type": "function", "function": {"name": name, "arguments": args}}

        def swap(text: str) -> str:
            text = text.replace(CAPTURE_CONTENT, answer)
            return re.sub(rf"\b{len(CAPTURE_CONTENT)}\b", str(len(answer)), text)

        after = [_hf({**m, "content": swap(m.get("content") or "")}) for m in self.after_write]
        return [*head, {"role": "assistant", "content": working, "tool_calls": [call]}, *after,
                {"role": "assistant", "content": "Done."}]

    def reward(self, text: str, answer: str) -> float:
        """1.0 when a completion writes exactly ``answer`` to answer.txt with this CLI's tool."""
        name, path_key = write_tool(self.harness)
        return arith.reward(text, answer, name, path_key, roots=("/workspace/", "./"))

    def to_json(self) -> dict[str, Any]:
        return {"harness": self.harness, "api": self.api, "version": self.version, "first": self.first,
                "after_write": self.after_write, "tools": self.tools, "write_call_id": self.write_call_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Shape":
        return cls(**d)
