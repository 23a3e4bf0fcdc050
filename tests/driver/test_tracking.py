"""The driver's figures in TensorBoard and Weights & Biases (polarstream/driver/tracking.py): each step's reward and
zero-signal counts, each eval's pass@k, on the policy-version axis. W&B runs in its offline mode (no account,
no network); its run file is read back record by record."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from polarstream.driver.tracking import Tracker


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline W&B run under ``run_dir``: its .wandb file is a LevelDB-style log
    (32 KiB blocks of records, each a 7-byte header and a piece of one protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    paths = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if not paths:
        return []
    (path,) = paths
    data = path.read_bytes()
    if len(data) < 7:
        return []
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    rows, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append({k: v for k, v in items.items() if not k.startswith("_")} | {"step": record.history.step.num})
            buf = b""
    return rows


def test_steps_and_evals_reach_tensorboard_and_wandb_on_the_policy_version_axis(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path, "run-1", {"project": "p", "entity": None, "mode": "offline"}, {"seed": 3})
    tracker.eval(0, {"pass@1": 0.25, "pass@4": 0.5, "avg@4": 0.25})
    tracker.step(1, 0.5, 4, 1, 0, 2)
    tracker.step(2, 0.75, 4, 2, 0, 1, {"mismatch_k3": 2e-3, "corrected_frac": None})  # the trainer's mismatch figures
    tracker.eval(2, {"pass@1": 0.75, "pass@4": 1.0, "avg@4": 0.75})
    tracker.close()

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("eval/pass@1")] == [(0, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in tb.Scalars("driver/reward")] == [(1, 0.5), (2, 0.75)]
    assert [e.value for e in tb.Scalars("driver/replaced")] == [2, 1]
    assert [(e.step, round(e.value, 6)) for e in tb.Scalars("driver/mismatch_k3")] == [(2, 2e-3)]
    assert "driver/corrected_frac" not in tb.Tags()["scalars"]  # None: the trainer gave none

    # wandb's service process writes the offline run file, and under load its last records land a little
    # after finish() returns (2 runs in 5 on a busy 2-core machine read an empty history): wait for them
    deadline = time.monotonic() + 60
    while len(rows := _wandb_history(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    by_version: dict[int, dict] = {}
    for row in rows:  # one row per log call, on the policy-version axis
        row.pop("step")
        by_version.setdefault(row.pop("policy_version"), {}).update(row)
    assert by_version.get(0) == {"eval/pass@1": 0.25, "eval/pass@4": 0.5, "eval/avg@4": 0.25}, rows
    assert by_version[2]["driver/reward"] == 0.75 and by_version[2]["eval/pass@1"] == 0.75
    assert by_version[1]["driver/all_correct"] == 1 and len(rows) == 4


def test_turning_wandb_on_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    from polarstream.driver.experiment import ExperimentError, load_experiment
    from polarstream.driver.configure import run_config, run_id

    exp = load_experiment(None, wandb={"project": "mine"})
    assert run_id(exp, tmp_path) == run_id(load_experiment(None), tmp_path)  # W&B on or off: the same run
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    try:
        run_config(exp, tmp_path)
    except ExperimentError as e:
        assert str(e) == "wandb: Weights & Biases is turned on, but the wandb package is not installed (pip install wandb)"
    else:
        raise AssertionError("no error")
