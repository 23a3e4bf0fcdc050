"""Turn a bench/run_all.py results object into comparisons, the results section of docs/benchmarks.md,
and every figure between ``<!-- bench:NAME:KEY -->`` markers in README.md and docs/*.md.

Everything on the page is computed from the results JSON alone, so page and JSON cannot disagree.
A script's own top-level ``comparisons`` list is used as is (after a shape check); a script without
one gets rows derived from its known JSON layout by DERIVERS, keyed by benchmark name. Every number
a script printed is also rendered: sibling dicts of scalars become one matrix table, the rest a
key/value table. Interleaved-rounds blocks (bench/_rounds.py) get a table of their own (min, median,
spread, CPU/wall, flagged passes) instead of one row per pass.

Marked figures in prose (MARKER): ``<!-- bench:NAME:KEY -->...<!-- /bench -->``, where NAME is a
benchmark and KEY either a ``/``-separated path into its JSON (keys may hold dots) or one of
``comparisons`` (its ours-vs-anchor tables), ``rounds`` (its interleaved-rounds tables) and
``provenance`` (the commit it measured and what changed since). Tables end with the provenance line.
Whatever is between the markers is replaced on every render, so a figure typed there by hand is lost.

A benchmark too long for ``make bench`` keeps its own results file (OWN_RESULTS), with the provenance it
recorded: its markers render from that file as latest.json's do from latest.json, through its script's
``markdown(result, key)`` for its tables (``bench/offpolicy.py``: ``summary``, ``table``).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from bench._provenance import changed_for, entry_provenance

START = "<!-- bench:results:start -->"
END = "<!-- bench:results:end -->"
# START and END have a marker's shape: never one, or a figure marked after the results section would swallow it.
MARKER = re.compile(r"<!-- bench:(?!results:(?:start|end) -->)([\w-]+):([^ >]+) -->(.*?)<!-- /bench -->", re.S)
# Benchmarks that are simulations even when their JSON predates the "kind" field (results recorded earlier).
DEFAULT_KINDS = {"rollout": "simulation"}
# Benchmarks run by hand, outside make bench and latest.json (bench/offpolicy.py: 20-40 minutes of 2 cores):
# NAME -> its results file, which holds the runs and a ``provenance`` object (bench/_provenance.py's keys).
OWN_RESULTS = {"offpolicy": "bench/results/offpolicy.json",
               "judge_agreement": "bench/results/judge_agreement.json"}  # issue 77: SmolLM2 as a judge, 15-25 min
FIELDS = ("area", "metric", "ours", "anchor", "anchor_name", "unit", "higher_is_better", "note")
Path_ = tuple[str, ...]


# ------------------------------------------------------------------------------------ numbers


def is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fmt(x: object) -> str:
    """A cell: numbers to 3-4 significant digits (the JSON keeps full precision), text escaped."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        a = abs(x)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{x:,.0f}"
        if a >= 100:
            return f"{x:.1f}"
        if a >= 1:
            return f"{x:.2f}"
        return f"{x:#.3g}"  # '#' keeps trailing zeros: 0.0500, not 0.05, shows the precision
    if isinstance(x, list):
        return "[" + ", ".join(fmt(v) for v in x) + "]" if all(not isinstance(v, (dict, list)) for v in x) else f"{len(x)} items"
    text = str(x).replace("\n", " ").replace("|", "\\|")
    return text if len(text) <= 160 else text[:157] + "..."


# ------------------------------------------------------------------------------------ comparisons


def comparison(area: str, metric: str, ours: object, anchor: object, anchor_name: str, unit: str = "",
               higher_is_better: bool | None = True, note: str = "") -> dict | None:
    """One row beside its anchor, or None when either number is absent (a skipped peer, a failed run)."""
    if not (is_number(ours) and is_number(anchor)):
        return None
    row = {"area": area, "metric": metric, "ours": ours, "anchor": anchor, "anchor_name": anchor_name,
           "unit": unit, "higher_is_better": higher_is_better, "note": note}
    row["ratio"] = round(ours / anchor, 4) if anchor else None
    row["verdict"] = verdict(ours, anchor, higher_is_better)
    return row


