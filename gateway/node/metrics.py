"""A gateway node's Prometheus metrics, read from its pipeline when Prometheus scrapes.

The node serves them on its gateway's ``GET /metrics`` (same process, same registry). Stage names are
the lifecycle's: INIT, READY (prepared, waiting for a run slot), RUN, POSTRUN (gateway/node/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from infra.metrics import Reading, Sampled


def _stages(pipeline: Any) -> Iterator[Reading]:
    for stage, n in pipeline.stage.items():
        yield (pipeline.cfg.node_id, stage.upper()), float(n)


def _ready(pipeline: Any) -> Iterator[Reading]:
    yield (pipeline.cfg.node_id,), float(pipeline.stage["ready"])


def _slots(pipeline: Any) -> Iterator[Reading]:
    yield (pipeline.cfg.node_id,), pipeline.stage["run"] / max(1, pipeline.cfg.run_workers)


def _run_busy(pipeline: Any) -> Iterator[Reading]:
    yield (pipeline.cfg.node_id,), float(pipeline.run_busy_s)


def _finished(pipeline: Any) -> Iterator[Reading]:
    for status, n in pipeline.finished.items():
        yield (pipeline.cfg.node_id, status), float(n)


def _verifier_faults(pipeline: Any) -> Iterator[Reading]:
    for cause, n in pipeline.verifier_faults.items():
        yield (pipeline.cfg.node_id, cause), float(n)


def _stage_seconds(pipeline: Any) -> Iterator[Reading]:
    for (sandbox, stage), (seconds, _) in pipeline.stage_seconds.items():
        yield (pipeline.cfg.node_id, sandbox, stage), float(seconds)


def _stage_sessions(pipeline: Any) -> Iterator[Reading]:
    for (sandbox, stage), (_, n) in pipeline.stage_seconds.items():
        yield (pipeline.cfg.node_id, sandbox, stage), float(n)


_GAUGES = (
    Sampled("polar_node_sessions", "Sessions in each stage of the node (INIT, READY, RUN, POSTRUN)",
            ("node", "stage"), _stages),
    Sampled("polar_node_ready_buffer", "Prepared sessions waiting for a run slot (the READY buffer)", ("node",), _ready),
    Sampled("polar_node_run_slot_utilization", "Run slots busy now, as a fraction of --run-workers", ("node",), _slots),
    Sampled("polar_node_run_slot_busy_seconds", "Seconds run slots were busy, summed over slots (utilization "
            "over a window: rate() / run workers)", ("node",), _run_busy, counter=True),
    Sampled("polar_node_sessions_finished", "Sessions the node finished, by status", ("node", "status"), _finished,
            counter=True),
    Sampled("polar_node_verifier_faults", "Sessions masked (infra_error) because their verifier could not judge, "
            "by cause: tls, dns, network, interpreter, install, timeout (gateway/verifier_faults.py)",
            ("node", "cause"), _verifier_faults, counter=True),
    Sampled("polar_node_stage_seconds", "Seconds sessions spent in each stage (open: the sandbox ready; run: the "
            "harness; verify; close: the sandbox removed), summed, by sandbox (bwrap, podman)",
            ("node", "sandbox", "stage"), _stage_seconds, counter=True),
    Sampled("polar_node_stage_sessions", "Sessions counted in polar_node_stage_seconds (mean = seconds / sessions)",
            ("node", "sandbox", "stage"), _stage_sessions, counter=True),
)


def watch(pipeline: Any) -> None:
    """Report ``pipeline`` (a gateway/node Pipeline) until it is garbage collected."""
    for gauge in _GAUGES:
        gauge.watch(pipeline)
