"""MirrorMaker 2 between two secured clusters: every link runs SASL_SSL, and calls reach the center.

The center is the session's secured stack; the region is one more secured broker (its own CA and
users). MM2 runs as each cluster's admin (docs/security.md: a least-privilege mirror principal is
not in the ACL table yet)."""

from __future__ import annotations

import asyncio
import time

from infra.acls import apply_acls
from infra.kafka import KafkaBroker
from infra.mirror import MirrorMaker, mirror_properties
from infra.process import free_port
from infra.security import admin_view
from infra.settings import Settings
from infra.topics import ensure_topics
from producers.consumer import RecordConsumer
from producers.publisher import Publisher
from schemas import CallRecorded
from tests.plugins.security import principal_settings


def test_mirrored_calls_travel_over_tls_and_sasl(secure_settings, tmp_path):
    prefix = secure_settings.topic_prefix
    port = free_port()
    region = admin_view(Settings(data_dir=tmp_path / "eu", kafka_port=port, kafka_controller_port=free_port(),
                                 kafka_bootstrap=f"127.0.0.1:{port}", topic_prefix=prefix, secure=True))
    broker = KafkaBroker(region, heap_mb=256, die_with_parent=True, quick_jit=True)
    mm = None
    try:
        broker.start(120)
        ensure_topics(region)
        apply_acls(region)
        base = secure_settings.model_copy(update={"data_dir": tmp_path / "mm"})
        props = mirror_properties("eu", region.kafka_bootstrap, "center", secure_settings.kafka_bootstrap, base,
                                  refresh_s=2, clients={"eu": region, "center": secure_settings})
        assert props["eu.security.protocol"] == props["center.security.protocol"] == "SASL_SSL"
        mm = MirrorMaker(base, region="eu", center="center", props=props, heap_mb=256, die_with_parent=True, quick_jit=True)
        mm.start(150)
        assert mm.config_file.stat().st_mode & 0o077 == 0  # it holds both admins' passwords

        call = CallRecorded(session_id="eu-s0", call_index=0, provider="engine", prompt_ids=[1, 2])

        async def go():
            async with Publisher(principal_settings(region, "gateway")) as pub:  # the region's own gateway user
                await pub.publish(call)
        asyncio.run(go())

        got, deadline = [], time.monotonic() + 90
        with RecordConsumer(secure_settings, topics=["calls"], group_id="security-mirror-check") as c:
            while not got and time.monotonic() < deadline:
                got = [r.record for r in c.poll(1.0) if r.record.event_id == call.event_id]
        assert got, f"nothing mirrored; mm2 log:\n{mm.log_tail(30)}"
        log = mm.log_file.read_text(errors="replace")
        for s in (region, secure_settings):
            assert s.kafka_password.get_secret_value() not in log  # Kafka's config dumps mask passwords
    finally:
        if mm is not None:
            mm.stop()
        broker.stop()
