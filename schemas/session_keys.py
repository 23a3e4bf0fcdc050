"""Session keys: the credential a harness sends for one rollout session, and what it binds.

A session key is what a harness sends as its API key (``x-api-key``, ``Authorization: Bearer``,
``x-goog-api-key``) or as a ``/s/{key}`` path prefix. Keys are self-contained and HMAC-signed with
``settings.session_secret``::

    sk-polar-<base64url(JSON claims)>.<base64url(HMAC-SHA256(claims)[:16])>

so any gateway replica holding the secret can verify a key and knows which session (and group, task,
sample) it belongs to without a lookup, and a harness cannot forge a key for another session. Every key
carries its expiry (``e``, unix seconds), so a leaked key stops working by itself. In open mode a key
that is not a polar key names an ad-hoc session in a namespace of its own (``open:<name>`` or
``open:<sha256(key)[:16]>``), so an ad-hoc caller can never append to a rollout session.

A contract between components, hence in schemas/: the rollout producer mints keys
(producers/rollout/fanout.py), the gateway verifies them (gateway/routes.py) and keeps per-session
state under their claims (gateway/sessions.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from dataclasses import dataclass, field

import orjson

KEY_PREFIX = "sk-polar-"
OPEN_PREFIX = "open:"  # ad-hoc sessions (open mode); a minted key can never name one
DEFAULT_KEY_TTL_S = 7 * 24 * 3600  # settings.session_key_ttl_s: longer than any rollout session waits and runs


class InvalidSessionKey(ValueError):
    """A key that is missing, malformed, expired or not signed with this gateway's secret."""


@dataclass(frozen=True)
class SessionClaims:
    """What a key binds: the session and where its calls belong."""

    session_id: str
    group_id: str = ""
    task_id: str = ""
    sample_index: int = 0
    attempt: int = 0
    harness: str = ""  # the harness the node runs in this session ('' = tell by User-Agent)
    run: str = ""  # the run's topic prefix, for a gateway shared by several runs ('' = the gateway's own)
    expires_at: int = field(default=0, compare=False)  # unix seconds; 0 = an open-mode session (no key)
    minted_at: int = field(default=0, compare=False)  # unix milliseconds; 0 = unknown (open mode, older keys)


_CLAIM_KEYS = (("s", "session_id"), ("g", "group_id"), ("t", "task_id"), ("i", "sample_index"), ("a", "attempt"),
               ("h", "harness"), ("e", "expires_at"), ("m", "minted_at"), ("r", "run"))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(payload: str, secret: str) -> str:
    return _b64(hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest()[:16])


def mint_session_key(session_id: str, secret: str, *, group_id: str = "", task_id: str = "", sample_index: int = 0,
                     attempt: int = 0, harness: str = "", ttl_s: float = DEFAULT_KEY_TTL_S,
                     now: float | None = None, run: str = "") -> str:
    """A key scoped to ``session_id`` (and its group/task/sample), signed with ``secret``, valid ``ttl_s``."""
    if not session_id:
        raise ValueError("session_id: must not be empty")
    if session_id.startswith(OPEN_PREFIX):
        raise ValueError(f"session_id: {OPEN_PREFIX!r} is the namespace of open-mode sessions")
    if ttl_s <= 0:
        raise ValueError("ttl_s: must be positive")
    now = time.time() if now is None else now
    claims = SessionClaims(session_id, group_id, task_id, sample_index, attempt, harness, run=run,
                           expires_at=int(now + ttl_s), minted_at=int(now * 1000))
    raw = {short: getattr(claims, name) for short, name in _CLAIM_KEYS if getattr(claims, name) not in ("", 0)}
    payload = _b64(orjson.dumps(raw))
    return f"{KEY_PREFIX}{payload}.{_sign(payload, secret)}"


def verify_session_key(key: str, secret: str, now: float | None = None) -> SessionClaims:
    """The claims of an unexpired key signed with ``secret``; raises InvalidSessionKey for anything else."""
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
    if not claims.session_id or claims.session_id.startswith(OPEN_PREFIX):
        raise InvalidSessionKey("session key names no session")
    if not claims.expires_at:
        raise InvalidSessionKey("session key carries no expiry (minted by an older gateway): mint a new one")
    if (time.time() if now is None else now) >= claims.expires_at:
        expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims.expires_at))
        raise InvalidSessionKey(f"session key expired at {expired}")
    return claims


_READABLE = re.compile(r"[A-Za-z0-9._\-]{1,128}")


def open_session_claims(key: str = "", name: str = "") -> SessionClaims:
    """Open mode: a readable ``name`` (``/s/{name}``, ``x-session-id``) or an arbitrary key becomes an
    ad-hoc session under ``open:``. A key is hashed (it never reaches the events); so is an odd name."""
    if name and _READABLE.fullmatch(name):
        return SessionClaims(session_id=OPEN_PREFIX + name)
    return SessionClaims(session_id=OPEN_PREFIX + hashlib.sha256((name or key).encode()).hexdigest()[:16])
