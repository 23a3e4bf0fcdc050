#!/bin/bash
set -euo pipefail
cd /srv/ledger
cat > ledger/amounts.py <<'PY'
import re
from decimal import Decimal

_AMOUNT = re.compile(r"-?\d+(\.\d+)?")


def parse_amount(text: str) -> Decimal:
    """An amount as our bank exports it: ``12.50``, ``-3``, ``2,500.00``, ``(1200.00)`` (negative)."""
    s = text.strip()
    negative = s.startswith("(") and s.endswith(")")
    if negative:
        s = s[1:-1].strip()
    s = s.replace(",", "")
    if not _AMOUNT.fullmatch(s):
        raise ValueError(f"not an amount: {text!r}")
    value = Decimal(s)
    return -value if negative else value
PY
sed -i 's/totals\[row\["account"\]\] = parse_amount(row\["amount"\])/totals[row["account"]] = totals.get(row["account"], Decimal(0)) + parse_amount(row["amount"])/' ledger/balances.py
grep -q 'totals.get' ledger/balances.py
