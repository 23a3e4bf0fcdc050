"""merge-busy-intervals: /app/busy.txt holds the meetings merged, touching ones too, earliest first."""
from pathlib import Path

OUT = Path("/app/busy.txt")


def test_busy_file_exists():
    assert OUT.exists(), f"{OUT} does not exist"


def test_intervals_are_merged_and_sorted():
    got = [ln.strip() for ln in OUT.read_text().splitlines() if ln.strip()]
    assert got == ["540-580", "600-675", "690-740", "900-960", "1020-1080"], got
