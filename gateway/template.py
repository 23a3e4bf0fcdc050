"""The served model's chat template, owned by the gateway.

The engine is sent token ids, never chat messages, so the gateway decides exactly which tokens the
model sees. ``ChatTemplate`` renders canonical messages with the model's own HF template, and computes
the *bridge*: the tokens that follow a previous call's sampled ids when a history is extended (the
end-of-turn token if the model did not emit it, template glue, tool results, the next generation
prompt). That bridge is what token-in/token-out appends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .canonical import Message, Tool

_SENTINEL = "\x00polar-sentinel\x00"


class TemplateError(ValueError):
    """The template could not render the request (a template ``raise_exception`` or a bad message)."""


def _arguments_obj(arguments: str) -> Any:
    # Templates render arguments with ``tojson``; vLLM also turns the JSON text into an object first.
    try:
        return json.loads(arguments) if arguments else {}
    except (json.JSONDecodeError, RecursionError):  # nested past Python's limit: rendered as text
        return arguments


def to_hf_message(m: Message) -> dict[str, Any]:
    """Canonical message -> the dict shape HF chat templates expect (OpenAI chat style)."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments_obj(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
    elif m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
    return d


def to_hf_tool(t: Tool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}


@dataclass(frozen=True)
class EndOfTurn:
    """How the template closes an assistant turn: ``token`` (an id) then ``trailer`` text (e.g. "\\n")."""

    token_id: int
    token: str
    trailer: str


class ChatTemplate:
    """Renders canonical chats to token ids with the served model's tokenizer and template."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        self.template_kwargs = dict(template_kwargs or {})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise TemplateError("the tokenizer has no chat template; pass one with --chat-template")
        self.eot = self._probe_end_of_turn()
        # Ids that end a generation; stripped before decoding the completion text.
        self.stop_ids = {self.eot.token_id, *[i for i in [tokenizer.eos_token_id] if i is not None]}

    @classmethod
    def load(cls, name_or_path: str, *, chat_template: str | None = None, **kwargs: Any) -> "ChatTemplate":
        """Load the tokenizer from a local directory (no hub downloads)."""
        from transformers import AutoTokenizer  # heavy; only when a gateway starts

        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except OSError as e:  # transformers' word for "no tokenizer there"; say what was tried, in one line
            where = "the local directory" if Path(name_or_path).is_dir() else "the local Hugging Face cache for hub id"
            raise FileNotFoundError(f"model {name_or_path!r}: no tokenizer in {where} {name_or_path!r} "
                                    f"(the gateway never downloads): {' '.join(str(e).split())[:300]}") from e
        return cls(tok, chat_template=chat_template, **kwargs)

    # -- rendering --------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Message], tools: Sequence[Tool] = (), *, add_generation_prompt: bool = True,
                    reasoning: bool = False) -> str:
        """The template's text for ``messages`` (tools only when there are any)."""
        return self._render([to_hf_message(m) for m in messages], tools, add_generation_prompt, reasoning)

    def _render(self, hf_messages: list[dict[str, Any]], tools: Sequence[Tool], add_generation_prompt: bool,
                reasoning: bool) -> str:
        kwargs = {"enable_thinking": reasoning, **self.template_kwargs}
        try:
            return self.tokenizer.apply_chat_template(
                hf_messages, tools=[to_hf_tool(t) for t in tools] or None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
            )
        except Exception as e:  # jinja raise_exception / TemplateError / bad structure: the caller's fault
            raise TemplateError(f"chat template could not render the conversation: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered template text (special tokens in the text are parsed, none are added).

        The Rust backend is called directly: it releases the GIL (the gateway tokenizes in worker
        threads) and, unlike the transformers wrapper, mutates no truncation/padding state, so
        concurrent calls are safe.
        """
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = (), *, reasoning: bool = False) -> list[int]:
        """Fresh prompt: the whole conversation rendered with the generation prompt, tokenized."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=True, reasoning=reasoning))

    def bridge_ids(self, history: Sequence[Message], appended: Sequence[Message], tools: Sequence[Tool],
                   completion_ids: Sequence[int], *, reasoning: bool = False) -> list[int] | None:
        """Tokens to put after a previous call's sampled ids so the prompt continues with ``appended``.

        ``history`` ends with the assistant turn that call generated. The appended text is the
        difference between rendering history+appended (with generation prompt) and history alone; it is
        only valid when the template is append-only here, else None (the caller renders afresh).
        The sampled ids end with the end-of-turn token when the model stopped by itself; otherwise
        (length cut, stop string) that token is added, so the turn is closed as the template closes it.
        """
        before = self.render_text(history, tools, add_generation_prompt=False, reasoning=reasoning)
        after = self.render_text([*history, *appended], tools, add_generation_prompt=True, reasoning=reasoning)
        closing = self.eot.token + self.eot.trailer
        if not after.startswith(before) or not before.endswith(closing):
            return None
        glue = self.encode(self.eot.trailer + after[len(before) :])
        ended = bool(completion_ids) and completion_ids[-1] == self.eot.token_id
        return glue if ended else [self.eot.token_id, *glue]

    # -- decoding ---------------------------------------------------------------------------------

    def decode_completion(self, completion_ids: Sequence[int]) -> str:
        """Completion text as the model wrote it, special markup kept, the final stop token dropped."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- probing ----------------------------------------------------------------------------------

    def _probe_end_of_turn(self) -> EndOfTurn:
        """Find how the template closes an assistant turn by rendering one around a sentinel."""
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._render(msgs, (), add_generation_prompt=False, reasoning=False)
        tail = text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""
        ids = self.encode(tail) if tail else []
        if ids:
            token = self.tokenizer.convert_ids_to_tokens(ids[0])
            if isinstance(token, str) and tail.startswith(token):
                return EndOfTurn(ids[0], token, tail[len(token) :])
        eos = self.tokenizer.eos_token
        if eos is None:
            raise TemplateError("cannot tell how the chat template ends an assistant turn and the tokenizer has no EOS")
        return EndOfTurn(self.tokenizer.eos_token_id, eos, "")
