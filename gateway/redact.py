"""Credentials out of the log: scrub them from a call before the model or Kafka sees them.

Where it runs (docs/security.md): on the *incoming* request, before the prompt is tokenized. The
engine then generates from the placeholders, so the recorded prompt ids are exactly what the model
was conditioned on (training stays on-policy) and no token id anywhere encodes the secret. The
model's own output is recorded as sampled (its token ids are never changed); its text fields are
scrubbed too, so a secret-shaped string the model produced by itself is not in the text of the event.

A secret becomes ``[REDACTED:<kind>:<hash8>]``: ``hash8`` is an HMAC of the secret under a per-
deployment key, so the same secret gets the same placeholder in every call (prompts stay prefixes of
each other, token-in/token-out keeps merging) while nobody without the key can test guesses of a
weak password against the log. Scrubbing is idempotent: placeholders never match a pattern.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import hmac
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

PLACEHOLDER = re.compile(r"\[REDACTED:([a-z0-9_]+):([0-9a-f]{8})\]")
_NOT_PLACEHOLDER = r"(?!\[REDACTED:)"

# kind -> pattern. Where a pattern has a group named ``s``, only that group is the secret (the label
# around it, e.g. "Bearer " or "API_KEY=", stays readable). Order matters: the first match wins.
# A value that is not itself a secret: a placeholder, a reference ($VAR, ${...}, %VAR%), a call, a
# special-token string like "<|im_end|>" or "[MASK]" (tokenizer configs are everywhere in ML repos).
_NOT_REFERENCE = r"(?![$%{(<\[])"
# `settings.SECRET_KEY`, `self.token`: an attribute is code, not a value (possessive: no shorter match).
_NOT_ATTRIBUTE = r"(?![A-Za-z_][A-Za-z0-9_]*+(?:\.[A-Za-z_][A-Za-z0-9_]*+)++(?![A-Za-z0-9_.]))"
# Keys (any case) that name a secret when the key *ends* with them: `db_password`, `apiKey`, `client_secret`.
# `pwd`, `auth` and `credentials` are left to the upper-case .env pattern: in lower case they name the
# working directory, an auth mode or a file path far more often than a secret.
_SECRET_KEYS = (r"(?i:password|passwd|passphrase|secret|secret[_\-]?key|token|api[_\-]?key|access[_\-]?key|"
                r"private[_\-]?key)")

# kind -> pattern. Where a pattern has a group named ``s``, only that group is the secret (the label
# around it, e.g. "Bearer " or "API_KEY=", stays readable). Order matters: the first match wins.
PATTERNS: dict[str, str] = {
    "private_key": r"-----BEGIN (?P<label>[A-Z0-9 ]*)PRIVATE KEY-----[\s\S]*?-----END (?P=label)PRIVATE KEY-----",
    "anthropic_key": r"\bsk-ant-[A-Za-z0-9_\-]{20,}",
    "openai_key": r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{35}",
    "aws_access_key": r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b",
    "aws_secret_key": r"(?i:aws.{0,24}?(?:secret|private).{0,24}?)[\"'=:\s]+(?P<s>" + _NOT_PLACEHOLDER + r"[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])",
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
    "slack_token": r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",
    "jwt": r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    # scheme://user:password@host: the password (connection strings, git remotes, proxy URLs).
    "url_credentials": r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@'\"]+:(?P<s>" + _NOT_PLACEHOLDER + r"(?![$%{])[^\s@/'\"]+)@",
    # .npmrc: `//registry/:_authToken=...`, `_auth=`, `_password=`; and npm's own token shape anywhere.
    "npm_token": (r"(?:(?m:^|:)[ \t]*(?i:_authtoken|_auth|_password)[ \t]*=[ \t]*[\"']?(?P<s>" + _NOT_PLACEHOLDER
                  + r"(?![$%{])[^\s\"']{6,})|\bnpm_[A-Za-z0-9]{36}\b)"),
    "basic_auth": r"(?i:\bauthorization)[\"']?[ \t]*[:=][ \t]*[\"']?(?i:basic)[ \t]+(?P<s>" + _NOT_PLACEHOLDER + r"[A-Za-z0-9+/]{6,}={0,2})",
    # A bearer token holds a digit or is long: "Bearer authentication" is prose, not a credential.
    "bearer": (r"(?i:\bbearer)\s+(?P<s>" + _NOT_PLACEHOLDER
               + r"(?=[A-Za-z\-._~+/]*[0-9]|[A-Za-z0-9\-._~+/]{32})[A-Za-z0-9\-._~+/]{12,}=*)"),
    # .env style: an UPPER_CASE name that says it is a secret (or is just PASSWORD, TOKEN...), '=' or ': ',
    # a value of 6+ characters (not a call or a reference to another variable: code, not a credential).
    "env_secret": (r"(?m)^[ \t]*(?:export[ \t]+)?(?:[A-Z][A-Z0-9_]*)?(?:SECRET|TOKEN|PASSWORD|PASSWD|PWD|API_?KEY|"
                   r"ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|AUTH)[A-Z0-9_]*[ \t]*(?:=|:[ \t])[ \t]*[\"']?(?P<s>"
                   + _NOT_PLACEHOLDER + r"(?![$%{(])" + _NOT_ATTRIBUTE + r"[^\s\"'#()\[\]]{6,}+)(?![(\[])"),
    # Config lines in any case (YAML, INI, TOML, code): `password: hunter22`, `api_key = "..."`. The value
    # must end the line (an annotation like `token: Optional[str] = None` or `password: string;` is
    # code), and after '=' an unquoted name or attribute (`self.token = token`) is code too.
    "config_secret": (r"(?m)^[ \t]*(?:-[ \t]+)?(?:export[ \t]+)?[\"']?[A-Za-z0-9_.\-]*?" + _SECRET_KEYS
                      + r"[\"']?[ \t]*(?:(?P<eq>=)|:)[ \t]*(?P<q>[\"'`])?(?P<s>" + _NOT_PLACEHOLDER + _NOT_REFERENCE
                      + r"(?![0-9.]+(?(q)(?P=q))[ \t]*$)"  # a number: a limit, not a secret
                      + r"(?![A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?(q)(?P=q))[ \t]*$)"  # an attribute
                      + r"(?(q)|(?(eq)(?![A-Za-z_][A-Za-z0-9_]*[ \t]*$)))"  # `= name` unquoted: a variable
                      + r"[^\s\"'`#()\[\]{}<>,;]{6,})(?(q)(?P=q)[ \t]*[,;]?)[ \t]*(?:(?:#|//).*)?$"),
    # A quoted key and value anywhere (JSON, dict literals): `"apiKey": "..."`, `'client_secret': '...'`.
    "json_secret": (r"[\"'][A-Za-z0-9_.\-]*?" + _SECRET_KEYS + r"[\"'][ \t]*:[ \t]*(?P<q>[\"'])(?P<s>"
                    + _NOT_PLACEHOLDER + _NOT_REFERENCE + r"[^\"'\\\n]{6,})(?P=q)"),
}


# kind -> substrings one of which every match contains: a text holding none of them skips that regex.
# ``lower`` needles are looked for in the lower-cased text (the pattern is case-insensitive there).
_KEY_NEEDLES = ("pass", "secret", "token", "key")
NEEDLES: dict[str, tuple[tuple[str, ...], bool]] = {
    "private_key": (("PRIVATE KEY-----",), False),
    "anthropic_key": (("sk-ant-",), False),
    "openai_key": (("sk-",), False),
    "google_api_key": (("AIza",), False),
    "aws_access_key": (("AKIA", "ASIA", "ABIA", "ACCA"), False),
    "aws_secret_key": (("aws",), True),
    "github_token": (("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), False),
    "slack_token": (("xox",), False),
    "jwt": (("eyJ",), False),
    "url_credentials": (("://",), False),
    "npm_token": (("_auth", "_password", "npm_"), True),
    "basic_auth": (("basic",), True),
    "bearer": (("bearer",), True),
    "env_secret": (("SECRET", "TOKEN", "PASSW", "PWD", "API", "ACCESS_KEY", "PRIVATE_KEY", "CREDENTIAL", "AUTH"), False),
    "config_secret": (_KEY_NEEDLES, True),
    "json_secret": (_KEY_NEEDLES, True),
}


def redaction_key(session_secret: str) -> str:
    """The placeholder HMAC key, derived from the session secret: the secret that signs session keys is
    then never itself the key of a hash printed in the log (a different purpose, a different key)."""
    return hmac.new(session_secret.encode(), b"polarstream/redaction/v1", hashlib.sha256).hexdigest()


@dataclass
class RedactConfig:
    """What the gateway scrubs. ``extra`` adds kind -> regex (a group named ``s`` marks the secret part)."""

    enabled: bool = True
    extra: dict[str, str] = field(default_factory=dict)
    disable: list[str] = field(default_factory=list)  # built-in kinds to switch off (false positives)


@dataclass
class Scrubbed:
    """What scrubbing one request found: counts per kind, and per message index (to count new ones only)."""

    counts: Counter = field(default_factory=Counter)
    per_message: dict[int, Counter] = field(default_factory=dict)

    def since(self, offset: int) -> dict[str, int]:
        """Counts in messages[offset:] (what a recorded event stores anew) plus the non-message parts."""
        out = Counter(self.per_message.get(-1, Counter()))
        for i, c in self.per_message.items():
            if i >= offset:
                out.update(c)
        return dict(out)


@dataclass
class ScrubMemo:
    """A session's last request as (message as sent, scrubbed copy, what was found in it)."""

    messages: list[tuple[Any, Any, Counter]] = field(default_factory=list)