def verdict(ours: float, anchor: float, higher_is_better: bool | None) -> str:
    """Who wins and by what factor; for numbers that should match, how far apart they are."""
    if higher_is_better is None:
        return "equal" if ours == anchor else f"differ by {abs(ours - anchor):.2g}"
    if ours == anchor:
        return "equal"
    if ours <= 0 or anchor <= 0:  # no meaningful factor (no padding at all vs some), only a winner
        return "ours better" if (ours > anchor) == bool(higher_is_better) else "anchor better"
    factor = ours / anchor if higher_is_better else anchor / ours
    return f"ours {factor:.2f}× better" if factor >= 1 else f"anchor {1 / factor:.2f}× better"


def comparisons_for(name: str, result: dict) -> tuple[list[dict], list[str]]:
    """The comparison rows of one benchmark's JSON, and the problems found in what it provided.

    A result whose ``kind`` is not a measurement (``"simulation"``) has it written into every row's area,
    so no table shows a simulated ratio as if it were measured."""
    rows, problems = _comparisons_for(name, result)
    kind = (result.get("kind") if isinstance(result, dict) else None) or DEFAULT_KINDS.get(name)
    if kind and kind != "measurement":
        rows = [dict(r, area=f"{r['area']} [{kind}]") if f"[{kind}]" not in r["area"] else r for r in rows]
    return rows, problems


def _comparisons_for(name: str, result: dict) -> tuple[list[dict], list[str]]:
    given = result.get("comparisons")
    if given is None:
        derive = DERIVERS.get(name)
        try:
            rows = list(derive(result)) if derive else []
        except Exception as e:  # a layout the deriver did not foresee: numbers still render, rows do not
            return [], [f"deriving comparisons from bench/{name}.py's JSON failed: {type(e).__name__}: {e}"]
        return [dict(r, source="derived") for r in rows if r is not None], []
    if not isinstance(given, list):
        return [], [f"comparisons: expected a list, got {type(given).__name__}"]
    rows, problems = [], []
    for i, c in enumerate(given):
        if not isinstance(c, dict) or not {"area", "metric", "ours", "anchor"} <= c.keys():
            problems.append(f"comparisons[{i}]: needs area, metric, ours and anchor")
            continue
        unknown = set(c) - set(FIELDS)
        text = {k: str(c.get(k) or "") for k in ("area", "metric", "anchor_name", "unit", "note")}
        hib = c.get("higher_is_better", True)
        row = comparison(ours=c["ours"], anchor=c["anchor"], higher_is_better=None if hib is None else bool(hib), **text)
        if row is None:
            problems.append(f"comparisons[{i}]: ours and anchor must be numbers")
            continue
        if unknown:
            problems.append(f"comparisons[{i}]: ignored fields {sorted(unknown)}")
        rows.append(dict(row, source="script"))
    return rows, problems


