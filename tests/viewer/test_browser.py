"""The viewer in a real headless Chromium (Debian's package) against a short real run (recorded_run).

Chromium's own command line, no driver: ``--dump-dom`` prints the DOM after the page's scripts ran for
``--virtual-time-budget`` ms (so the live poll has answered), and ``--screenshot`` in the same run saves
what it drew, in the test's output directory (``tmp_path/screens``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from polarstream.viewer.pages import url

CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed: `make system` installs it")]


def chromium(pages: dict[str, str], out: Path) -> dict[str, str]:
    """Per name, the DOM of its URL after the page's scripts ran; a 1280x900 screenshot of each is saved
    as ``out/<name>.png``. The browsers run side by side (each start costs more than its page)."""
    procs = {}
    for name, page in pages.items():
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={out / ('profile-' + name)}", "--virtual-time-budget=3000", "--dump-dom",
                f"--screenshot={out / (name + '.png')}", "--window-size=1280,900", page]
        procs[name] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dom = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=90)
        assert p.returncode == 0, stderr[-2000:]
        assert (out / f"{name}.png").stat().st_size > 10_000, f"{name}.png looks empty"
        dom[name] = stdout
    return dom


def test_run_group_session_and_trace_pages_in_chromium(recorded_run, tmp_path):
    run, gid, (s0, s1) = recorded_run, recorded_run.group_id, recorded_run.sessions.values()
    shots = tmp_path / "screens"
    shots.mkdir()
    pages = {"runs": "/", "group": url(0, "group", gid), "session": url(0, "session", s1),
             "trace": url(0, "trace", 0, s1)}
    dom = chromium({name: run.viewer_url + path for name, path in pages.items()}, shots)

    # runs: the prefix, its group, the reward sparkline, pass@k; the live poll answered (the badge is set by JS)
    assert run.settings.topic_prefix in dom["runs"] and f'href="{pages["group"]}"' in dom["runs"]
    assert '<svg class="spark"' in dom["runs"] and "<polyline" in dom["runs"] and "pass@1" in dom["runs"]
    assert re.search(r'<span id="live-state"[^>]*class="ok"[^>]*>● live</span>', dom["runs"]), "live poll never answered"

    # group: both samples with reward and advantage (sample 0 solved it: positive advantage)
    for sid in (s0, s1):
        assert f'href="{url(0, "session", sid)}"' in dom["group"]
    assert re.search(r'class="adv pos">\+\d', dom["group"]) and re.search(r'class="adv neg">-\d', dom["group"])

    # session 1: three lanes (main chain, title side call, the chain after the system prompt changed)
    session = dom["session"]
    assert session.count('class="lane-head"') == 3
    starts = re.findall(r'<td class="lane on start( side)?" data-lane="(\d)"', session)
    assert sorted(starts) == [("", "0"), ("", "2"), (" side", "1")]
    assert 'class="break" data-reason="system_changed">new chain: system_changed' in session
    assert 'class="side-call">side call' in session

    # trace of lane 0: context and sampled spans coloured apart, logprob on every sampled token
    trace = dom["trace"]
    assert len(re.findall(r'<span class="smp" data-call="\d+">', trace)) == 3  # one answer per call of the chain
    assert '<span class="ctx">' in trace
    tokens = re.findall(r'<span class="tok" title="id \d+ · logprob (-?\d+\.\d+) · p [\d.]+">', trace)
    assert tokens and all(float(lp) <= 0 for lp in tokens)
    assert "hello.txt" in trace  # rendered as text with the model's tokenizer, not as ids

