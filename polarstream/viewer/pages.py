"""The viewer's pages as HTML strings: pure functions of an index (no I/O, no framework).

Every page is one ``<main id="live" data-seq=N>`` inside the shared layout; viewer.js polls the index's
``seq`` and swaps in a fresh ``<main>`` when it moved, so new calls and groups appear without a reload.
Classes the browser test and the stylesheet rely on: ``lane``/``lane on``/``lane start`` cells and
``break`` notes (``data-reason``) on the session page, ``ctx``/``smp``/``scrub`` spans on the trace page.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from html import escape
from urllib.parse import quote

from .index import PASS_KS, RunIndex, SessionView
from .lanes import SessionLanes, Span, chain_spans, session_lanes

Decode = Callable[[int], str]  # one token id -> its text (a tokenizer's), or None: ids are shown


def url(run: int, kind: str, *parts: object) -> str:
    """Link to a page of run number ``run`` (its position in ``--prefix``)."""
    return f"/r/{run}/{kind}/" + "/".join(quote(str(p), safe="") for p in parts)


def layout(title: str, body: str, seq: int, crumbs: Sequence[tuple[str, str]] = (), run: int | None = None) -> str:
    """A whole page: header with breadcrumbs, the live ``<main>``, the stylesheet and script."""
    nav = "".join(f' › <a href="{escape(href)}">{escape(text)}</a>' for text, href in crumbs)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · polarstream</title>'
            '<link rel="stylesheet" href="/static/viewer.css"></head><body>'
            f'<header><a href="/">polarstream</a>{nav}<span id="live-state" title="live updates"></span></header>'
            f'{main(body, seq, run)}<script src="/static/viewer.js"></script></body></html>')


def main(body: str, seq: int, run: int | None = None) -> str:
    """The part a live update replaces; ``data-run`` says whose change counter to poll (all runs: none)."""
    return f'<main id="live" data-seq="{seq}" data-run="{"" if run is None else run}">{body}</main>'


def _num(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _ago(t: float) -> str:
    s = max(0, int(time.time() - t))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def sparkline(points: Sequence[tuple[float, float]], width: int = 240, height: int = 40, buckets: int = 48,
              what: str = "reward", per_what: str = "trajectories", unit_range: bool = True) -> str:
    """Inline SVG of ``what`` over time: ``points`` (time, value) averaged into at most ``buckets``; the y
    axis spans [0, 1] (and any value outside it), or with ``unit_range`` False, 0 to the largest value."""
    if not points:
        return f'<svg class="spark" width="240" height="40"><text x="4" y="24">no {what}s yet</text></svg>'
    pts = sorted(points)
    per = max(1, -(-len(pts) // buckets))  # ceil: every bucket but the last holds ``per`` rewards
    means = [sum(r for _, r in pts[i:i + per]) / len(pts[i:i + per]) for i in range(0, len(pts), per)]
    lo, hi = (min(0.0, *means), max(1.0, *means)) if unit_range else (0.0, max(max(means), 1e-9))
    step = width / max(1, len(means) - 1)
    xy = " ".join(f"{i * step:.1f},{height - 2 - (m - lo) / (hi - lo) * (height - 4):.1f}" for i, m in enumerate(means))
    title = f"{what} over time: {len(pts)} {per_what}, {per} per point, last {means[-1]:.3g}"
    return (f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
            f'<title>{escape(title)}</title><polyline fill="none" points="{xy}"/></svg>')


# -- runs -----------------------------------------------------------------------------------------


def runs_page(runs: Sequence[RunIndex]) -> str:
    body = "".join(_run_section(i, r) for i, r in enumerate(runs))
    return layout("runs", body, sum(r.seq for r in runs))


def _run_section(i: int, run: RunIndex) -> str:
    with run.lock:
        calls = sum(len(s.calls) for s in run.sessions.values())
        state = (f'<span class="err">{escape(run.error)}</span>' if run.error
                 else "live" if run.caught_up else "reading the topics…")
        head = (f'<section class="run" id="run-{i}"><h2>run <code>{escape(run.prefix or "(no prefix)")}</code></h2>'
                f'<p class="meta">{state} · {len(run.sessions)} sessions · {calls} calls · {len(run.groups)} groups '
                f'emitted · policy v{max(run.policies, default=0)}'
                + (f" · {run.undecodable} undecodable" if run.undecodable else "") + "</p>")
        spark = (f'<div class="spark-box">{sparkline(run.rewards)} <span class="meta">reward over time, '
                 f'{len(run.rewards)} trajectories</span></div>')
        # the trainer's own view, per policy version: its step's mean reward beside the policy's entropy
        # (a policy that collapses to one answer shows as entropy near 0, often just before reward falls)
        steps = sorted((v, p.metrics) for v, p in run.policies.items() if "entropy" in p.metrics)
        if steps:
            spark += (f'<div class="spark-box">{sparkline([(v, m.get("reward_mean", 0.0)) for v, m in steps], what="step reward", per_what="steps")} '
                      f'{sparkline([(v, m["entropy"]) for v, m in steps], what="entropy", per_what="steps", unit_range=False)} '
                      f'<span class="meta">trainer, per policy version: step reward and policy entropy '
                      f'(last {steps[-1][1]["entropy"]:.4f})</span></div>')
        mism = [(v, m["mismatch_k3"]) for v, m in steps if "mismatch_k3" in m]
        if mism:  # how far the engines' policy is from the trained one (trainer/corrections.py)
            last = steps[-1][1]
            spark += (f'<div class="spark-box">{sparkline(mism, what="mismatch", per_what="steps", unit_range=False)} '
                      f'<span class="meta">rollout/trainer mismatch, k3 KL per trained token (last {mism[-1][1]:.2e}; '
                      f'ratio max {last.get("mismatch_ratio_max", 1.0):.2f}, p99 {last.get("mismatch_ratio_p99", 1.0):.3f}, '
                      f'corrected {last.get("corrected_frac", 0.0):.1%})</span></div>')
        return head + spark + _cells_table(run.cells()) + _groups_table(i, run) + "</section>"


def _cells_table(cells: list[dict]) -> str:
    if not cells:
        return '<p class="meta">no trajectories yet: reward and pass@k appear as groups finish</p>'
    ks = "".join(f"<th>pass@{k}</th>" for k in PASS_KS)
    rows = "".join(
        f'<tr><td>v{c["policy_version"]}</td><td>{escape(c["harness"])}</td><td>{escape(c["task_set"])}</td>'
        f'<td>{c["samples"]}</td><td>{_num(c["mean_reward"])}</td>'
        + "".join(f'<td>{_num(c.get(f"pass@{k}"))}</td>' for k in PASS_KS) + "</tr>"
        for c in cells)
    return (f'<table class="cells"><thead><tr><th>policy</th><th>harness</th><th>task set</th><th>samples</th>'
            f'<th>reward mean</th>{ks}</tr></thead><tbody>{rows}</tbody></table>')


def _groups_table(i: int, run: RunIndex, limit: int = 200) -> str:
    ids = run.group_ids()[::-1][:limit]  # newest first
    rows = []
    for gid in ids:
        g = run.groups.get(gid)
        sessions = run.group_sessions(gid)
        if g is not None:
            state, reward = "emitted", _num(g.reward_mean)
            samples = f"{len(g.trajectories)} + {len(g.masked)} masked" if g.masked else str(len(g.trajectories))
            versions = ", ".join(f"v{v}" for v in sorted(set(g.policy_versions))) or "-"
        else:
            done = sum(s.finished is not None for s in sessions)
            state, reward, samples, versions = "collecting", "-", f"{done}/{len(sessions)} finished", "-"
        task = g.task_id if g is not None else (sessions[0].task_id if sessions else "")
        rows.append(f'<tr class="{state}"><td><a href="{url(i, "group", gid)}">{escape(gid)}</a></td>'
                    f'<td>{escape(task)}</td><td>{state}</td><td>{samples}</td><td>{reward}</td><td>{versions}</td></tr>')
    more = f'<p class="meta">{len(run.group_ids()) - limit} older groups not shown</p>' if len(run.group_ids()) > limit else ""
    return ('<table class="groups"><thead><tr><th>group</th><th>task</th><th>state</th><th>samples</th>'
            f'<th>reward mean</th><th>policy</th></tr></thead><tbody>{"".join(rows)}</tbody></table>{more}')


# -- group ----------------------------------------------------------------------------------------


def group_page(i: int, run: RunIndex, group_id: str) -> str | None:
    with run.lock:
        g = run.groups.get(group_id)
        sessions = {s.session_id: s for s in run.group_sessions(group_id)}
        if g is None and not sessions:
            return None
        rows, in_group = [], set()
        for t, adv in zip(g.trajectories, g.advantages) if g is not None else ():
            in_group.add(t.session_id)
            rows.append(_member_row(i, t.session_id, t.sample_index, t.status, t.reward, adv, len(t.traces),
                                    int(t.stats.get("calls", 0)), sum(sum(tr.loss_mask) for tr in t.traces), t.harness))
        for sid, s in sessions.items():  # not (yet) in an emitted group: still running, or masked
            if sid in in_group or (g is not None and sid in g.masked):
                continue
            rows.append(_member_row(i, sid, s.sample_index, s.status, s.reward, None, None, len(s.calls), None, s.harness))
        masked = "".join(f'<li class="masked"><a href="{url(i, "session", sid)}">{escape(sid)}</a>: '
                         f'{escape(run.masked_reason(sid))}</li>' for sid in (g.masked if g is not None else []))
        if g is not None:
            meta = (f'emitted {_ago(g.created_at)} · baseline {g.baseline}{" / std" if g.std_normalized else ""} · '
                    f'reward mean {g.reward_mean:.3f} ± {g.reward_std:.3f}'
                    + (' · <span class="warn">zero variance: no signal</span>' if g.zero_variance else ""))
        else:
            meta = "collecting: the group is emitted once its samples finished"
        body = (f'<h1>group <code>{escape(group_id)}</code></h1><p class="meta">{meta}</p>'
                '<table class="members"><thead><tr><th>sample</th><th>session</th><th>status</th><th>reward</th>'
                '<th>advantage</th><th>traces</th><th>calls</th><th>sampled tokens</th><th>harness</th></tr></thead>'
                f'<tbody>{"".join(rows)}</tbody></table>'
                + (f'<h2>masked members</h2><ul class="masked-list">{masked}</ul>' if masked else ""))
        return layout(f"group {group_id}", body, run.seq, [(f"run {run.prefix or '(no prefix)'}", f"/#run-{i}")], i)


def _member_row(i: int, sid: str, sample: int, status: str, reward: float | None, adv: float | None,
                traces: int | None, calls: int, sampled: int | None, harness: str) -> str:
    sign = "" if adv is None else "pos" if adv > 0 else "neg" if adv < 0 else "zero"
    return (f'<tr><td>{sample}</td><td><a href="{url(i, "session", sid)}">{escape(sid)}</a></td>'
            f'<td class="status {escape(status)}">{escape(status)}</td><td>{_num(reward)}</td>'
            f'<td class="adv {sign}">{_num(adv, "+.3f")}</td><td>{"-" if traces is None else traces}</td><td>{calls}</td>'
            f'<td>{"-" if sampled is None else sampled}</td><td>{escape(harness)}</td></tr>')


# -- session --------------------------------------------------------------------------------------


def session_page(i: int, run: RunIndex, session_id: str) -> str | None:
    with run.lock:
        s = run.sessions.get(session_id)
        if s is None:
            return None
        lanes = session_lanes(s.calls.values())
        body = _session_head(i, s) + _lanes_table(i, s, lanes) + _lane_list(i, s, lanes) + _events(s)
        crumbs = [(f"run {run.prefix or '(no prefix)'}", f"/#run-{i}")]
        if s.group_id:
            crumbs.append((f"group {s.group_id}", url(i, "group", s.group_id)))
        return layout(f"session {session_id}", body, run.seq, crumbs, i)


def _session_head(i: int, s: SessionView) -> str:
    return (f'<h1>session <code>{escape(s.session_id)}</code></h1><p class="meta">sample {s.sample_index} · '
            f'harness {escape(s.harness or "?")} · status <span class="status {escape(s.status)}">{escape(s.status)}</span>'
            f' · reward {_num(s.reward)} · {len(s.calls)} calls</p>')


def _lanes_table(i: int, s: SessionView, lanes: SessionLanes) -> str:
    n = len(lanes.chains)
    span: dict[int, tuple[int, int]] = {}  # lane -> (first, last) call_index: where its line is drawn
    for r in lanes.rows:
        if r.lane is not None:
            a, _ = span.get(r.lane, (r.call.call_index, 0))
            span[r.lane] = (a, r.call.call_index)
    heads = "".join(f'<th class="lane-head"><a href="{url(i, "trace", k, s.session_id)}" title="lane {k}: its '
                    f'trace">{k}</a></th>' for k in range(n))
    rows = []
    for r in lanes.rows:
        c = r.call
        cells = []
        for k in range(n):
            if r.lane == k:
                kind = " side" if lanes.chains[k].side_call else ""
                start = " start" if r.starts_lane else ""
                cells.append(f'<td class="lane on{start}{kind}" data-lane="{k}" style="{_hue(k)}" title="lane {k}">●</td>')
            elif k in span and span[k][0] < c.call_index < span[k][1]:
                cells.append(f'<td class="lane thru" data-lane="{k}" style="{_hue(k)}">│</td>')
            else:
                cells.append('<td class="lane"></td>')
        rows.append(f'<tr class="call{" side" if c.side_call else ""}{" error" if c.error else ""}" id="call-{c.call_index}">'
                    f'<td>{c.call_index}</td>{"".join(cells)}<td>{escape(c.provider)}</td><td>{escape(c.harness)}</td>'
                    f'<td>{escape(c.model)}</td><td>v{c.policy_version}</td>'
                    f'<td title="upstream {c.timings.upstream_ms:.0f} ms">{c.timings.total_ms:.0f}</td>'
                    f'<td>{c.usage.prompt_tokens} → {c.usage.completion_tokens}</td><td>{escape(c.finish_reason)}</td>'
                    f'<td>{_note(r.note, r.starts_lane, c.side_call, c.error)}</td></tr>')
    return ('<table class="lanes"><thead><tr><th>call</th>' + heads + '<th>provider</th><th>harness</th><th>model</th>'
            '<th>policy</th><th>latency ms</th><th>tokens</th><th>finish</th><th>note</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _hue(lane: int) -> str:
    return f"color:hsl({lane * 67 % 360},65%,38%)"  # neighbouring lanes far apart on the colour wheel


def _note(note: str, starts: bool, side: bool, error: str) -> str:
    out = []
    if side:
        out.append('<span class="side-call">side call</span>')
    if starts and note and note != "side_call":
        out.append(f'<span class="break" data-reason="{escape(note)}">new chain: {escape(note)}</span>')
    elif note and not starts:
        out.append(f'<span class="dropped" data-reason="{escape(note)}">{escape(note)}</span>')
    if error:
        out.append(f'<span class="err" title="{escape(error)}">{escape(error[:80])}</span>')
    return " ".join(out)


def _lane_list(i: int, s: SessionView, lanes: SessionLanes) -> str:
    items = "".join(
        f'<li><a href="{url(i, "trace", k, s.session_id)}">lane {k}</a>: {len(c.members)} calls, {len(c.tokens)} tokens, '
        f'started by <span class="break" data-reason="{escape(c.break_reason)}">{escape(c.break_reason)}</span>'
        f'{" (side call)" if c.side_call else ""}</li>' for k, c in enumerate(lanes.chains))
    breaks = ", ".join(lanes.breaks) or "none"
    return f'<h2>lanes</h2><p class="meta">chain breaks: {escape(breaks)}</p><ul class="lane-list">{items}</ul>'


def _events(s: SessionView) -> str:
    rows = "".join(f'<tr><td>{escape(e.kind)}</td><td>{escape(e.status or "")}</td><td>{_num(e.reward)}</td>'
                   f'<td>{escape(e.detail[:200])}</td></tr>' for e in s.events)
    return ('<h2>events</h2><table class="events"><thead><tr><th>kind</th><th>status</th><th>reward</th><th>detail</th>'
            f'</tr></thead><tbody>{rows}</tbody></table>') if rows else ""


# -- trace ----------------------------------------------------------------------------------------


def trace_page(i: int, run: RunIndex, session_id: str, lane: int, decode: Decode | None) -> str | None:
    with run.lock:
        s = run.sessions.get(session_id)
        if s is None:
            return None
        lanes = session_lanes(s.calls.values())
        if not 0 <= lane < len(lanes.chains):
            return None
        chain = lanes.chains[lane]
        spans = chain_spans(chain, s.calls)
        sampled = sum(len(sp.ids) for sp in spans if sp.sampled)
        meta = (f'lane {lane} of {len(lanes.chains)} · started by <span class="break" data-reason="'
                f'{escape(chain.break_reason)}">{escape(chain.break_reason)}</span> · calls '
                f'{", ".join(str(m.call_index) for m in chain.members)} · {len(chain.tokens)} tokens, {sampled} sampled'
                + ("" if decode else " · no tokenizer (--model): token ids shown"))
        legend = ('<p class="legend"><span class="ctx">context (mask 0)</span> <span class="smp">sampled (mask 1, '
                  'hover for logprob)</span> <span class="ctx scrub">scrubbed credential</span></p>')
        text = "".join(_span_html(sp, decode) for sp in spans)
        body = f'<h1>trace <code>{escape(session_id)}</code> / {lane}</h1><p class="meta">{meta}</p>{legend}<pre class="trace">{text}</pre>'
        crumbs = [(f"run {run.prefix or '(no prefix)'}", f"/#run-{i}"), (f"session {session_id}", url(i, "session", session_id))]
        return layout(f"trace {session_id}/{lane}", body, run.seq, crumbs, i)


def _token_text(tid: int, decode: Decode | None) -> str:
    return decode(tid) if decode else f"⟨{tid}⟩"


def _span_html(sp: Span, decode: Decode | None) -> str:
    if not sp.sampled:
        cls = "ctx scrub" if sp.scrubbed else "ctx"
        title = ' title="credential placeholder (scrubbed)"' if sp.scrubbed else ""
        return f'<span class="{cls}"{title}>{escape("".join(_token_text(t, decode) for t in sp.ids))}</span>'
    toks = "".join(f'<span class="tok" title="id {t} · logprob {lp:.4f} · p {_p(lp)}">{escape(_token_text(t, decode))}</span>'
                   for t, lp in zip(sp.ids, sp.logprobs))
    return f'<span class="smp" data-call="{sp.call_index}">{toks}</span>'


def _p(logprob: float) -> str:
    return f"{math.exp(logprob):.3f}"


def not_found(what: str) -> str:
    return layout("not found", f"<h1>not found</h1><p>{escape(what)} (it may not have been read yet)</p>", 0)
