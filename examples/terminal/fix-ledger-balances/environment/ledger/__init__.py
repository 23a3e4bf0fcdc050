"""A tiny double-entry-ish ledger: a journal CSV (date,account,amount,memo) summed per account."""

from .amounts import parse_amount
from .balances import balances

__all__ = ["balances", "parse_amount"]
