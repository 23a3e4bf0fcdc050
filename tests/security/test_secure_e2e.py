"""The whole loop on the secured stack, every component as its own principal, with secrets in a tool output.

OpenAI SDK -> gateway (principal gateway) -> scripted tiny engine -> polar.calls; session events
(gateway); a Faust worker (principal streams) builds the group; the trainer (principal trainer) trains
on it, checkpoints to S3 as the writer and publishes a policy version; a reader loads the checkpoint
through the read-only S3 server. The tool output of every session holds a fake AWS key pair and a
bearer token: afterwards no topic on the broker holds either string, and no recorded prompt's ids
decode to them. The group equals what the pure functions compute, byte for byte (as in the default
stack's tests/streams/test_gateway_sessions.py).
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer

from infra.security import s3_settings
from polarstream.tools.forget import read_partition
from schemas import TrainingGroup, decode, encode, resolve_prompt
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.trajectory import build_trajectory
from tests.plugins.gateway import finished_events, read_calls, run_tool_session
from tests.plugins.security import principal_settings
from tests.streams.helpers import WorkerProcess, dedupe, publish, read_topic

AWS_ID, AWS_SECRET = "AKIAZ5FAKEKEY0000042", "q8Vd0kRk3nUhmR9fakeSecretKeyForTests0042"
BEARER = "tok_live_7f3a9c2e51b84d6f9e0a1b2c3d4e5f60"
SECRETS = (AWS_ID, AWS_SECRET, BEARER)
TOOL_OUTPUT = (f"wrote 2 bytes\n$ cat ~/.aws/credentials\naws_access_key_id = {AWS_ID}\n"
               f"aws_secret_access_key = {AWS_SECRET}\n$ history | tail -1\ncurl -H \"Authorization: Bearer {BEARER}\" https://api.example.com\n")


def scan_all_topics(admin_settings) -> tuple[int, bytes]:
    """(messages, every key and value of every partition of every topic on the broker, concatenated)."""
    c = Consumer(admin_settings.kafka_config(**{"group.id": "security-scan", "enable.auto.commit": False}))
    try:
        blobs = []
        for name, md in c.list_topics(timeout=10).topics.items():
            for p in md.partitions:
                blobs += [part for m in read_partition(c, name, p, 30.0)[0] for part in (m.key() or b"", m.value() or b"")]
        return len(blobs) // 2, b"\n".join(blobs)
    finally:
        c.close()


def test_secured_loop_records_no_secret_and_still_trains(secure_settings, scripted_engine, gateway_factory,
                                                         tiny_model_dir, tiny_template, tmp_path, monkeypatch):
    admin = secure_settings
    gateway = principal_settings(admin, "gateway")
    gw = gateway_factory(gateway, scripted_engine.url)
    for i in range(2):
        run_tool_session(gw, f"sec-s{i}", i, "sec-group", "sec-task", TOOL_OUTPUT)
    calls = read_calls(admin, 6)
    by_session = {sid: [c for c in calls if c.session_id == sid] for sid in ("sec-s0", "sec-s1")}
    assert [len(v) for v in by_session.values()] == [3, 3]
    for session_calls in by_session.values():
        full: dict[int, list[int]] = {}
        for c in sorted(session_calls, key=lambda c: c.call_index):
            prompt = resolve_prompt(c, full)
            full[c.call_index] = prompt + c.completion_ids
            text = tiny_template.tokenizer.decode(prompt)
            assert not any(s in text for s in SECRETS)  # the ids never encoded a secret
            if c.call_index == 1:  # the call whose new messages hold the tool output
                assert c.redactions == {"aws_access_key": 1, "aws_secret_key": 1, "bearer": 1}
            else:  # counts are of each event's new content: the re-sent history is not counted again
                assert c.redactions == {}
            assert len(c.scrubbed_spans) == (0 if c.call_index == 0 else 3)
            for a, b in c.scrubbed_spans:
                assert "[REDACTED:" in tiny_template.tokenizer.decode(prompt[a:b])
    finished = finished_events(by_session, "sec-group", "sec-task")
    publish(gateway, finished)

    # The worker as principal `streams` (WorkerProcess passes the environment on).
    streams = principal_settings(admin, "streams")
    monkeypatch.setenv("POLAR_KAFKA_USERNAME", "streams")
    monkeypatch.setenv("POLAR_KAFKA_PASSWORD", streams.kafka_password.get_secret_value())
    monkeypatch.setenv("POLAR_KAFKA_CA_FILE", streams.kafka_ca_file)
    worker = WorkerProcess(streams, tmp_path / "worker.log", ["--builder", "prefix_merging", "--tick-interval", "0.5"]).start()
    try:
        got, _ = dedupe(read_topic(admin, "groups", until=lambda m: len(m) >= 1, timeout=120, idle=1.0), TrainingGroup)
    finally:
        worker.stop()
    assert got, f"no group; worker log:\n{worker.log_text()[-3000:]}"
    assert streams.kafka_password.get_secret_value() not in worker.log_text()  # no secret is ever logged
    (raw,) = got.values()
    cfg = StreamsConfig(builder="prefix_merging")
    trajs = [build_trajectory(f, [CallTokens.from_record(c) for c in by_session[f.session_id]], cfg) for f in finished]
    assert raw == encode(build_group("sec-group", trajs, cfg), packed=True)  # same as the default stack: byte for byte
    group = decode(raw, TrainingGroup)
    assert group.advantages[0] > 0 > group.advantages[1]
    for traj in group.trajectories:  # placeholders are stable, so token-in/token-out still merges
        (trace,) = traj.traces
        assert trace.call_indices == [0, 1, 2]

    # The trainer as principal `trainer`: one step on that group, checkpoint to S3 as the writer.
    from trainer.checkpoint import latest
    from trainer.config import TrainConfig
    from trainer.train import train

    trainer = principal_settings(admin, "trainer")
    cfg = TrainConfig.from_overrides(dict(model=str(tiny_model_dir), groups_per_step=1, max_steps=1, token_budget=2048,
                                          lr=1e-4, idle_timeout_s=20.0, poll_timeout_s=0.2, run_dir=str(tmp_path / "run"),
                                          progress=False, tensorboard=False))
    summary = train(cfg, trainer)
    assert summary["step"] == 1 and summary["checkpoint"].startswith("s3://")

    # A checkpoint reader finds it through the read-only S3 server, and cannot write there.
    reader = s3_settings(admin, "reader")
    assert latest(admin.checkpoint_url, reader).url == summary["checkpoint"]
    from infra.storage import filesystem

    fs, root = filesystem(admin.checkpoint_url, reader)
    with pytest.raises(OSError):  # s3proxy's read-only blobstore refuses every write
        fs.pipe(f"{root}/intruder.txt", b"x")
    assert not fs.exists(f"{root}/intruder.txt")
    writer_fs, _ = filesystem(admin.checkpoint_url, admin)  # the same write as the writer goes through
    writer_fs.pipe(f"{root}/writer.txt", b"x")
    fs.invalidate_cache()
    assert fs.cat(f"{root}/writer.txt") == b"x"  # and the reader sees it

    n, everything = scan_all_topics(admin)
    assert n > 10 and b"sec-s0" in everything  # the scan sees the recorded sessions...
    for s in SECRETS:
        assert s.encode() not in everything  # ...and no secret, in any topic
    assert b"[REDACTED:aws_access_key:" in everything
