"""The evaluation report as files: ``eval.json``, ``eval.png`` (matplotlib) and ``eval.html``.

Each file is written beside its target and renamed over it, so a browser or a script polling the
directory while ``polarstream eval --follow`` refreshes it never reads half a file.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections import defaultdict
from pathlib import Path

import orjson

_COLUMNS = ("harness", "policy_version", "task_set", "samples", "tasks", "pass@1", "mean_reward", "timeouts",
            "mean_turns", "mean_tokens", "mean_sampled_tokens", "excluded")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def plot_png(report: dict) -> bytes:
    """pass@k and mean reward against policy version, one line per harness / task set."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe in a thread
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    ks = list(report["ks"])
    styles = ["-", "--", ":", "-."]
    lines: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for cell in report["cells"]:
        lines[(cell["harness"], cell["task_set"])].append(cell)
    fig, (ax_pass, ax_reward) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    # One colour per harness / task set, one line style per k: the lines of one harness stay together.
    for n, ((harness, task_set), cells) in enumerate(sorted(lines.items())):
        color = f"C{n % 10}"
        cells.sort(key=lambda c: c["policy_version"])
        xs = [c["policy_version"] for c in cells]
        for i, k in enumerate(ks):
            ys = [c.get(f"pass@{k}") for c in cells]
            ax_pass.plot(xs, [float("nan") if y is None else y for y in ys], styles[i % len(styles)], color=color,
                         marker="o", label=f"{harness}/{task_set} pass@{k}")
        ys = [c.get("mean_reward") for c in cells]
        ax_reward.plot(xs, [float("nan") if y is None else y for y in ys], color=color, marker="o",
                       label=f"{harness}/{task_set}")
    ax_pass.set(title="pass@k by policy version", xlabel="policy version", ylabel="pass@k", ylim=(-0.02, 1.02))
    ax_reward.set(title="mean reward by policy version", xlabel="policy version", ylabel="mean reward")
    for ax in (ax_pass, ax_reward):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole numbers
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def render_html(report: dict, png: bytes | None) -> str:
    """A self-contained page: the cells as a table, merge breaks and statuses, the plot inline."""
    ks = [k for k in report["ks"] if k != 1]
    cols = [*_COLUMNS[:6], *(f"pass@{k}" for k in ks), *_COLUMNS[6:]]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(cell.get(c)))}</td>" for c in cols) + "</tr>"
                   for cell in report["cells"])
    details = "".join(
        f"<tr><td>{html.escape(c['harness'])}</td><td>{c['policy_version']}</td><td>{html.escape(c['task_set'])}</td>"
        f"<td>{html.escape(_kv(c['merge_breaks']))}</td><td>{html.escape(_kv(c['statuses']))}</td>"
        f"<td>{html.escape(_kv(c['masked_from_training']))}</td></tr>"
        for c in report["cells"])
    img = f'<img alt="pass@k and reward by policy version" src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png else ""
    src = report.get("source", {})
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>polarstream eval</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} th{{background:#eee}}</style></head>
<body><h1>polarstream eval</h1>
<p>{html.escape(str(src.get("topic", "")))}: {src.get("trajectories", 0)} trajectories, {src.get("duplicates", 0)} repeats dropped,
{src.get("superseded", 0)} superseded by a later attempt, {src.get("undecodable", 0)} undecodable. A sample passes when
its status is ok and its reward is at least {report["threshold"]}.</p>
<table><tr>{head}</tr>{rows}</table>
{img}
<h2>Merge breaks, statuses, masked from training</h2>
<table><tr><th>harness</th><th>policy version</th><th>task set</th><th>merge breaks</th><th>statuses</th><th>masked</th></tr>{details}</table>
</body></html>
"""


def _kv(d: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in d.items()) or "–"


def write_report(report: dict, out_dir: Path, png: bool = True) -> list[Path]:
    """Write eval.json (+ eval.png and eval.html) under ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "eval.json"]
    _atomic_write(paths[0], orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    image = plot_png(report) if png and report["cells"] else None
    if image is not None:
        paths.append(out_dir / "eval.png")
        _atomic_write(paths[-1], image)
    paths.append(out_dir / "eval.html")
    _atomic_write(paths[-1], render_html(report, image).encode())
    return paths
