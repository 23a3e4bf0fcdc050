"""Refuse to serve beyond this machine with development credentials, or open mode, unless asked.

The defaults (``infra.settings.DEV_ADMIN_TOKEN``, ``DEV_SESSION_SECRET``) are public: on
a reachable address anyone could pause the gateway, mint keys for any session or write into one. Open
mode records whatever any caller sends, so off loopback it needs an explicit ``--allow-open-remote``.
"""

from __future__ import annotations

from infra.reach import is_loopback
from infra.settings import DEV_ADMIN_TOKEN, DEV_SESSION_SECRET


class UnsafeExposure(ValueError):
    """Serving on ``host`` with these settings would let anyone on the network in."""


def check_exposure(host: str, *, admin_token: str, session_secret: str, open_mode: bool = False,
                   allow_open_remote: bool = False) -> None:
    """Raise UnsafeExposure (one line naming the fix) when serving on ``host`` is unsafe."""
    if is_loopback(host):
        return
    dev = [name for name, value, default in (("POLAR_ADMIN_TOKEN", admin_token, DEV_ADMIN_TOKEN),
                                             ("POLAR_SESSION_SECRET", session_secret, DEV_SESSION_SECRET))
           if value == default]
    if dev:
        raise UnsafeExposure(f"refusing to listen on {host} with the development {' and '.join(dev)}: set "
                             f"{' and '.join(dev)} to secret values (or listen on 127.0.0.1)")
    if open_mode and not allow_open_remote:
        raise UnsafeExposure(f"refusing --open on {host}: anyone who can reach it could record sessions; pass "
                             "--allow-open-remote to mean it (or listen on 127.0.0.1)")
