"""The verifier-fault classifier on outputs as apt, curl, uv, pip and pytest print them: a verifier that never
got to judge is named (with its lines), a genuine test failure stays the agent's 0."""

from __future__ import annotations

import pytest

from gateway.verifier_faults import classify, pytest_reported

# A TB 2.0 prelude on a container with no network: apt warns and goes on, the install fails, curl cannot
# resolve astral.sh, so uv never arrives.
APT_NO_DNS = """\
Ign:1 http://deb.debian.org/debian bookworm InRelease
Ign:2 http://deb.debian.org/debian bookworm-updates InRelease
Err:1 http://deb.debian.org/debian bookworm InRelease
  Temporary failure resolving 'deb.debian.org'
Reading package lists...
W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  Temporary failure resolving 'deb.debian.org'
W: Some index files failed to download. They have been ignored, or old ones used instead.
Reading package lists...
Building dependency tree...
E: Unable to locate package curl
/tests/test.sh: line 6: curl: command not found
/tests/test.sh: line 8: /root/.local/bin/env: No such file or directory
/tests/test.sh: line 10: uvx: command not found
"""

CURL_REFUSED = """\
curl: (7) Failed to connect to astral.sh port 443 after 3 ms: Couldn't connect to server
/tests/test.sh: line 10: uvx: command not found
"""

UV_NO_DNS = """\
downloading uv 0.9.5 x86_64-unknown-linux-gnu
installing to /root/.local/bin
  uv
  uvx
everything's installed!
error: Failed to fetch: `https://pypi.org/simple/pytest/`
  Caused by: Request failed after 3 retries
  Caused by: error sending request for url (https://pypi.org/simple/pytest/)
  Caused by: client error (Connect)
  Caused by: dns error: failed to lookup address information: Temporary failure in name resolution
"""

UV_NO_PYTHON = """\
everything's installed!
error: No interpreter found for Python 3.13 in managed installations or search path
"""

PIP_TLS = """\
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by 'SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate (_ssl.c:1006)'))': /simple/pytest/
Could not fetch URL https://pypi.org/simple/pytest/: There was a problem confirming the ssl certificate: HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded with url: /simple/pytest/ (Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate (_ssl.c:1006)'))) - skipping
ERROR: Could not find a version that satisfies the requirement pytest==8.4.1 (from versions: none)
ERROR: No matching distribution found for pytest==8.4.1
"""

PIP_UNREACHABLE = """\
WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f3c1b2e8d50>: Failed to establish a new connection: [Errno 101] Network is unreachable')': /simple/numpy/
ERROR: Could not find a version that satisfies the requirement numpy==2.1.2 (from versions: none)
ERROR: No matching distribution found for numpy==2.1.2
"""

CURL_AND_UV_TLS = """\
curl: (60) SSL certificate problem: unable to get local issuer certificate
More details here: https://curl.se/docs/sslcerts.html
error: Request failed after 3 retries
  Caused by: error sending request for url (https://pypi.org/simple/pytest/)
  Caused by: client error (Connect)
  Caused by: invalid peer certificate: UnknownIssuer
"""

APT_MISSING_PACKAGE = """\
Hit:1 http://deb.debian.org/debian bookworm InRelease
Reading package lists...
E: Unable to locate package python3.13-venv
E: Couldn't find any package by glob 'python3.13-venv'
"""

PYTEST_FAILED = """\
Hit:1 http://deb.debian.org/debian bookworm InRelease
curl is already the newest version (7.88.1-10+deb12u8).
Installed 6 packages in 9ms
============================= test session starts ==============================
platform linux -- Python 3.13.1, pytest-8.4.1, pluggy-1.6.0
rootdir: /tests
plugins: json-ctrf-0.3.5
collected 2 items

../tests/test_outputs.py F.                                              [100%]

=================================== FAILURES ===================================
________________________________ test_server ___________________________________
E   urllib.error.URLError: <urlopen error [Errno 111] Connection refused>
=========================== short test summary info ============================
FAILED ../tests/test_outputs.py::test_server - urllib.error.URLError: <urlopen error [Errno 111] Connection refused>
========================= 1 failed, 1 passed in 0.31s ==========================
"""


@pytest.mark.parametrize("log, cause, shows", [
    (APT_NO_DNS, "dns", "Temporary failure resolving 'deb.debian.org'"),
    (CURL_REFUSED, "network", "curl: (7) Failed to connect to astral.sh port 443"),
    (UV_NO_DNS, "dns", "dns error: failed to lookup address information"),
    (UV_NO_PYTHON, "interpreter", "No interpreter found for Python 3.13"),
    (PIP_TLS, "tls", "CERTIFICATE_VERIFY_FAILED"),
    (CURL_AND_UV_TLS, "tls", "invalid peer certificate: UnknownIssuer"),
    (PIP_UNREACHABLE, "network", "Network is unreachable"),
    (APT_MISSING_PACKAGE, "install", "E: Unable to locate package python3.13-venv"),
])
def test_each_cause_is_named_with_the_lines_that_show_it(log, cause, shows):
    fault = classify(log)
    assert fault is not None and fault.cause == cause
    assert any(shows in line for line in fault.evidence) and len(fault.evidence) <= 8
    assert shows in fault.summary() or cause in fault.summary()


def test_a_genuine_pytest_failure_stays_the_agents_zero_even_when_it_mentions_a_refused_connection():
    assert pytest_reported(PYTEST_FAILED)
    assert classify(PYTEST_FAILED) is None
    assert classify(APT_NO_DNS, reported=True) is None  # the tests left their ctrf report: they ran


def test_the_agents_own_server_refusing_is_not_a_fault_of_ours():
    log = "curl: (7) Failed to connect to localhost port 8080 after 0 ms: Connection refused\n"
    assert classify(log) is None
    assert classify(log.replace("localhost", "127.0.0.1")) is None


def test_a_verifier_that_timed_out_is_a_fault_unless_its_tests_were_running():
    stuck = classify("Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]\n", timed_out=True)
    assert stuck is not None and stuck.cause == "timeout" and "bookworm InRelease" in stuck.evidence[-1]
    running = PYTEST_FAILED.split("../tests/test_outputs.py F.")[0]
    assert classify(running, timed_out=True) is None  # the agent's code hung under the tests


def test_a_verifier_that_simply_exits_nonzero_with_no_known_cause_is_the_agents():
    assert classify("checking /app/out.txt\nexpected 42, got 41\n") is None
    assert classify("") is None


def test_a_line_that_only_looks_like_apt_is_not_an_install_failure():
    assert classify("E: expected 3 rows, got 2\n") is None  # a test script's own message
    fault = classify("E: Sub-process /usr/bin/dpkg returned an error code (1)\n")
    assert fault is not None and fault.cause == "install"
