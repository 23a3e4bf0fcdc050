"""The viewer's pages and app in-process: rendering helpers, live counter, static files, the admin token."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from polarstream.viewer import pages
from polarstream.viewer.app import create_app, needs_token
from streams.synthetic import SessionSpec, record_group, record_session
from tests.viewer.test_index import indexed


def test_sparkline_scales_rewards_into_the_box_and_says_what_it_shows():
    svg = pages.sparkline([(float(t), float(t % 2)) for t in range(100)], width=200, height=40, buckets=10)
    points = [tuple(map(float, p.split(","))) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    assert len(points) == 10 and points[0][0] == 0.0 and points[-1][0] == pytest.approx(200.0)
    assert all(2.0 <= y <= 38.0 for _, y in points)
    assert "100 trajectories, 10 per point" in svg
    assert "no rewards yet" in pages.sparkline([])


def test_urls_quote_ids_so_any_id_is_one_path_segment():
    assert pages.url(1, "trace", 0, "a/b c") == "/r/1/trace/0/a%2Fb%20c"


def test_group_page_lists_samples_with_advantage_and_masked_members_with_why():
    html = pages.group_page(0, indexed(record_group("g", [1.0, 0.0, None], statuses=["ok", "ok", "infra_error"])), "g")
    assert re.search(r'class="adv pos">\+1\.000<', html) and re.search(r'class="adv neg">-1\.000<', html)
    assert re.search(r'<li class="masked"><a href="/r/0/session/g-s2">g-s2</a>: status infra_error', html)
    assert pages.group_page(0, indexed(record_group("g", [1.0])), "other") is None


def test_session_page_draws_a_lane_per_chain_and_marks_breaks_and_side_calls():
    idx = indexed([record_session(SessionSpec("s", "g", turns=4, side_call_at=1, compaction_at=3))], with_group=False)
    html = pages.session_page(0, idx, "s")
    assert html.count('class="lane-head"') == 3
    assert re.findall(r'class="lane on start( side)?" data-lane="(\d)"', html) == [("", "0"), (" side", "1"), ("", "2")]
    assert html.count('class="lane thru"') == 1  # lane 0 runs past the side call
    assert 'data-reason="compaction">new chain: compaction' in html and 'class="side-call">side call' in html


def test_trace_page_colours_context_and_sampled_and_shows_text_with_a_tokenizer():
    idx = indexed([record_session(SessionSpec("s", "g", turns=2))], with_group=False)
    html = pages.trace_page(0, idx, "s", 0, lambda i: f"w{i} ")
    assert len(re.findall(r'<span class="smp" data-call="\d">', html)) == 2
    assert re.search(r'<span class="tok" title="id (\d+) · logprob -?\d\.\d{4} · p [\d.]+">w\1 </span>', html)
    assert '<span class="ctx">w' in html
    assert pages.trace_page(0, idx, "s", 7, None) is None  # no such lane


def test_app_serves_pages_static_files_and_the_change_counter():
    idx = indexed(record_group("g", [1.0, 0.0]))
    client = TestClient(create_app([idx]))
    assert "g-s0" in client.get("/r/0/group/g").text
    assert client.get("/r/0/session/nope").status_code == 404 and client.get("/r/9/group/g").status_code == 404
    assert client.get("/seq").json() == {"seq": idx.seq} == client.get("/seq?run=0").json()
    css = client.get("/static/viewer.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css") and ".smp" in css.text
    assert "/seq" in client.get("/static/viewer.js").text
    assert client.get("/static/../app.py").status_code == 404


def test_off_loopback_every_page_needs_the_admin_token_and_a_link_token_becomes_a_cookie():
    assert not needs_token("127.0.0.1") and not needs_token("::1") and needs_token("0.0.0.0")
    client = TestClient(create_app([indexed(record_group("g", [1.0]))], admin_token="s3cret"))
    assert client.get("/").status_code == 401 and client.get("/seq").status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/", headers={"X-Admin-Token": "s3cret"}).status_code == 200
    r = client.get("/r/0/group/g?token=s3cret", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].endswith("/r/0/group/g")  # the token leaves the URL
    assert client.get("/r/0/group/g").status_code == 200  # the cookie carries it now


def test_run_section_shows_the_trainers_mismatch_per_policy_version():
    from polarstream.viewer.index import RunIndex
    from schemas import PolicyVersion

    run = RunIndex("p")
    for v, kl in ((1, 1e-6), (2, 3e-2)):
        run.policies[v] = PolicyVersion(model="m", version=v, checkpoint_url="file:///x", step=v, metrics={
            "entropy": 0.5, "reward_mean": 0.5, "mismatch_k3": kl, "mismatch_ratio_max": 7.5,
            "mismatch_ratio_p99": 1.9, "corrected_frac": 0.05})
    html = pages._run_section(0, run)
    assert "rollout/trainer mismatch, k3 KL per trained token (last 3.00e-02; ratio max 7.50, p99 1.900, corrected 5.0%)" in html
    assert "mismatch over time: 2 steps" in html