def dig(d: object, *keys: str) -> object:
    """d[k1][k2]... or None where any step is missing."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


GATEWAY_NOTE = "ours records every call durably in Kafka (acks=all) before answering"
# bench/gateway.py's 1-client scenarios: (result key, area title)
GATEWAY_SCENARIOS = (("extend_80kb", "Gateway: an 80 KB call that extends its session, 1 client"),
                     ("fresh_80kb", "Gateway: a session's first 80 KB call, system prompt + tools seen before, 1 client"))


def _ours(name: str) -> bool:
    """One of our targets: ``polarstream.<mode>`` or ``polarstream_2proc.<mode>`` (the session router)."""
    return name.split(".", 1)[0].startswith("polarstream")


def _gateway(r: dict) -> Iterator[dict | None]:
    """Ours beside each anchor in the anchor's own mode (``chat_json`` beside ``chat_json``): a peer measured
    non-streaming is compared with our non-streaming numbers, and the row says which mode it was. Then the
    80 KB scenarios against the engine and the peers, and 2 gateway processes against 1."""
    every = r.get("results") or {}
    res = {n: v for n, v in every.items() if "@" not in n.split(".", 1)[0]}  # the vLLM-like targets: below
    metrics = [("p50 latency, 1 client", ("1", "p50_ms"), "ms", False), ("p99 latency, 1 client", ("1", "p99_ms"), "ms", False),
               *((f"calls/s, {c} client{'s' if c != '1' else ''}", (c, "calls_per_s"), "calls/s", True) for c in ("1", "16", "64"))]
    anchors = [a for a in res if not _ours(a)]
    for anchor in anchors:
        direct = anchor.startswith("direct")
        area = "Gateway: polarstream vs the engine called directly" if direct else "Gateway: polarstream vs peer gateways"
        mode = anchor.split(".", 1)[1] if "." in anchor else "chat_stream"
        same = f"polarstream.{mode}"
        ours_names = [n for n in res if n.startswith("polarstream.")] if direct else [same if same in res else "polarstream.chat_stream"]
        for ours in ours_names:
            ours_mode = ours.split(".", 1)[1]
            label = ours_mode if ours_mode == mode else f"ours {ours_mode}, anchor {mode}"
            for text, path, unit, hib in metrics:
                yield comparison(area, f"{text} ({label})", dig(res, ours, *path), dig(res, anchor, *path),
                                 anchor, unit, hib, GATEWAY_NOTE)
    for key, area in GATEWAY_SCENARIOS:
        for anchor in anchors:
            for ours in (n for n in res if _ours(n) and dig(res, n, key)):
                for q in ("p50", "p99"):
                    yield comparison(area, f"{q} latency ({ours})", dig(res, ours, key, f"{q}_ms"),
                                     dig(res, anchor, key, f"{q}_ms"), anchor, "ms", False, GATEWAY_NOTE)
    peer = "rllm-model-gateway.chat_stream"
    bars = "Gateway bars vs rllm-model-gateway (issue 47), same stub, chat_stream, same rounds"
    yield comparison(bars, "gateway process CPU ms per proxied call, 16 clients (bar: ≤ 1.5× the peer)",
                     r.get("gateway_cpu_ms_per_call"), r.get("peer_cpu_ms_per_call"), peer, "ms", False, GATEWAY_NOTE)
    yield comparison(bars, "p50 added ms on the 80 KB extending call, ours less the publish's ack wait (bar: ≤ 1.5×)",
                     r.get("gateway_added_p50_less_ack_ms"), r.get("peer_added_p50_ms"), peer, "ms", False,
                     "the ack wait, measured as the gateway's publish stage, is reported beside it: gateway_publish_ack_ms_mean")
    like = "Gateway vs rllm-model-gateway in front of a vLLM-like stub (it tokenizes Chat prompts, as vLLM does), end to end"
    why = "the peer forwards text, so the engine renders and tokenizes all 80 KB of every call; ours sends token ids"
    peer_like = "rllm-model-gateway@vllm_like.chat_stream"
    yield comparison(like, "p50 latency of the 80 KB extending call, 1 client", r.get("vllm_like_gateway_p50_ms_80kb"),
                     r.get("vllm_like_peer_p50_ms_80kb"), peer_like, "ms", False, why)
    for c in ("16", "64"):
        yield comparison(like, f"calls/s, {c} clients", dig(every, "polarstream@vllm_like.chat_stream", c, "calls_per_s"),
                         dig(every, peer_like, c, "calls_per_s"), peer_like, "calls/s", True, why)
    one, two = "polarstream.chat_stream", "polarstream_2proc.chat_stream"
    for text, path, unit, hib in metrics:
        yield comparison("Gateway: 2 processes behind the session router vs 1 (chat_stream)", text,
                         dig(res, two, *path), dig(res, one, *path), one, unit, hib, "every call of a session reaches one process")


def _streams(r: dict) -> Iterator[dict | None]:
    area, anchor = "Trajectories: prefix_merging vs per_request (same sessions)", "per_request"
    b = r.get("builders") or {}
    yield comparison(area, "sequences to train", dig(b, "prefix_merging", "sequences"), dig(b, "per_request", "sequences"),
                     anchor, "sequences", False)
    yield comparison(area, "tokens the trainer processes", dig(b, "prefix_merging", "trainer_tokens"),
                     dig(b, "per_request", "trainer_tokens"), anchor, "tokens", False)
    yield comparison(area, "trainable (sampled) tokens", dig(b, "prefix_merging", "trainable_tokens"),
                     dig(b, "per_request", "trainable_tokens"), anchor, "tokens", None, "must be equal: same samples")
    yield comparison(area, "assembly speed (fold + build + verify)", dig(r, "assembly", "prefix_merging", "calls_per_s"),
                     dig(r, "assembly", "per_request", "calls_per_s"), anchor, "calls/s", True)
    area = "Kafka bytes per session: packed records vs JSON (same sessions, every topic, as stored)"
    for turns, row in (r.get("bytes") or {}).items():
        yield comparison(area, f"{turns} turns", row.get("kafka_bytes_per_session"), row.get("kafka_bytes_per_session_json"),
                         "json", "bytes", False, "zstd on the broker takes most of the difference")


def _trainer(r: dict) -> Iterator[dict | None]:
    pm, pr, pad = r.get("prefix_merging_packed"), r.get("per_request_packed"), r.get("prefix_merging_padded")
    area = "Training: prefix_merging vs per_request (packed micro-batches)"
    for metric, key, unit, hib in (("wall time for one pass", "total_s", "s", False), ("CPU time for one pass", "cpu_s", "s", False),
                                   ("tokens fed to the model", "tokens_fed", "tokens", False),
                                   ("sequences", "sequences", "sequences", False), ("trained (sampled) tokens", "trained_tokens", "tokens", None)):
        yield comparison(area, metric, dig(pm, key), dig(pr, key), "per_request", unit, hib)
    area = "Training: packed vs padded micro-batches (prefix_merging data)"
    for metric, key, unit in (("wall time for one pass", "total_s", "s"), ("CPU time for one pass", "cpu_s", "s"),
                              ("tokens fed to the model", "tokens_fed", "tokens"), ("padding fraction", "padding_frac", "")):
        yield comparison(area, metric, dig(pm, key), dig(pad, key), "padded", unit, False)
    t = r.get("trl") or {}
    name = f"TRL {t.get('trl_trl_version') or t.get('trl_version') or ''} GRPOTrainer".replace("  ", " ")
    area = "Training: our GRPO step vs TRL's on the same samples"
    for ours_norm, trl_loss in (("token_mean", "bnpo"), ("seq_mean", "grpo")):
        yield comparison(area, f"step time ({ours_norm} / loss_type={trl_loss})", t.get(f"ours_step_s_{ours_norm}"),
                         t.get(f"trl_step_s_{trl_loss}"), name, "s", False)
        yield comparison(area, f"loss value ({ours_norm} / loss_type={trl_loss})", t.get(f"ours_loss_{ours_norm}"),
                         t.get(f"trl_loss_{trl_loss}"), name, "", None, "must agree: same model, data and clip range")


def _publisher(r: dict) -> Iterator[dict | None]:
    """The batch API beside one publish per event (unbounded), and a lone publish's latency beside the same wait
    through a thread-safe future woken once per event (``wrap_future``, the async path before batched wakeups)."""
    for item in r.get("results") or []:
        kb = f"{item.get('size_bytes', 0) // 1024} KB"
        u = item.get("unbounded") or {}
        yield comparison("Publisher: publish_many vs one publish per event (all in flight, acks=all)", f"events/s, {kb} (median)",
                         dig(u, "publish_many", "events_per_s", "median"), dig(u, "publish", "events_per_s", "median"),
                         "publish per event", "events/s", True)
        yield comparison("Publisher: zstd level 1 (the default) vs no compression and lz4, publish_many, all in flight",
                         f"events/s, {kb} (median)",
                         dig(u, "publish_many", "events_per_s", "median"), dig(u, "publish_many_uncompressed", "events_per_s", "median"),
                         "compression.type=none", "events/s", True, "compression costs CPU in librdkafka's threads and the broker")
        yield comparison("Publisher: zstd level 1 (the default) vs no compression and lz4, publish_many, all in flight",
                         f"events/s, {kb} (median)",
                         dig(u, "publish_many", "events_per_s", "median"), dig(u, "publish_many_lz4", "events_per_s", "median"),
                         "compression.type=lz4", "events/s", True, "events of random ids: what zstd saves is bytes, not events/s")
        yield comparison("Publisher vs Kafka's own kafka-producer-perf-test (same broker and topic, compression off, same rounds)",
                         f"events/s, {kb} (median)", dig(u, "publish_many_uncompressed", "events_per_s", "median"),
                         dig(item, "kafka_perf_test", "events_per_s", "median"), "kafka-producer-perf-test", "events/s", True,
                         "the perf tool sends 3x the records per pass, in a JVM started for it (its JIT warms on the way)")
        s = item.get("sequential") or {}
        for q in ("p50", "p99"):
            yield comparison("Publisher: one publish awaited at a time, batched wakeups vs one wakeup per event",
                             f"{q} latency, {kb} (median of rounds)", s.get(f"latency_{q}_ms"), s.get(f"wrap_future_latency_{q}_ms"),
                             "wrap_future", "ms", False, "wrap_future: a thread-safe future resolved on the poll thread")


DERIVERS: dict[str, Callable[[dict], Iterator[dict | None]]] = {
    "gateway": _gateway, "streams": _streams, "trainer": _trainer, "publisher": _publisher,
}


# ------------------------------------------------------------------------------------ all numbers


def flatten(obj: object, path: Path_ = ()) -> Iterator[tuple[Path_, object]]:
    """(path, leaf) pairs; a list of dicts is labelled by its items' first field (``size_bytes=4096``)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not path and k == "comparisons":
                continue  # rendered as the ours-vs-anchor tables
            if k in ("passes", "metrics") and "wall_s" in obj and "flagged" in obj:
                continue  # an interleaved target's passes and last pass: summarised in its rounds table, kept in the JSON
            yield from flatten(v, (*path, str(k)))
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, (*path, _item_label(obj, i)))
    else:
        yield path, obj


