"""Whether a verifier's 0 is the agent's, or the verifier never got to judge (pure; evaluators.py calls it).

A published Terminal-Bench 2.0 verifier installs its tools before it tests anything (``apt-get install
curl``, uv's installer, ``uvx -p 3.13 -w pytest==...``) and writes 0 whenever pytest does not pass, so a
network refusal, a DNS failure, a failed install, an untrusted TLS proxy or a missing interpreter all read
as a wrong answer. Trained on, such a 0 punishes the agent for the cluster. ``classify`` reads the
verifier's own output and names the fault, with the lines that show it.

The rule: if the tests ran and reported (pytest's summary line, or its ctrf report), the result is the
agent's, whatever else the log says (a test may well print "Connection refused" of a server the agent was
to start). Only when they did not, the first of these in order of root cause is the fault: ``tls``,
``dns``, ``network``, ``interpreter``, ``install``. Lines that speak of the container's own loopback are
the agent's business (its server), never evidence of ours. A verifier that ran past its time limit is a
fault (``timeout``) unless its tests had started: a hang in the agent's code is the agent's.
"""

from __future__ import annotations

import re

from schemas import VerifierFault

CAUSES = ("tls", "dns", "network", "interpreter", "install", "timeout")
MAX_EVIDENCE = 8  # lines kept with the session: enough to see the cause, small on the topic

_PATTERNS: dict[str, re.Pattern] = {k: re.compile(v, re.I) for k, v in {
    "tls": r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSL certificate problem|invalid peer certificate"
           r"|UnknownIssuer|self[- ]signed certificate in certificate chain|unable to get local issuer certificate",
    "dns": r"Temporary failure (in name )?resolv|Could not resolve host|Could not resolve '|Name or service not known"
           r"|failed to lookup address information|dns error|nodename nor servname|No address associated with hostname"
           r"|getaddrinfo (failed|ENOTFOUND)",
    "network": r"Network is unreachable|Connection refused|Failed to connect to|Connection timed out|No route to host"
               r"|Failed to establish a new connection|Could not connect to|Connection reset by peer|error sending request"
               r"|Max retries exceeded|operation timed out|tcp connect error|Unable to connect to",
    "interpreter": r"No interpreter found for Python|No Python at|No download found for request|python[0-9.]*: (command )?not found"
                   r"|(uv|uvx|pytest): (command )?not found|Failed to (find|discover) (a )?(suitable )?Python",
    "install": r"^E: (Failed to fetch|Unable to|Couldn't find|Package .* has no|Sub-process .* returned|Some packages could not)"
               r"|Unable to locate package|has no installation candidate|Unable to fetch some archives"
               r"|Some index files failed to download|Could not find a version that satisfies the requirement"
               r"|No matching distribution found|ERROR: Could not install packages|Failed to download"
               r"|error: Failed to fetch|Because .* was not found in the package registry|curl: \(\d+\)"
               r"|(curl|wget|git): (command )?not found",
}.items()}
_LOCAL = re.compile(r"\b(localhost|127\.\d+\.\d+\.\d+|\[?::1\]?|0\.0\.0\.0)\b", re.I)
# pytest's closing summary ("=== 2 failed, 3 passed in 0.41s ===", "no tests ran"): the tests ran and reported.
_PYTEST_RESULT = re.compile(r"^=+ .*\b(passed|failed|errors?|skipped|xfailed|xpassed|no tests ran)\b.* in [0-9.]+s.* =+$", re.M)
_PYTEST_STARTED = re.compile(r"^=+ test session starts =+$|^collected \d+ items?", re.M)


def pytest_reported(log: str) -> bool:
    """Whether pytest ran the tests and printed its summary line."""
    return bool(_PYTEST_RESULT.search(log))


def classify(log: str, *, timed_out: bool = False, reported: bool = False) -> VerifierFault | None:
    """The fault that kept the verifier from judging, or None when its result is the agent's.

    ``log``: the verifier's output; ``reported``: the tests left their own report (a ctrf.json); the
    caller asks only about a verifier that did not give full reward."""
    if reported or pytest_reported(log):
        return None
    if timed_out:
        if _PYTEST_STARTED.search(log):
            return None  # the tests were running: the agent's code hung
        tail = [ln.strip() for ln in log.splitlines() if ln.strip()][-3:]
        return VerifierFault(cause="timeout", evidence=tail)
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for cause, pattern in _PATTERNS.items():
        hits = [ln.strip() for ln in lines if pattern.search(ln) and not _LOCAL.search(ln)]
        if hits:
            return VerifierFault(cause=cause, evidence=_dedupe(hits)[:MAX_EVIDENCE])
    return None


def _dedupe(lines: list[str]) -> list[str]:
    seen: set[str] = set()
    return [ln for ln in lines if not (ln in seen or seen.add(ln))]
