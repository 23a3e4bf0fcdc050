"""Session keys and per-session state.

A session key is what a harness sends as its API key (``x-api-key``, ``Authorization: Bearer``,
``x-goog-api-key``) or as a ``/s/{key}`` path prefix. Keys are self-contained and HMAC-signed with
``settings.session_secret``::

    sk-polar-<base64url(JSON claims)>.<base64url(HMAC-SHA256(claims)[:16])>

so any gateway replica holding the secret can verify a key and knows which session (and group, task,
sample) it belongs to without a lookup, and a harness cannot forge a key for another session. In open
mode a key that is not a polar key names an ad-hoc session instead (``open-<sha256(key)[:16]>``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from .canonical import Message, Tool, ToolCall
from .redact import ScrubMemo

KEY_PREFIX = "sk-polar-"


class InvalidSessionKey(ValueError):
    """A key that is missing, malformed or not signed with this gateway's secret."""


@dataclass(frozen=True)
class SessionClaims:
    """What a key binds: the session and where its calls belong."""

    session_id: str
    group_id: str = ""
    task_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    harness: str = ""  # the harness the node runs in this session ('' = tell by User-Agent)


_CLAIM_KEYS = (("s", "session_id"), ("g", "group_id"), ("t", "task_id"), ("i", "sample_index"), ("a", "attempt"),
               ("h", "harness"))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(payload: str, secret: str) -> str:
    return _b64(hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest()[:16])


def mint_session_key(session_id: str, secret: str, *, group_id: str = "", task_id: str = "", sample_index: int = 0,
                     attempt: int = 0, harness: str = "") -> str:
    """A key scoped to ``session_id`` (and its group/task/sample), signed with ``secret``."""
    if not session_id:
        raise ValueError("session_id: must not be empty")
    claims = SessionClaims(session_id, group_id, task_id, sample_index, attempt, harness)
    raw = {short: getattr(claims, name) for short, name in _CLAIM_KEYS if getattr(claims, name) not in ("", 0)}
    payload = _b64(orjson.dumps(raw))
    return f"{KEY_PREFIX}{payload}.{_sign(payload, secret)}"


def verify_session_key(key: str, secret: str) -> SessionClaims:
    """The claims of a key signed with ``secret``; raises InvalidSessionKey for anything else."""
    if not key.startswith(KEY_PREFIX):
        raise InvalidSessionKey("not a polarstream session key")
    payload, dot, sig = key[len(KEY_PREFIX) :].partition(".")
    if not dot or not payload or not hmac.compare_digest(sig.encode(), _sign(payload, secret).encode()):
        raise InvalidSessionKey("session key signature does not verify")
    try:
        raw = orjson.loads(_unb64(payload))
        claims = SessionClaims(**{name: raw[short] for short, name in _CLAIM_KEYS if short in raw})
    except (ValueError, TypeError) as e:  # signed but unreadable: a secret shared with a different format
        raise InvalidSessionKey(f"session key claims are unreadable ({e})") from None
    if not claims.session_id:
        raise InvalidSessionKey("session key names no session")
    return claims


def open_session_claims(key: str) -> SessionClaims:
    """Open mode: an arbitrary key (or path name) becomes an ad-hoc session of its own."""
    return SessionClaims(session_id="open-" + hashlib.sha256(key.encode()).hexdigest()[:16])


# --------------------------------------------------------------------------------------- state


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

    @property
    def full_sequence(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]


@dataclass
class SessionState:
    """Per-session state; mutated only while ``lock`` is held, so call_index order is causal order."""

    claims: SessionClaims
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_call_index: int = 0
    main: Turn | None = None  # the main chain's tip
    last_call: tuple[int, list[int]] | None = None  # (call_index, full sequence) of the latest call of any kind
    pending: Any = None  # service.PendingPublish: a publish whose outcome is not known yet (Kafka slow or down)
    evicted: bool = False  # the chain tip was shed under memory pressure
    calls: int = 0
    merged: int = 0
    breaks: int = 0
    side_calls: int = 0
    failed: int = 0  # calls answered with an error and not recorded
    last_used: float = field(default_factory=time.monotonic)
    scrub_memo: ScrubMemo = field(default_factory=ScrubMemo)  # the last request as sent and as scrubbed

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
    states beyond ten times that are forgotten entirely; nodes ``drop`` finished sessions anyway.
    """

    def __init__(self, max_sessions: int = 10_000):
        self.max_sessions = max_sessions
        self._states: OrderedDict[str, SessionState] = OrderedDict()  # full states, least recent first
        self._shed: OrderedDict[str, SessionState] = OrderedDict()

    def get(self, claims: SessionClaims) -> SessionState:
        """The state for ``claims.session_id``, created on first use."""
        sid = claims.session_id
        st = self._states.get(sid)
        if st is not None:
            self._states.move_to_end(sid)
        else:
            st = self._shed.pop(sid, None) or SessionState(claims)
            self._states[sid] = st
            self._shed_idle()
        st.last_used = time.monotonic()
        return st

    def find(self, session_id: str) -> SessionState | None:
        return self._states.get(session_id) or self._shed.get(session_id)

    def drop(self, session_id: str) -> SessionState | None:
        """Forget a finished session (its calls stay in Kafka)."""
        return self._states.pop(session_id, None) or self._shed.pop(session_id, None)

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
            if st.lock.locked() or st.pending is not None:
                continue
            del self._states[sid]
            st.main, st.last_call, st.evicted = None, None, True
            st.scrub_memo = ScrubMemo()
            self._shed[sid] = st
            excess -= 1
        while len(self._shed) > 10 * self.max_sessions:
            self._shed.popitem(last=False)
