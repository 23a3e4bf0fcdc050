import csv
from decimal import Decimal

from .amounts import parse_amount


def balances(path: str) -> dict[str, Decimal]:
    """Each account's balance over the journal at ``path``."""
    totals: dict[str, Decimal] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            totals[row["account"]] = parse_amount(row["amount"])
    return totals