def _item_label(items: list[dict], i: int) -> str:
    first = next(iter(items[i]), None)
    values = [d.get(first) for d in items]
    if first is not None and all(isinstance(v, (str, int)) for v in values) and len(set(values)) == len(values):
        return f"{first}={items[i][first]}"
    return str(i)


def number_tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) tables covering every leaf of ``result`` exactly once."""
    records: dict[Path_, dict[str, object]] = {}
    for path, value in flatten(result):
        records.setdefault(path[:-1], {})[path[-1]] = value
    # Siblings with the same fields (batch_1, batch_8, batch_32) read best as one matrix.
    siblings: dict[tuple, list[Path_]] = {}
    for rec, fields in records.items():
        if rec:
            siblings.setdefault((rec[:-1], tuple(fields)), []).append(rec)
    matrices = [(parent, fields, recs) for (parent, fields), recs in siblings.items() if len(recs) >= 2]
    in_matrix = {rec for _, _, recs in matrices for rec in recs}
    kv = [[fmt(".".join((*rec, k))), fmt(v)] for rec, fields in records.items() if rec not in in_matrix for k, v in fields.items()]
    tables = [("", ["key", "value"], kv)] if kv else []
    for parent, fields, recs in matrices:
        tables.append((".".join(parent), ["", *map(fmt, fields)], [[fmt(rec[-1]), *(fmt(records[rec][f]) for f in fields)]
                                                                 for rec in recs]))
    return tables


# ------------------------------------------------------------------------------------ markdown


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def provenance(run: dict, stale: dict | None, name: str) -> str:
    """'measured at <commit>; changed since: <its inputs that changed, or nothing>' for one benchmark's
    figures, with a dirty tree said loudly. ``stale``: benchmark name -> ``_provenance.changed_for``."""
    entry = (run.get("benchmarks") or {}).get(name) or {}
    prov = entry_provenance(entry, run)
    where = f"{name}: measured at `{prov.get('git_commit') or '?'}`"
    if prov.get("git_dirty"):
        where += " **(dirty: uncommitted changes)**"
    date = prov.get("date") or run.get("machine", {}).get("date", "?")
    where += f" ({entry.get('mode') or run.get('mode', '?')} run, {str(date)[:10]})"
    mine = (stale or {}).get(name)
    if mine is None:
        return f"_{where}._"
    if not mine.get("known"):
        return f"_{where}; changed since: unknown (commit not in this repository)._"
    changed = ", ".join(f"`{p}`" for p in mine.get("packages", [])) or "nothing"
    return f"_{where}; changed since: {changed}._"


def rounds_blocks(result: object, path: Path_ = ()) -> Iterator[tuple[str, dict]]:
    """Every interleaved-rounds block (bench/_rounds.interleaved's return) in a result, with its path."""
    if isinstance(result, dict):
        if isinstance(result.get("targets"), dict) and "order" in result:
            yield ".".join(path), result
            return
        for k, v in result.items():
            yield from rounds_blocks(v, (*path, str(k)))


def rounds_table(title: str, block: dict) -> str:
    la = block.get("load_avg") or {}
    head = (f"`{title or 'rounds'}`: {fmt(block.get('rounds'))} interleaved rounds ({' '.join(map(str, block.get('order', [])))}), "
            f"threads {fmt(block.get('threads'))}, CPU/wall floor {fmt(block.get('cpu_floor'))}, "
            f"load average {fmt(la.get('before'))} → {fmt(la.get('after'))}\n\n")
    rows = []
    for name, t in block["targets"].items():
        w, c = t.get("wall_s") or {}, t.get("cpu_per_wall") or {}
        rows.append([fmt(name), fmt(w.get("n")), fmt(w.get("min")), fmt(w.get("median")), fmt(w.get("max")), fmt(w.get("spread")),
                     fmt(c.get("median")), fmt(c.get("min")), fmt(t.get("flagged")), fmt(t.get("reruns"))])
    return head + table(["target", "passes", "wall s min", "median", "max", "spread (max/min)", "CPU/wall median",
                         "CPU/wall min", "flagged", "re-runs"], rows)


def rows_of(name: str, entry: dict) -> list[dict]:
    """An entry's comparison rows, derived again from its result: labelling fixes (a peer's mode, a
    simulation) then reach results recorded before them; an entry without a result keeps its stored rows."""
    if isinstance(entry.get("result"), dict):
        return comparisons_for(name, entry["result"])[0]
    return entry.get("comparisons", [])


def kind(entry: dict, name: str = "") -> str:
    """What a benchmark's numbers are: a measurement unless its JSON (or DEFAULT_KINDS) says otherwise."""
    return str((entry.get("result") or {}).get("kind") or DEFAULT_KINDS.get(name) or "measurement")


def render(run: dict, stale: dict | None = None) -> str:
    """The generated results section (between the START and END markers); ``stale`` from bench/_provenance."""
    m, out = run.get("machine", {}), [START, ""]
    mode = run.get("mode", "?")
    benches = run.get("benchmarks", {})
    out.append(f"## Results ({mode} run)\n")
    dirty = [n for n, e in benches.items() if entry_provenance(e, run).get("git_dirty")]
    if dirty:
        out.append(f"> **DIRTY: {', '.join(dirty)} measured with uncommitted changes**: those numbers describe no commit.\n")
    la = run.get("load_avg") or {}
    load = f" Load average {fmt(la.get('before'))} before, {fmt(la.get('after'))} after." if la else ""
    ran = run.get("ran") or list(benches)
    out.append(f"Last run {m.get('date', '?')} at commit `{m.get('git_commit')}`: {len(ran)} of {len(benches)} benchmarks "
               f"ran, in {fmt(run.get('seconds'))} s, one at a time.{load} The others kept the figures of the commit "
               "they last ran at: `make bench` reruns a benchmark only when the code it measures changed "
               "(`bench/_provenance.py`; `--all` reruns every one). Written by `bench/run_all.py` into "
               "`bench/results/latest.json`; this section is generated from that file.\n")
    out.append(table(["benchmark", "measured at", "date", "host index", "changed since"], [
        [n, *_prov_cells(run, stale, n)] for n in benches]))
    if mode == "quick":
        out.append("\n**Quick mode**: every script ran with `--quick` (smaller workloads), so the numbers are "
                   "noisier than a full run's.")
    versions = [[k, fmt(v)] for k, v in (m.get("versions") or {}).items()]
    peers = [[f"anchor: {k}", fmt(v) if v else "not installed"] for k, v in (m.get("peer_versions") or {}).items()]
    out += ["\n### Machine\n", table(["", ""], [
        ["CPU", f"{fmt(m.get('cpu_model'))}, {fmt(m.get('cores'))} cores ({fmt(m.get('arch'))})"],
        ["memory", f"{fmt(m.get('memory_gb'))} GB"], ["load average (1 min) at start", fmt(m.get("load_avg_1m"))],
        ["OS", fmt(m.get("os"))], ["Python", fmt(m.get("python"))], ["Java", fmt(m.get("java"))], *versions, *peers])]

    out += ["\n### Benchmarks run\n", table(["benchmark", "status", "seconds", "kind", "load before → after", "command"], [
        [n, e.get("status", "?"), fmt(e.get("seconds")), kind(e, n),
         f"{fmt((e.get('load_avg') or {}).get('before'))} → {fmt((e.get('load_avg') or {}).get('after'))}",
         f"`{e['command']}`" if e.get("command") else fmt(e.get("error"))]
        for n, e in benches.items()])]

    rows = [(n, c) for n, e in benches.items() for c in rows_of(n, e)]
    out.append("\n### Ours vs anchor\n")
    out.append("Each anchor was measured in the same run, on the same machine. *ours ÷ anchor* is the plain ratio; "
               "the verdict accounts for whether higher or lower is better. Rows whose anchor is not installed "
               "or whose run failed are absent. An area marked [simulation] compares simulated work, not real sessions.")
    for area in dict.fromkeys(c["area"] for _, c in rows):
        group = [(n, c) for n, c in rows if c["area"] == area]
        out += [f"\n#### {area}\n", comparison_table([c for _, c in group])]
        notes = dict.fromkeys(f"{c['note']} (bench/{n}.py)" for n, c in group if c.get("note"))
        out += [f"\n- {note}" for note in notes]
        out += ["\n" + provenance(run, stale, n) for n in dict.fromkeys(n for n, _ in group)]
    if not rows:
        out.append("\nNo comparisons in this run.")

    blocks = [(n, t, b) for n, e in benches.items() for t, b in rounds_blocks(e.get("result") or {})]
    if blocks:
        out.append("\n### Interleaved rounds\n")
        out.append("Targets compared in one benchmark ran in rounds (A B A B ...), so load changes hit them alike. "
                   "A pass whose CPU/wall fell under the floor was flagged and re-run; *flagged* counts such passes.")
        for n, title, block in blocks:
            out += [f"\n#### {n}: {title or 'rounds'}\n", rounds_table(title, block), "\n" + provenance(run, stale, n)]

    out.append("\n### All numbers\n")
    for name, e in benches.items():
        out.append(f"\n#### {name}: {e.get('status', '?')}\n")
        if kind(e, name) != "measurement":
            out.append(f"**{kind(e, name)}**: {fmt((e.get('result') or {}).get('kind_note') or 'see the script docstring')}\n")
        if e.get("status") != "ok":
            out.append(f"{fmt(e.get('error'))}\n")
            if e.get("stderr_tail"):
                tail = "\n".join(e["stderr_tail"].strip().splitlines()[-25:]).replace("```", "'''")
                out.append(f"```\n{tail}\n```\n")
        if e.get("last_attempt"):
            la = e["last_attempt"]
            out.append(f"**Its last rerun did not finish** ({fmt(la.get('status'))}: {fmt(la.get('error'))}, at "
                       f"`{(la.get('provenance') or {}).get('git_commit', '?')}`): these are the figures of the last good run.\n")
        for key, k in sorted(((e.get("result") or {}).get("kept") or {}).items()):
            out.append(f"- `{key}` = {fmt(k.get('value'))} is kept from the run at `{fmt(k.get('git_commit'))}` "
                       f"({fmt(k.get('date'))}): the last rerun could not measure it.\n")
        for problem in e.get("comparison_problems", []):
            out.append(f"- comparisons problem: {fmt(problem)}\n")
        result = {k: v for k, v in (e.get("result") or {}).items() if k != "kept"}  # said in its own lines above
        for title, header, body in number_tables(result):
            out.append((f"`{title}`\n\n" if title else "") + table(header, body) + "\n")
        out.append(provenance(run, stale, name) + "\n")
    out += ["", END]
    return "\n".join(out)


def _prov_cells(run: dict, stale: dict | None, name: str) -> list[str]:
    entry = run["benchmarks"][name]
    prov = entry_provenance(entry, run)
    mine = (stale or {}).get(name) or {}
    changed = "?" if not mine else ", ".join(f"`{p}`" for p in mine.get("packages", [])) or "nothing"
    if mine and not mine.get("known"):
        changed = "unknown commit"
    index = (entry.get("host_index") or {}).get("before", {}).get("index")
    return [f"`{prov.get('git_commit') or '?'}`" + (" (dirty)" if prov.get("git_dirty") else ""),
            str(prov.get("date") or run.get("machine", {}).get("date", "?"))[:10], fmt(index), changed]


def comparison_table(rows: list[dict]) -> str:
    return table(["metric", "unit", "ours", "anchor", "anchor value", "ours ÷ anchor", "verdict"],
                 [[fmt(c["metric"]), fmt(c["unit"]) if c["unit"] else "", fmt(c["ours"]), fmt(c["anchor_name"]), fmt(c["anchor"]),
                   fmt(c["ratio"]), c["verdict"]] for c in rows])


def render_marker(run: dict, stale: dict | None, name: str, key: str) -> str:
    """What goes between ``<!-- bench:NAME:KEY -->`` and ``<!-- /bench -->`` (see the module docstring)."""
    if name == "capacity":  # a model over several benchmarks' figures (bench/_capacity.py), not a benchmark
        from bench import _capacity

        return ("\n" + _capacity.render(run) + "\n" + "\n\n".join(provenance(run, stale, n) for n in _capacity.SOURCES) + "\n")
    entry = (run.get("benchmarks") or {}).get(name) or {}
    result = entry.get("result") or {}
    prov = provenance(run, stale, name)
    if key == "provenance":
        return prov
    if name in OWN_RESULTS:
        if not result:
            return f"\n_no {OWN_RESULTS[name]}: run bench/{name}.py._\n"
        return "\n" + importlib.import_module(f"bench.{name}").markdown(result, key) + "\n\n" + prov + "\n"
    if key == "comparisons":
        rows = rows_of(name, entry)
        if not rows:
            return f"\n_no comparisons from bench/{name}.py in bench/results/latest.json ({entry.get('status', 'not run')})._\n"
        parts = []
        for area in dict.fromkeys(c["area"] for c in rows):
            parts += [f"**{area}**\n", comparison_table([c for c in rows if c["area"] == area]), ""]
        return "\n" + "\n".join(parts) + "\n" + prov + "\n"
    if key == "rounds":
        blocks = list(rounds_blocks(result))
        body = "\n\n".join(rounds_table(t, b) for t, b in blocks) or f"_bench/{name}.py ran no interleaved rounds in this run._"
        return "\n" + body + "\n\n" + prov + "\n"
    value = dig(result, *key.split("/"))
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        value = {key.rsplit("/", 1)[-1]: value}  # rows (one per prompt size, say) read as one matrix
    if isinstance(value, dict):
        body = "\n\n".join((f"`{t}`\n\n" if t else "") + table(h, r) for t, h, r in number_tables(value))
        return "\n" + body + "\n\n" + prov + "\n"
    if value is None:
        return f"(not in latest.json: {name}:{key})"
    return fmt(value)


def render_markers(text: str, run: dict, stale: dict | None) -> str:
    return MARKER.sub(lambda mo: f"<!-- bench:{mo[1]}:{mo[2]} -->{render_marker(run, stale, mo[1], mo[2])}<!-- /bench -->", text)


def render_into(doc: Path, run: dict, stale: dict | None = None, marked: dict | None = None) -> None:
    """Replace the generated section of ``doc`` (hand-written text around it is kept); create it if needed.
    ``marked``: the run its markers render from (``with_own``), ``run`` by default."""
    section = render(run, stale)
    text = doc.read_text() if doc.exists() else ""
    if START in text and END in text:
        before, rest = text.split(START, 1)
        text = before + section + rest.split(END, 1)[1]
    else:
        text = (text or "# Benchmarks\n\n") + "\n" + section + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render_markers(text, marked or run, stale))


