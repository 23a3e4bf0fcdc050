def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching intervals merged, sorted by start."""
    raise NotImplementedError
