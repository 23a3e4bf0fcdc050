"""The served model's chat template, owned by the gateway.

The engine is sent token ids, never chat messages, so the gateway decides exactly which tokens the
model sees. ``ChatTemplate`` renders canonical messages with the model's own HF template, and computes
the *bridge*: the tokens that follow a previous call's sampled ids when a history is extended (the
end-of-turn token if the model did not emit it, template glue, tool results, the next generation
prompt). That bridge is what token-in/token-out appends.

Two ways to treat the turns a model wrote (``TurnHistory``, the gateway's ``--history``):

- ``sampled`` (token-in, the default): a turn stays in later prompts exactly as sampled, reasoning
  included, whatever the template would make of it; the bridge is only the template's rendering of the
  appended messages after it. Every call's prompt is the previous prompt + its sampled ids + the bridge.
- ``template``: a later prompt is what the template renders for the whole history; a call extends the
  previous one only where that equals the previous prompt + sampled ids + bridge, and otherwise breaks
  the chain naming what the template changed (``template_drops_reasoning``, ``template_rewrites_turn``,
  ``template_not_append_only``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .canonical import Message, Tool, ToolCall
from .toolparse import Signature

_SENTINEL = "\x00polar-sentinel\x00"
# Marks where the first appended message's content lands in a render: letters only, so no template's
# escaping (tojson of a tool result) changes it.
_MARK = "PolarstreamBridgeMarkQx7"
HISTORY_MODES = ("sampled", "template")
log = logging.getLogger("polarstream.gateway")


@dataclass(frozen=True)
class TurnHistory:
    """How later prompts keep the turns a model wrote (see the module docstring): ``keep`` is sampled or
    template; in template mode ``split_reasoning`` (the gateway's reasoning parser) tells a dropped
    reasoning from another rewrite."""

    keep: str = "sampled"
    split_reasoning: Callable[[str], tuple[str, str]] = field(default=lambda text: ("", text), compare=False)

    def __post_init__(self) -> None:
        if self.keep not in HISTORY_MODES:
            raise ValueError(f"history {self.keep!r}: expected one of {', '.join(HISTORY_MODES)}")


SAMPLED = TurnHistory()


class TemplateError(ValueError):
    """The template could not render the request (a template ``raise_exception`` or a bad message)."""


class ChainBreak(Exception):
    """A request that cannot extend the previous call's tokens; ``reason`` is the chain's break_reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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


def _generation_stops(model_dir: str) -> list[int]:
    """The ids generation stops at, from the model's generation_config.json (beyond the tokenizer's eos)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]


class SegmentCache:
    """Token ids of rendered text, cached per piece between added tokens (bounded, LRU by characters).

    Fast tokenizers cut added tokens (``<|im_start|>``, ``<tool_call>``...) out of the text before any
    normalization or BPE, so the ids of ``A<tok>B`` are ids(A) + [tok] + ids(B). Every session of a task
    renders the same system prompt and tools, and a session's history repeats the last one's, so a fresh
    render costs only its new pieces. ``ChatTemplate`` checks that equivalence on its own tokenizer first
    (``verify``) and uses the cache only when it holds; thread-safe (the gateway tokenizes in threads).
    """

    def __init__(self, encode_many: Any, added: dict[str, int], max_chars: int = 64 << 20, min_chars: int = 64):
        self._encode_many = encode_many  # list[str] -> list[list[int]], one call for all misses
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.max_chars, self.min_chars = max_chars, min_chars
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        parts = self._split.split(text)  # [text, added, text, added, ..., text]
        pieces = parts[0::2]
        with self._lock:
            found = [self._get(p) for p in pieces]
        missing = [p for p, ids in zip(pieces, found) if ids is None]
        if missing:
            fresh = dict(zip(missing, self._encode_many(missing)))
            found = [ids if ids is not None else fresh[p] for p, ids in zip(pieces, found)]
            with self._lock:
                for p in missing:
                    self._put(p, fresh[p])
        out: list[int] = []
        for i, ids in enumerate(found):
            out += ids
            if 2 * i + 1 < len(parts):
                out.append(self._added[parts[2 * i + 1]])
        return out

    def _get(self, piece: str) -> list[int] | None:
        if not piece:
            return []
        ids = self._cache.get(piece)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._cache.move_to_end(piece)
        return ids

    def _put(self, piece: str, ids: list[int]) -> None:
        if len(piece) < self.min_chars or piece in self._cache:  # short pieces: cheaper to encode than to keep
            return
        self._cache[piece] = ids
        self._chars += len(piece)
        while self._chars > self.max_chars and self._cache:
            old, _ = self._cache.popitem(last=False)
            self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._cache)


class ChatTemplate:
    """Renders canonical chats to token ids with the served model's tokenizer and template."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 stop_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        self.template_kwargs = dict(template_kwargs or {})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise TemplateError("the tokenizer has no chat template; pass one with --chat-template")
        self.eot = self._probe_end_of_turn()
        # Ids that end a generation; stripped before decoding the completion text.
        self.stop_ids = {self.eot.token_id, *[i for i in [tokenizer.eos_token_id, *stop_ids] if i is not None]}
        # what may close a turn in a render: the turn end and every token generation stops at (GLM's
        # next-role tokens, harmony's <|call|>)
        self._ends = sorted({self.eot.token, *self.tokenizer.convert_ids_to_tokens(sorted(self.stop_ids))}, key=len)
        self.segments = self._segment_cache()
        # Bridges render a window of the history: 2 = without the tool definitions, 1 = with them, 0 = the
        # whole history (gateway/tokens.py steps down when a check against a full render disagrees).
        self.window_level = 2

    @classmethod
    def load(cls, name_or_path: str, *, chat_template: str | None = None, **kwargs: Any) -> "ChatTemplate":
        """Load the tokenizer from a local directory (the gateway never downloads: FileNotFoundError)."""
        from infra.models import load_tokenizer

        return cls(load_tokenizer(name_or_path), chat_template=chat_template, stop_ids=_generation_stops(name_or_path),
                   **kwargs)

    def signature(self) -> Signature:
        """What the tokenizer shows of its model's markup: the template text and the special tokens (the
        gateway picks its tool-call and reasoning parsers from it)."""
        text = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        if isinstance(text, dict):  # named templates (default, tool_use, ...): any of them may show the markup
            text = "\n".join(str(t) for t in text.values())
        special = {t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()}
        return Signature(str(text), frozenset(special))

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
        """Fresh prompt: the whole conversation rendered with the generation prompt, tokenized (pieces
        seen before, such as a task's system prompt and tools, come from the segment cache)."""
        text = self.render_text(messages, tools, add_generation_prompt=True, reasoning=reasoning)
        return self.segments.encode(text) if self.segments is not None else self.encode(text)

    def bridge_ids(self, history: Sequence[Message], appended: Sequence[Message], tools: Sequence[Tool],
                   completion_ids: Sequence[int], *, reasoning: bool = False, turns: TurnHistory = SAMPLED) -> list[int]:
        """Tokens to put after a previous call's sampled ids so the prompt continues with ``appended``.

        ``history`` ends with the assistant turn that call generated (the harness's echo of it). The
        bridge is the template's rendering of ``appended`` and the generation prompt, taken from where
        the template closes that turn: found by marking the first appended message's content and going
        back to the last turn-closing token before it (so the template's own closing text, such as
        ChatML's "\\n", is in the bridge). The sampled ids end with a stop token when the model stopped by
        itself; otherwise (length cut, stop string) the template's closing token is put first. In
        ``template`` mode (``turns``) the result must also equal the template's rendering of the whole history, or
        the chain breaks (ChainBreak, naming what the template changed).
        """
        if not appended:
            raise ChainBreak("assistant_prefill")
        first = appended[0]
        marked = [*history, replace(first, content=first.content + _MARK), *appended[1:]]
        text = self.render_text(marked, tools, add_generation_prompt=True, reasoning=reasoning)
        after = self.render_text([*history, *appended], tools, add_generation_prompt=True, reasoning=reasoning)
        at = text.find(_MARK)
        found = {e: text.rfind(e, 0, at) for e in self._ends} if at >= 0 else {}
        ends = {e: i + len(e) for e, i in found.items() if i >= 0}
        if not ends:
            raise ChainBreak("template_not_append_only")  # no turn end before the appended messages
        close = max(ends, key=ends.__getitem__)  # the last one: where the echoed turn ends
        glue = text[ends[close]:].replace(_MARK, "", 1)
        if not after.endswith(glue):  # the marked content changed more than itself
            raise ChainBreak("template_not_append_only")
        ended = bool(completion_ids) and completion_ids[-1] in self.stop_ids
        closing = [] if ended else [self.tokenizer.convert_tokens_to_ids(close)]
        if turns.keep == "template":
            self._check_template_way(history, tools, reasoning, [*completion_ids, *closing], after, glue,
                                     turns.split_reasoning)
        return [*closing, *self.encode(glue)]

    def _check_template_way(self, history: Sequence[Message], tools: Sequence[Tool], reasoning: bool,
                            turn_ids: Sequence[int], after: str, glue: str,
                            split_reasoning: Callable[[str], tuple[str, str]]) -> None:
        """ChainBreak unless previous prompt + sampled turn + glue is the template's own rendering."""
        base = self.render_text(history[:-1], tools, add_generation_prompt=False, reasoning=reasoning)
        prompt = self.render_text(history[:-1], tools, add_generation_prompt=True, reasoning=reasoning)
        if not (after.startswith(base) and prompt.startswith(base)):
            raise ChainBreak("template_not_append_only")  # the template changed earlier history
        # the turn as the model saw and wrote it (generation prompt + sampled ids) against the template's
        sampled = self.tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        rendered = after[len(base):len(after) - len(glue)]
        if rendered == prompt[len(base):] + sampled:
            return
        thought, _ = split_reasoning(sampled)
        raise ChainBreak("template_drops_reasoning" if thought.strip() and thought.strip() not in rendered
                         else "template_rewrites_turn")

    # -- decoding ---------------------------------------------------------------------------------

    def decode_completion(self, completion_ids: Sequence[int]) -> str:
        """Completion text as the model wrote it, special markup kept, the final stop token dropped."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- probing ----------------------------------------------------------------------------------

    def _segment_cache(self) -> SegmentCache | None:
        """A SegmentCache when piecewise encoding gives exactly this tokenizer's ids, else None."""
        if self._backend is None:
            return None
        added = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items()}
        if not added or any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False)
                            for t in self.tokenizer.added_tokens_decoder.values()):
            return None  # an added token that eats neighbouring spaces joins its pieces
        backend = self._backend
        cache = SegmentCache(lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)], added)
        probe = [Message("system", "Be brief.\n"), Message("user", " Fix the bug in  main.py\n\n"),
                 Message("assistant", "Let me look.", tool_calls=[ToolCall("call_1", "bash", '{"cmd": "ls -la"}')]),
                 Message("tool", "main.py\n  README.md ", tool_call_id="call_1"), Message("user", "thanks ")]
        tool = Tool("bash", "Run a command.", {"type": "object", "properties": {"cmd": {"type": "string"}}})
        texts = [f" {t} x{t}\n{t}  y \n" for t in added]
        for msgs, tools in ((probe, [tool]), (probe[1:], [])):
            try:
                texts.append(self.render_text(msgs, tools))
            except TemplateError:  # a strict template refusing the probe's shape: the raw probes decide
                pass
        for text in texts:
            if cache.encode(text) != self.encode(text) or cache.encode(text) != self.encode(text):  # miss, then hit
                log.info("piecewise tokenization differs from whole-text tokenization: segment cache off")
                return None
        return cache

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
