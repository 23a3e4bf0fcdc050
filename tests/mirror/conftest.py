"""Three local clusters for the multi-DC tests: two regions (eu, us) and the center, one broker each.

Module-scoped and started side by side (small heaps, C1-only JIT, tied to this process like the infra
fixture's broker), so the tests here pay for three broker starts once. Each test uses its own topic
prefix on all three and runs its own MirrorMaker processes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from infra.clusters import Cluster
from infra.mirror import MirrorMaker, mirror_properties
from infra.settings import Settings
from infra.topics import ensure_topics

REGIONS = ("eu", "us")
CENTER = "center"


@dataclass
class DCs:
    base: Settings
    clusters: dict[str, Cluster]

    def settings(self, name: str, prefix: str) -> Settings:
        """Client settings for cluster ``name`` under topic ``prefix``."""
        return self.clusters[name].settings.model_copy(update={"topic_prefix": prefix})

    def mirror(self, region: str, prefix: str, data_dir, flush_ms: int = 1000) -> MirrorMaker:
        """A MirrorMaker for ``region`` <-> center, its files under ``data_dir`` (not started)."""
        base = self.base.model_copy(update={"topic_prefix": prefix, "data_dir": data_dir})
        props = mirror_properties(region, self.clusters[region].kafka.bootstrap, CENTER,
                                  self.clusters[CENTER].kafka.bootstrap, base, refresh_s=2, flush_ms=flush_ms)
        return MirrorMaker(base, region=region, center=CENTER, props=props, heap_mb=256,
                           die_with_parent=True, quick_jit=True)

    def fresh_prefix(self) -> str:
        """A new topic prefix whose topics exist on every cluster."""
        prefix = f"m{uuid.uuid4().hex[:8]}."
        for name in self.clusters:
            ensure_topics(self.settings(name, prefix))
        return prefix


@pytest.fixture(scope="module")
def dcs(tmp_path_factory) -> DCs:
    base = Settings(data_dir=tmp_path_factory.mktemp("dcs"), topic_prefix="")
    clusters = {n: Cluster(base, n, create=True, ephemeral=True, heap_mb=256) for n in (*REGIONS, CENTER)}
    try:
        for c in clusters.values():
            c.kafka.launch()
        for c in clusters.values():
            c.kafka.wait_ready(120)
        yield DCs(base, clusters)
    finally:
        for c in clusters.values():
            c.down()
