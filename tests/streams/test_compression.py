"""The worker's output batches are compressed at the publisher's zstd level (streams/app.py)."""

import random

import orjson
from aiokafka.record import default_records
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from streams.app import _zstd_level


def _batch(value: bytes) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=DefaultRecordBatch.CODEC_ZSTD, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 24)
    builder.append(0, timestamp=None, key=None, value=value, headers=[])
    return bytes(builder.build())


def test_batches_are_compressed_at_level_1_and_read_back(monkeypatch):
    from aiokafka.record._crecords import default_records as compiled

    for module in (default_records, compiled):  # the process-wide setting is restored after the test
        monkeypatch.setattr(module, "zstd_encode", module.zstd_encode)
    rng = random.Random(0)
    value = orjson.dumps({"token_ids": [rng.randrange(151_000) for _ in range(20_000)]})
    _zstd_level(3)  # aiokafka's own level
    three = _batch(value)
    _zstd_level(1)
    one = _batch(value)
    assert len(one) < 0.97 * len(three)  # random ids as JSON digits: level 1 writes them smaller
    records = list(DefaultRecordBatch(bytearray(one)))
    assert [r.value for r in records] == [value]
