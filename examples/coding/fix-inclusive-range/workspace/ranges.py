def inclusive_range(a: int, b: int) -> list[int]:
    """Every integer from a to b, both included."""
    return list(range(a, b))
