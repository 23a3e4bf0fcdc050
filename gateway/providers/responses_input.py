"""Parsing half of the OpenAI Responses adapter: ``input`` items and ``tools`` into canonical form.

Codex (shared/docs/harnesses.md §4) sends no ``instructions``: its system prompt is a ``developer``
message. One assistant turn is a run of ``reasoning``, ``message`` and ``function_call`` items, which
become one canonical assistant message. Codex offers ``namespace`` tools (nested function tools) and
``custom`` tools (free-form text input): both are flattened into canonical tools, and the mapping back
is recorded in extras so the renderer can emit the call in the shape Codex expects.
"""

from __future__ import annotations

from typing import Any

from gateway.canonical import Message, Tool, ToolCall
from gateway.providers.arguments import arguments_object, normalize_arguments
from gateway.providers.common import (
    TEXT_JOIN,
    bad,
    function_call,
    function_tool,
    get,
    items,
    obj,
    parts_text,
    tool_choice_mode,
    tool_names_by_id,
)

CUSTOM_INPUT_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
NAMESPACE_SEP = "."  # canonical name of a namespaced tool: "<namespace>.<tool>"


def parse_input(value: Any, extras: dict[str, Any]) -> list[Message]:
    """``input`` (a string, or a list of items) -> canonical messages."""
    if isinstance(value, str):
        return [Message("user", value)]
    messages: list[Message] = []
    skipped: list[str] = []
    for i, raw in enumerate(items(value, "input")):
        item = obj(raw, f"input.{i}")
        kind = item.get("type") or ("message" if "role" in item else None)
        field = f"input.{i}"
        if kind == "message":
            _message(item, field, messages)
        elif kind == "reasoning":
            turn = _assistant_turn(messages)
            turn.reasoning = _join(turn.reasoning, _reasoning_text(item, field))
        elif kind in ("function_call", "custom_tool_call"):
            _assistant_turn(messages).tool_calls.append(_call(item, field, kind))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = get(item, "call_id", str, f"{field}.call_id", required=True)
            text = _content(item.get("output"), f"{field}.output")
            messages.append(Message("tool", text, tool_call_id=call_id, name=tool_names_by_id(messages).get(call_id, "")))
        elif kind == "item_reference":
            raise bad(field, "item_reference needs stored responses; this gateway stores none: send the items")
        else:
            skipped.append(str(kind))  # web_search_call, local_shell_call...: nothing the served model made
    if skipped:
        extras["skipped_items"] = skipped
    return messages


def _message(item: dict[str, Any], field: str, messages: list[Message]) -> None:
    role = get(item, "role", str, f"{field}.role", required=True)
    text = _content(item.get("content"), f"{field}.content")
    if role in ("system", "developer"):
        messages.append(Message("system", text))
    elif role == "user":
        messages.append(Message("user", text))
    elif role == "assistant":
        turn = _assistant_turn(messages)
        turn.content = _join(turn.content, text)
    else:
        raise bad(f"{field}.role", f"expected 'system', 'developer', 'user' or 'assistant', got {role!r}")


def _assistant_turn(messages: list[Message]) -> Message:
    """The assistant message the current item belongs to (a turn spans several items)."""
    if not messages or messages[-1].role != "assistant":
        messages.append(Message("assistant"))
    return messages[-1]


def _join(a: str, b: str) -> str:
    return TEXT_JOIN.join(t for t in (a, b) if t)


def _content(value: Any, field: str) -> str:
    """A string, or content parts: input_text/output_text/refusal as text, images and files as placeholders."""
    return parts_text(value, field, text_kinds=("input_text", "output_text", "text"), image_kinds=("input_image",))


def _reasoning_text(item: dict[str, Any], field: str) -> str:
    """Reasoning text of a reasoning item: its ``content`` if present, else its ``summary``."""
    for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = get(item, key, list, f"{field}.{key}", default=[])
        texts = [get(obj(p, f"{field}.{key}.{j}"), "text", str, f"{field}.{key}.{j}.text", default="") for j, p in enumerate(parts)]
        if any(texts):
            return TEXT_JOIN.join(texts)
    return ""


def _call(item: dict[str, Any], field: str, kind: str) -> ToolCall:
    call_id = get(item, "call_id", str, f"{field}.call_id", required=True)
    name = get(item, "name", str, f"{field}.name", required=True)
    namespace = get(item, "namespace", str, f"{field}.namespace", default="")
    if namespace:
        name = namespace + NAMESPACE_SEP + name
    if kind == "custom_tool_call":
        return ToolCall(call_id, name, normalize_arguments({"input": get(item, "input", str, f"{field}.input", default="")}))
    return function_call(call_id, item, field, name=name)


def parse_tools(raw: list[Any], extras: dict[str, Any]) -> list[Tool]:
    """Function, custom and namespace tools -> canonical tools; built-in tools are dropped and named.

    Records ``extras["custom_tools"]`` (names whose calls render as custom_tool_call) and
    ``extras["namespaced_tools"]`` (canonical name -> [namespace, tool name]).
    """
    tools: list[Tool] = []
    custom: list[str] = []
    namespaced: dict[str, list[str]] = {}
    dropped: list[str] = []
    for i, t in enumerate(raw):
        t = obj(t, f"tools.{i}")
        kind = t.get("type")
        if kind == "namespace":
            ns = get(t, "name", str, f"tools.{i}.name", required=True)
            for j, child in enumerate(get(t, "tools", list, f"tools.{i}.tools", default=[])):
                tool = _tool(obj(child, f"tools.{i}.tools.{j}"), f"tools.{i}.tools.{j}", custom, dropped, prefix=ns)
                if tool:
                    namespaced[tool.name] = [ns, tool.name[len(ns) + 1 :]]
                    tools.append(tool)
        elif tool := _tool(t, f"tools.{i}", custom, dropped):
            tools.append(tool)
    if custom:
        extras["custom_tools"] = custom
    if namespaced:
        extras["namespaced_tools"] = namespaced
    if dropped:
        extras["dropped_tools"] = dropped  # web_search etc. run on OpenAI's servers: nothing here can run them
    return tools


def _tool(t: dict[str, Any], field: str, custom: list[str], dropped: list[str], prefix: str = "") -> Tool | None:
    kind = t.get("type")
    if kind not in ("function", "custom"):
        dropped.append(str(t.get("name") or kind))
        return None
    if kind == "function":
        return function_tool(t, field, prefix=prefix + NAMESPACE_SEP if prefix else "")
    name = get(t, "name", str, f"{field}.name", required=True)
    if prefix:
        name = prefix + NAMESPACE_SEP + name
    description = get(t, "description", str, f"{field}.description", default="")
    custom.append(name)
    fmt = t.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        description = f"{description}\n\nInput grammar ({fmt.get('syntax', '')}):\n{fmt.get('definition', '')}".strip()
    return Tool(name, description, CUSTOM_INPUT_SCHEMA)


def tool_choice(value: Any) -> str:
    """``auto``/``none``/``required`` or ``{"type": "function"|"custom", "name"}``; other forms mean auto."""
    if mode := tool_choice_mode(value):
        return mode
    choice = obj(value, "tool_choice")
    if choice.get("type") in ("function", "custom"):
        return get(choice, "name", str, "tool_choice.name", required=True)
    return "auto"  # allowed_tools / built-in choices: the served model picks among what it was given


def custom_input(arguments: str) -> str:
    """The free-form input of a custom tool call, from its canonical ``{"input": ...}`` arguments."""
    value = arguments_object(arguments).get("input")
    return value if isinstance(value, str) else arguments
