def count_words(text: str) -> int:
    """Number of whitespace-separated words."""
    return len(text.split(" ")) if text else 0
