"""The one error type infrastructure raises: a single line a person can act on."""

from __future__ import annotations


class InfraError(RuntimeError):
    """Something the infrastructure cannot do; the message says what and, where it can, how to fix it."""