class Redactor:
    """Scrubs strings, chat requests and recorded calls with one compiled pattern set."""

    def __init__(self, config: RedactConfig | None = None, key: str = "polarstream-redaction"):
        self.config = config or RedactConfig()
        self.key = key.encode()
        kinds = {k: v for k, v in PATTERNS.items() if k not in self.config.disable}
        for kind, rx in self.config.extra.items():
            if not re.fullmatch(r"[a-z0-9_]+", kind):
                raise ValueError(f"redaction kind {kind!r}: use lower-case letters, digits and _")
            try:
                re.compile(rx)
            except re.error as e:
                raise ValueError(f"redaction pattern {kind!r} is not a valid regex: {e}") from None
            kinds[kind] = rx
        self.patterns = [(k, re.compile(v)) for k, v in kinds.items()]
        # A user's extra pattern has no needles: it always runs.
        self._needles = [NEEDLES.get(k, ((), False)) if k not in self.config.extra else ((), False) for k in kinds]

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def placeholder(self, kind: str, secret: str) -> str:
        """The stable placeholder of ``secret``."""
        digest = hmac.new(self.key, secret.encode(), hashlib.sha256).hexdigest()[:8]
        return f"[REDACTED:{kind}:{digest}]"

    def scrub(self, text: str, counts: Counter | None = None) -> str:
        """``text`` with every secret replaced by its placeholder; adds what it found to ``counts``."""
        if not text or not self.enabled:
            return text
        lowered = None
        for (kind, rx), (needles, lower) in zip(self.patterns, self._needles):
            if needles:  # a literal pre-check: most text holds no needle, and `in` is far cheaper than a regex
                if lower and lowered is None:
                    lowered = text.lower()
                hay = lowered if lower else text
                if not any(n in hay for n in needles):
                    continue
            new = rx.sub(lambda m, kind=kind: self._replace(m, kind, counts), text)
            if new is not text:  # re.sub hands back its input when nothing matched
                text, lowered = new, None
        return text

    def _scrub_message(self, m: Any, counts: Counter) -> Any:
        """Message ``m`` with its texts scrubbed; ``m`` itself when nothing was found (no copy)."""
        content, reasoning = self.scrub(m.content, counts), self.scrub(m.reasoning, counts)
        args = [self.scrub(tc.arguments, counts) for tc in m.tool_calls]
        if content is m.content and reasoning is m.reasoning and all(a is tc.arguments for a, tc in zip(args, m.tool_calls)):
            return m
        calls = [dataclasses.replace(tc, arguments=a) for tc, a in zip(m.tool_calls, args)]
        return dataclasses.replace(m, content=content, reasoning=reasoning, tool_calls=calls)

    def _replace(self, m: re.Match, kind: str, counts: Counter | None) -> str:
        group = "s" if "s" in m.re.groupindex and m.group("s") is not None else 0
        secret = m.group(group)
        if PLACEHOLDER.fullmatch(secret):
            return m.group(0)
        if counts is not None:
            counts[kind] += 1
        start, end = m.start(group) - m.start(0), m.end(group) - m.start(0)
        whole = m.group(0)
        return whole[:start] + self.placeholder(kind, secret) + whole[end:]

    def scrub_obj(self, value: Any, counts: Counter | None = None) -> Any:
        """Strings anywhere inside dicts / lists scrubbed (provider extras, tool arguments)."""
        if isinstance(value, str):
            return self.scrub(value, counts)
        if isinstance(value, dict):
            return {k: self.scrub_obj(v, counts) for k, v in value.items()}
        if isinstance(value, list):
            return [self.scrub_obj(v, counts) for v in value]
        return value

    def scrub_request(self, req: Any, memo: "ScrubMemo | None" = None) -> tuple[Any, Scrubbed]:
        """A copy of a canonical ChatRequest with messages, tool calls and extras scrubbed.

        ``memo`` (one per session) holds the previous request's messages and their scrubbed copies: a
        harness resends its whole history every call, so only messages it has not sent before (the
        echoed turn, the new tool results) are scanned, and the cost stays flat as the session grows.
        """
        found = Scrubbed()
        if not self.enabled:
            return req, found
        messages = []
        seen = memo.messages if memo is not None else []
        for i, m in enumerate(req.messages):
            if i < len(seen) and seen[i][0] == m:
                _, clean, c = seen[i]
            else:
                c = Counter()
                clean = self._scrub_message(m, c)
            messages.append(clean)
            if c:
                found.per_message[i] = c
                found.counts.update(c)
        if memo is not None:
            memo.messages = [(m, clean, found.per_message.get(i, Counter())) for i, (m, clean) in
                             enumerate(zip(req.messages, messages))]
        extra_counts: Counter = Counter()
        extras = self.scrub_obj(req.extras, extra_counts)
        if extra_counts:
            found.per_message[-1] = extra_counts
            found.counts.update(extra_counts)
        if not found.counts:
            return req, found
        return dataclasses.replace(req, messages=messages, extras=extras), found

    def finish_record(self, record: Any, found: Scrubbed, prompt_ids: Sequence[int],
                      decode_one: Callable[[int], str]) -> Any:
        """Scrub the output text of a built CallRecorded, set ``redactions`` and ``scrubbed_spans``."""
        if not self.enabled:
            return record
        out_counts: Counter = Counter()
        o = record.output
        o.text, o.reasoning, o.parse_error = (self.scrub(o.text, out_counts), self.scrub(o.reasoning, out_counts),
                                              self.scrub(o.parse_error, out_counts))
        for tc in o.tool_calls:
            tc.arguments = self.scrub(tc.arguments, out_counts)
        record.error = self.scrub(record.error, out_counts)
        counts = Counter(found.since(int(record.request.get("messages_offset", 0))))
        counts.update({f"output.{k}": v for k, v in out_counts.items()})
        record.redactions = dict(counts)
        if found.counts:  # placeholders can only be in the prompt if this request had secrets
            record.scrubbed_spans = placeholder_spans(prompt_ids, decode_one)
        return record


def placeholder_spans(ids: Sequence[int], decode_one: Callable[[int], str]) -> list[list[int]]:
    """[start, end) token ranges of ``ids`` whose text overlaps a placeholder."""
    pieces = [decode_one(i) for i in ids]
    text = "".join(pieces)
    if "[REDACTED:" not in text:
        return []
    ends, pos = [], 0
    for p in pieces:
        pos += len(p)
        ends.append(pos)
    spans = []
    for m in PLACEHOLDER.finditer(text):
        first = bisect.bisect_right(ends, m.start())  # first token whose end lies past the match start
        last = bisect.bisect_left(ends, m.end())  # token holding the match's last character
        spans.append([first, last + 1])
    return spans


def token_decoder(tokenizer: Any) -> Callable[[int], str]:
    """A cached one-token decoder for ``tokenizer`` (placeholder search decodes many ids, few distinct)."""

    @lru_cache(maxsize=262_144)
    def decode_one(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    return decode_one


def scrub_session_event(event: Any, redactor: Redactor) -> Any:
    """A SessionEvent with its free-text ``detail`` (harness output tail, evaluator output) scrubbed."""
    detail = redactor.scrub(event.detail)
    return event if detail == event.detail else event.model_copy(update={"detail": detail})
