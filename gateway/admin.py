"""Admin routes (``Authorization: Bearer <settings.admin_token>``): pause/resume, policy version, sessions.

The trainer pauses the gateway around a weight swap: ``POST /admin/pause`` holds new calls and returns
once in-flight ones drained; it sets the new version, then ``POST /admin/resume``. A gateway node mints
session keys here (or with ``schemas.session_keys.mint_session_key`` and the shared secret) and reads a
session's ``num_calls`` when the session ends.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field

from schemas.session_keys import OPEN_PREFIX, mint_session_key

from .service import Gateway


def require_admin(request: Request) -> Gateway:
    """The gateway, for a request that carries the admin token (401 otherwise)."""
    token = request.app.state.settings.admin_token
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-admin-token", "")
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "admin token required (Authorization: Bearer <admin_token>)")
    return request.app.state.gateway


AdminGateway = Annotated[Gateway, Depends(require_admin)]
router = APIRouter(prefix="/admin")


class PolicyVersionIn(BaseModel):
    version: int = Field(ge=0)


class SessionIn(BaseModel):
    session_id: str = Field(min_length=1)
    group_id: str = ""
    task_id: str = ""
    sample_index: int = Field(0, ge=0)
    attempt: int = Field(0, ge=0)
    harness: str = ""


def _status(gw: Gateway) -> dict[str, Any]:
    return {"paused": gw.gate.paused, "in_flight": gw.gate.in_flight, "policy_version": gw.policy_version,
            "pauses_expired": gw.gate.auto_resumed}


@router.post("/pause")
async def pause(gw: AdminGateway, timeout_s: float | None = None, deadline_s: float | None = None) -> dict[str, Any]:
    """Hold new calls and wait for in-flight ones; ``drained`` false if some outlived the timeout.

    The gateway resumes by itself ``deadline_s`` after the pause (default ``pause_deadline_s``)."""
    deadline = gw.config.pause_deadline_s if deadline_s is None else deadline_s
    if deadline <= 0:
        raise HTTPException(422, "deadline_s: must be positive")
    drained = await gw.gate.pause(gw.config.drain_timeout_s if timeout_s is None else timeout_s, deadline)
    return {**_status(gw), "drained": drained, "resumes_by_itself_in_s": deadline}


@router.post("/resume")
async def resume(gw: AdminGateway) -> dict[str, Any]:
    """Let held and new calls through again."""
    gw.gate.resume()
    return _status(gw)


@router.get("/status")
async def status(gw: AdminGateway) -> dict[str, Any]:
    """Pause state, calls in flight, the policy version stamped on calls."""
    return {**_status(gw), "sessions": len(gw.sessions), **gw.counters}


@router.get("/policy_version")
async def get_policy_version(gw: AdminGateway) -> dict[str, int]:
    """The version stamped on calls whose engine reports none."""
    return {"version": gw.policy_version}


@router.post("/policy_version")
async def set_policy_version(body: PolicyVersionIn, gw: AdminGateway) -> dict[str, int]:
    """Stamp ``version`` on every later call (engines that report their own version win)."""
    gw.policy_version = body.version
    return {"version": gw.policy_version}


@router.post("/sessions")
async def create_session(body: SessionIn, request: Request, gw: AdminGateway) -> dict[str, Any]:
    """Mint the key of a session (the harness sends it as its API key)."""
    if body.session_id.startswith(OPEN_PREFIX):
        raise HTTPException(422, f"session_id: {OPEN_PREFIX!r} is the namespace of open-mode sessions")
    key = mint_session_key(body.session_id, request.app.state.settings.session_secret, group_id=body.group_id,
                           task_id=body.task_id, sample_index=body.sample_index, attempt=body.attempt, harness=body.harness,
                           ttl_s=request.app.state.settings.session_key_ttl_s)
    return {"session_id": body.session_id, "session_key": key}


@router.get("/sessions/{session_id}")
async def session_stats(session_id: str, gw: AdminGateway) -> dict[str, Any]:
    """Counters of a session: ``num_calls`` recorded, merged, breaks, side calls, failed."""
    st = gw.sessions.find(session_id)
    if st is None:
        return {"session_id": session_id, "known": False, "num_calls": 0, "merged": 0, "breaks": 0, "side_calls": 0,
                "failed": 0, "next_call_index": 0, "pending": False}
    return {"known": True, **st.stats()}


@router.delete("/sessions/{session_id}")
async def drop_session(session_id: str, gw: AdminGateway) -> dict[str, Any]:
    """Forget a session's state (its events stay in Kafka) and close it: its key records no more calls,
    also when this gateway never saw it (``forget`` closes sessions this way). Answers its final counters."""
    st = gw.sessions.find(session_id)
    if st is None:
        gw.sessions.drop(session_id)
        return {"session_id": session_id, "known": False, "closed": True}
    await st.wait_idle(600)  # never drop a session in the middle of a call (bounded: an admin call must end)
    gw.sessions.drop(session_id)
    return {"known": True, "closed": True, **st.stats()}
