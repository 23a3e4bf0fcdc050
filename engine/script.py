"""Scripted mode: the engine answers with pre-written assistant turns instead of sampling.

A script is a YAML (or JSON) file; the format is documented in docs/engine.md. Each turn is rendered
once, at load time, through the served tokenizer's own chat template, so tool calls come out in exactly
the markup the template (and a tool-call parser) expects. At request time the engine picks a turn from
the conversation in the prompt and teacher-forces its tokens through the model, so token ids, logprobs
and everything downstream are real.

Choosing a turn for a prompt (parsed as ChatML: ``<|im_start|>role\\n...<|im_end|>``; a prompt in another
family's markup counts as assistant turns the script's turns it holds, as sampled, in order, and takes
what follows the last of them as the last message):
1. the first turn with a ``match`` regex found in the last non-assistant message (user or tool result;
   with ``skip_system: true`` the last non-assistant, non-system one, so system messages a harness puts
   after a tool result, such as Claude Code's reminders, do not hide it);
2. else the k-th turn without ``match`` (counting from 0), where k is the number of assistant turns
   already in the conversation, matched ones included (so concurrent conversations each advance
   through the script independently, and no state is kept between requests);
3. else ``fallback`` (a turn), or the model samples if the script has none.

``delay_s`` makes every answer that many seconds late: a slow model, so tests reach the gateway's paths
for long generations (keep-alives, timeouts) that an engine answering at once never does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(<\|im_end\|>|$)", re.DOTALL)


class ScriptError(ValueError):
    """A script file that cannot be used; the message names the file and the turn."""


@dataclass(frozen=True)
class Turn:
    text: str  # what the model emits after the generation prompt, without the end-of-turn token
    match: re.Pattern[str] | None = None


def parse_chatml(prompt: str, skip_system: bool = False) -> tuple[int, str]:
    """(number of finished assistant turns, content of the last non-assistant message) of a prompt;
    ``skip_system``: of the last message that is neither assistant nor system."""
    assistant_turns, last = 0, ""
    for role, content, end in _CHATML.findall(prompt):
        if role == "assistant":
            assistant_turns += bool(end)  # the open generation prompt is not a turn yet
        elif not (skip_system and role == "system"):
            last = content
    return assistant_turns, last


def parse_sampled(prompt: str, texts: list[str]) -> tuple[int, str]:
    """(assistant turns, what follows the last) of a prompt in any markup: the script's turn ``texts`` it
    holds as sampled (a token-in prompt keeps every earlier turn exactly as the engine emitted it)."""
    found, pos = 0, 0
    while True:
        hits = [(at, at + len(t)) for t in texts if (at := prompt.find(t, pos)) >= 0]
        if not hits:
            return found, prompt[pos:]
        found, pos = found + 1, min(hits)[1]


def render_turn(tokenizer, text: str, tool_calls: list[dict[str, Any]]) -> str:
    """The assistant output that the chat template would show for this message, after its generation prompt."""
    calls = [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in tool_calls]
    user = [{"role": "user", "content": "."}]
    assistant = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    prefix = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*user, assistant], tokenize=False)
    eos = tokenizer.eos_token or ""
    if full.startswith(prefix) and eos and eos in full[len(prefix):]:
        body = full[len(prefix): len(prefix) + full[len(prefix):].rfind(eos)]
        if all(c["function"]["name"] in body for c in calls):
            return body
    # A template without tool support (or not ChatML-like): Hermes markup, as Qwen's template writes it.
    parts = [text] if text else []
    parts += ["<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                           ensure_ascii=False) + "\n</tool_call>" for c in calls]
    return "\n".join(parts)


def _turn(tokenizer, raw: Any, where: str) -> Turn:
    if isinstance(raw, str):
        raw = {"text": raw}
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}: expected a mapping or a string, got {type(raw).__name__}")
    unknown = set(raw) - {"text", "tool_calls", "raw", "match"}
    if unknown:
        raise ScriptError(f"{where}: unknown keys {sorted(unknown)} (allowed: text, tool_calls, raw, match)")
    try:
        match = re.compile(raw["match"]) if raw.get("match") else None
    except re.error as e:
        raise ScriptError(f"{where}: bad match regex {raw['match']!r}: {e}") from None
    if "raw" in raw:
        if "text" in raw or "tool_calls" in raw:
            raise ScriptError(f"{where}: 'raw' excludes 'text' and 'tool_calls'")
        return Turn(str(raw["raw"]), match)
    calls = raw.get("tool_calls") or []
    for i, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ScriptError(f"{where}.tool_calls[{i}]: expected a mapping with a 'name' string")
        if isinstance(c.get("arguments"), str):  # JSON text, as OpenAI sends it
            try:
                c["arguments"] = json.loads(c["arguments"])
            except ValueError as e:
                raise ScriptError(f"{where}.tool_calls[{i}].arguments: not valid JSON ({e})") from None
    if not raw.get("text") and not calls:
        raise ScriptError(f"{where}: a turn needs 'text', 'tool_calls' or 'raw'")
    return Turn(render_turn(tokenizer, str(raw.get("text") or ""), calls), match)


@dataclass(frozen=True)
class Script:
    turns: tuple[Turn, ...]
    fallback: Turn | None = None
    skip_system: bool = False  # match in the last user/tool message, past any system message after it
    delay_s: float = 0.0  # every answer this late (a slow model)

    @classmethod
    def load(cls, path: str | Path, tokenizer) -> "Script":
        """Read and render a script file; raises ScriptError naming what is wrong."""
        return cls.render(cls.read(path), tokenizer, path)

    @staticmethod
    def read(path: str | Path) -> dict[str, Any]:
        """The script file's contents, checked for shape (no tokenizer needed: cheap to do first)."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ScriptError(f"{path}: cannot read script: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ScriptError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', None) or e}") from None
        if isinstance(data, list):
            data = {"turns": data}
        if not isinstance(data, dict) or not isinstance(data.get("turns"), list) or not data["turns"]:
            raise ScriptError(f"{path}: expected a non-empty 'turns' list")
        unknown = set(data) - {"turns", "fallback", "skip_system", "delay_s"}
        if unknown:
            raise ScriptError(f"{path}: unknown keys {sorted(unknown)} (allowed: turns, fallback, skip_system, delay_s)")
        if not isinstance(data.get("skip_system", False), bool):
            raise ScriptError(f"{path}: skip_system must be true or false")
        delay = data.get("delay_s", 0)
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 600:
            raise ScriptError(f"{path}: delay_s must be a number of seconds from 0 to 600, got {delay!r}")
        return data

    @classmethod
    def render(cls, data: dict[str, Any], tokenizer, path: str | Path) -> "Script":
        """A script from ``read``'s contents, every turn rendered through ``tokenizer``."""
        turns = tuple(_turn(tokenizer, t, f"{path}: turns[{i}]") for i, t in enumerate(data["turns"]))
        fallback = _turn(tokenizer, data["fallback"], f"{path}: fallback") if data.get("fallback") else None
        return cls(turns, fallback, bool(data.get("skip_system", False)), float(data.get("delay_s", 0)))

    def choose(self, prompt_text: str) -> str | None:
        """The scripted output for a prompt (see the module docstring), or None to let the model sample."""
        if "<|im_start|>" in prompt_text:
            k, last = parse_chatml(prompt_text, self.skip_system)
        else:
            k, last = parse_sampled(prompt_text, [t.text for t in self.turns if t.text])
        for t in self.turns:
            if t.match is not None and t.match.search(last):
                return t.text
        ordered = [t for t in self.turns if t.match is None]
        if k < len(ordered):
            return ordered[k].text
        return self.fallback.text if self.fallback else None