def pages(root: Path) -> list[Path]:
    """The pages whose figures come from the results: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def own_results(root: Path) -> dict[str, dict]:
    """NAME -> a latest.json-shaped entry for each OWN_RESULTS file under ``root`` (none: no entry)."""
    out = {}
    for name, rel in OWN_RESULTS.items():
        path = root / rel
        if path.exists():
            result = json.loads(path.read_text())
            prov = result.get("provenance") or {}
            out[name] = {"status": "ok", "mode": prov.get("mode", "full"), "result": result, "provenance": prov}
    return out


def with_own(run: dict, own: dict[str, dict]) -> dict:
    """``run`` with the OWN_RESULTS entries beside its benchmarks (for markers; the results section keeps
    latest.json's benchmarks only)."""
    return {**run, "benchmarks": {**(run.get("benchmarks") or {}), **own}}


def stalenesses(run: dict, root: Path) -> dict:
    """Benchmark name -> what changed in the code it measures since it ran (bench/_provenance.changed_for)."""
    return {name: changed_for(name, entry, run, root) for name, entry in (run.get("benchmarks") or {}).items()}


def render_docs(run: dict, root: Path, results_doc: Path | None = None, stale: dict | None = None,
                own: dict[str, dict] | None = None) -> list[Path]:
    """Re-render the results section of ``results_doc`` and every marker in README.md and docs/*.md.

    ``own``: the OWN_RESULTS entries (default: ``own_results(root)``). ``stale`` defaults to what changed,
    per benchmark, in the code it measures since it ran (``stalenesses``). Returns the pages whose text changed."""
    marked = with_own(run, own_results(root) if own is None else own)
    if stale is None:
        stale = stalenesses(marked, root)
    results_doc = results_doc or root / "docs/benchmarks.md"
    changed = []
    for page in dict.fromkeys([*pages(root), results_doc]):
        before = page.read_text() if page.exists() else None
        if page == results_doc:
            render_into(page, run, stale, marked)
        elif before is not None and "<!-- bench:" in before:
            page.write_text(render_markers(before, marked, stale))
        if page.exists() and page.read_text() != before:
            changed.append(page)
    return changed
