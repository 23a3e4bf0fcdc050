def slugify(text: str) -> str:
    """URL slug of text."""
    raise NotImplementedError
