"""The gateway's per-session state: chain tips and locks, call indexes, and which sessions are closed.

A session is what a session key names (schemas/session_keys.py: minting, verifying, open mode); the
store keeps, for each one, what token-in/token-out needs of its earlier calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from schemas.session_keys import DEFAULT_KEY_TTL_S, SessionClaims

from .canonical import Message, Tool, ToolCall
from .redact import ScrubMemo
from .tombstones import TombstoneFile

BOOT_EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: keeps the call indices of a restarted gateway short


class SessionClosed(Exception):
    """A call for a session that was dropped (finished, forgotten, or its state lost): its key is spent."""


@dataclass
class Turn:
    """What the session remembers of its last main-chain call (for token-in/token-out)."""

    call_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    messages: list[Message]  # the request's history as the harness sent it
    tools: list[Tool]
    text: str  # what the gateway generated, to match the harness's echo of it
    tool_calls: list[ToolCall]
    extends_call_index: int | None = None
    break_reason: str = ""
    model: str = ""  # the model the harness named: a call naming another is a side call

    @property
    def full_sequence(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]


MAX_TIPS = 4  # chains a session keeps a tip for: the main loop and a few sub-agents


def tip_key(req: Any) -> tuple:
    """Which chain a request continues: its leading system messages, its first other message (the task
    it was given), its tool names and its model.

    A sub-agent (Claude Code's Task) shares the session's key but has its own system prompt and tools,
    and two sub-agents of one kind running at once differ in their task: keyed apart, the main chain
    and each sub-agent's chain keep their own tip (and lock) and all go on merging, in parallel,
    instead of breaking each other at every switch. A history is append-only, so a chain's key holds."""
    msgs = req.messages
    n = next((i for i, m in enumerate(msgs) if m.role != "system"), len(msgs))
    task = (msgs[n].role, msgs[n].content) if n < len(msgs) else None
    return tuple(m.content for m in msgs[:n]), task, tuple(t.name for t in req.tools), req.model


@dataclass
class ChainSlot:
    """One chain's lock and scrub memo: calls of one chain are sequential by nature, other chains' not."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    memo: ScrubMemo = field(default_factory=ScrubMemo)  # the chain's last request as sent and as scrubbed


@dataclass
class SessionState:
    """Per-session state.

    A call holds its chain's lock (``chain``) from prompt to answer, so calls of different chains (a
    main loop and its sub-agents) generate in parallel. It takes ``publish_lock`` only to get its
    call_index, publish and advance the state: indexes are assigned in publish order, without holes.
    """

    claims: SessionClaims
    publish_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    slots: OrderedDict = field(default_factory=OrderedDict)  # chain key -> ChainSlot, least recent first
    next_call_index: int = 0
    next_request: int = 0  # engine request ids: unique even for calls generating in parallel
    main: Turn | None = None  # the latest chain tip (of any key)
    tips: OrderedDict = field(default_factory=OrderedDict)  # tip_key -> Turn, least recent first
    last_call: tuple[int, list[int]] | None = None  # (call_index, full sequence) of the latest call of any kind
    pending: Any = None  # service.PendingPublish: a publish whose outcome is not known yet (Kafka slow or down)
    evicted: bool = False  # the chain tip was shed under memory pressure
    calls: int = 0
    merged: int = 0
    breaks: int = 0
    side_calls: int = 0
    failed: int = 0  # calls answered with an error and not recorded
    last_used: float = field(default_factory=time.monotonic)

    @contextlib.asynccontextmanager
    async def chain(self, key: tuple):
        """Hold chain ``key``'s lock; yields its ChainSlot."""
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = ChainSlot()
            idle = [k for k, s in self.slots.items() if not s.lock.locked() and k != key]
            for k in idle[: max(0, len(self.slots) - 2 * MAX_TIPS)]:  # bounded, never a busy one
                del self.slots[k]
        self.slots.move_to_end(key)
        async with slot.lock:
            yield slot

    def busy(self) -> bool:
        """A call of this session is in flight (generating or publishing)."""
        return self.publish_lock.locked() or any(s.lock.locked() for s in self.slots.values())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight and no publish outcome is unknown; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.busy() or (self.pending is not None and not self.pending.done()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def tip_for(self, key: tuple) -> Turn | None:
        """The tip a call of chain ``key`` may extend: its own, else the latest (which gives the break's reason)."""
        tip = self.tips.get(key) if self.tips else None
        return tip if tip is not None else self.main

    def remember(self, key: tuple, turn: Turn) -> None:
        """``turn`` is now the tip of chain ``key``, and the latest."""
        self.tips[key] = turn
        self.tips.move_to_end(key)
        while len(self.tips) > MAX_TIPS:
            self.tips.popitem(last=False)
        self.main = turn

    def stats(self) -> dict[str, Any]:
        """Counters a gateway node reads when its session ends (``num_calls`` = recorded calls)."""
        return {
            "session_id": self.claims.session_id,
            "num_calls": self.calls,
            "merged": self.merged,
            "breaks": self.breaks,
            "side_calls": self.side_calls,
            "failed": self.failed,
            "next_call_index": self.next_call_index,
            "pending": self.pending is not None,
        }


class SessionStore:
    """In-memory session states.

    Beyond ``max_sessions`` the least recently used idle sessions are *shed*: they lose their chain
    tip (the heavy part: a whole history) but keep ``call_index`` and counters, so a session that comes
    back never reuses a call index (its next main call starts a chain with ``state_evicted``). Shed
    states beyond ten times that are forgotten; nodes ``drop`` finished sessions anyway.

    A dropped or forgotten session leaves a *tombstone* until its key expires: a later call with its key
    is refused (``SessionClosed``) instead of starting the session again at call_index 0, which would
    collide with the calls already recorded under that index. With a ``TombstoneFile`` that holds across
    restarts too.

    A restart loses every state, so a session may come back to a gateway that has never seen it but whose
    predecessor recorded some of its calls. Each process has a ``boot_id`` (on every record) and a
    ``boot_base``: its start time in milliseconds since 2026. A session whose key was minted before this
    process started (or carries no mint time: open mode, older keys) numbers its calls from
    ``boot_base``, above any index an earlier process could have given it (that would take more than
    one call per millisecond), so they sort after them and never collide. Sessions minted while this
    process runs, which is every rollout session of a healthy gateway, start at 0.
    """

    def __init__(self, max_sessions: int = 10_000, tombstone_ttl_s: float = DEFAULT_KEY_TTL_S,
                 tombstones: TombstoneFile | None = None, boot_at: float | None = None):
        self.max_sessions = max_sessions
        self.tombstone_ttl_s = tombstone_ttl_s  # for sessions whose key expiry is unknown (open mode)
        self.boot_at_ms = int((time.time() if boot_at is None else boot_at) * 1000)
        self.boot_base = self.boot_at_ms - BOOT_EPOCH_MS
        self.boot_id = f"{self.boot_at_ms:x}-{uuid.uuid4().hex[:8]}"
        self._states: OrderedDict[str, SessionState] = OrderedDict()  # full states, least recent first
        self._shed: OrderedDict[str, SessionState] = OrderedDict()
        self._file = tombstones
        loaded = sorted(tombstones.load().items(), key=lambda kv: kv[1]) if tombstones else []
        self._tombstones: OrderedDict[str, float] = OrderedDict(loaded)  # session id -> unix time it may be forgotten

    def get(self, claims: SessionClaims) -> SessionState:
        """The state for ``claims.session_id``, created on first use; SessionClosed after ``drop``."""
        sid = claims.session_id
        if self._tombstones and sid in self._tombstones:
            if self._tombstones[sid] > time.time():
                raise SessionClosed(f"session {sid!r} is closed: its key records no more calls (mint a new one)")
            del self._tombstones[sid]
        st = self._states.get(sid)
        if st is not None:
            self._states.move_to_end(sid)
        else:
            st = self._shed.pop(sid, None)
            if st is None:
                st = SessionState(claims)
                if claims.minted_at < self.boot_at_ms:  # an earlier process may have recorded some of its calls
                    st.next_call_index = self.boot_base
            self._states[sid] = st
            self._shed_idle()
        st.last_used = time.monotonic()
        return st

    def find(self, session_id: str) -> SessionState | None:
        return self._states.get(session_id) or self._shed.get(session_id)

    def drop(self, session_id: str) -> SessionState | None:
        """Forget a finished session (its calls stay in Kafka) and tombstone its id until its key expires."""
        st = self._states.pop(session_id, None) or self._shed.pop(session_id, None)
        self._tombstone(session_id, st)
        return st

    def closed(self, session_id: str) -> bool:
        return self._tombstones.get(session_id, 0.0) > time.time()

    def _tombstone(self, session_id: str, st: SessionState | None) -> None:
        now = time.time()
        expires = st.claims.expires_at if st is not None and st.claims.expires_at else now + self.tombstone_ttl_s
        self._tombstones[session_id] = expires
        self._tombstones.move_to_end(session_id)
        if self._file is not None:
            self._file.append(session_id, expires)
        while self._tombstones:  # roughly expiry order (keys share one TTL): drop the expired from the front
            first = next(iter(self._tombstones))
            if self._tombstones[first] > now:
                break
            del self._tombstones[first]

    def __len__(self) -> int:
        return len(self._states) + len(self._shed)

    def _shed_idle(self) -> None:
        excess = len(self._states) - self.max_sessions
        if excess <= 0:
            return
        for sid in list(self._states)[: excess + 8]:  # a few extra: busy ones are skipped
            st = self._states[sid]
            if excess <= 0:
                break
            if st.busy() or st.pending is not None:
                continue
            del self._states[sid]
            st.main, st.last_call, st.evicted = None, None, True
            st.tips.clear()
            st.slots.clear()
            self._shed[sid] = st
            excess -= 1
        while len(self._shed) > 10 * self.max_sessions:
            sid, st = self._shed.popitem(last=False)
            self._tombstone(sid, st)  # its call_index is lost with it: refuse the key rather than reuse indexes
