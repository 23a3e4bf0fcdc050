from decimal import Decimal


def parse_amount(text: str) -> Decimal:
    """An amount as our bank exports it, e.g. ``12.50`` or ``-3``."""
    return Decimal(text.strip())
