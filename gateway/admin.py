"""Admin routes (``Authorization: Bearer <settings.admin_token>``): pause/resume, policy version, sessions.

The trainer pauses the gateway around a weight swap: ``POST /admin/pause`` holds new calls and returns
once in-flight ones drained; it sets the new version, then ``POST /admin/resume``. The version set is a
``schemas.PolicyStamp``: for a LoRA run also the adapter serving it, for a shared gateway the run. A gateway node mints
session keys here (or with ``schemas.session_keys.mint_session_key`` and the shared secret) and reads a
session's ``num_calls`` when the session ends.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field

from schemas.policy_stamp import PolicyStamp
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


class SessionIn(BaseModel):
    session_id: str = Field(min_length=1)
    group_id: str = ""
    task_id: str = ""
    sample_index: int = Field(0, ge=0)
    attempt: int = Field(0, ge=0)
    harness: str = ""
    run: str = ""  # the run's topic prefix on a gateway shared by several runs ('' = the gateway's own)


def _status(gw: Gateway) -> dict[str, Any]:
    return {"paused": gw.gate.paused, "in_flight": gw.gate.in_flight, "policy_version": gw.policy_version,
            "lora_name": gw.policy().lora_name, "pauses_expired": gw.gate.auto_resumed,
            "adapters_in_flight": dict(gw.adapters_in_flight)}


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


def _stamp(gw: Gateway, run: str) -> dict[str, Any]:
    """``{"version"}`` as before LoRA; the adapter (and its calls at the engine now) and the run when set."""
    p = gw.policy(run)
    out: dict[str, Any] = {"version": p.version}
    if p.lora_name:
        out.update(lora_name=p.lora_name, adapter_in_flight=gw.adapters_in_flight.get(p.lora_name, 0))
    if run:
        out["run"] = run
    return out


@router.get("/policy_version")
async def get_policy_version(gw: AdminGateway, run: str = "") -> dict[str, Any]:
    """The version (and LoRA adapter) stamped on ``run``'s calls."""
    return _stamp(gw, run)


@router.post("/policy_version")
async def set_policy_version(body: PolicyStamp, gw: AdminGateway) -> dict[str, Any]:
    """Stamp ``version`` on ``run``'s later calls (``schemas.PolicyStamp``). Full weights: engines that
    report their own version win. LoRA (``lora_name``): calls go to that adapter and carry ``version``."""
    gw.stamp(body.version, body.lora_name, body.run)
    return _stamp(gw, body.run)


@router.get("/adapters")
async def adapters(gw: AdminGateway) -> dict[str, Any]:
    """Calls at the engine now, per LoRA adapter: an old adapter may be unloaded once it has none
    and no run is stamped with it."""
    return {"in_flight": dict(gw.adapters_in_flight),
            "stamped": {run or gw.topic_prefix: p.lora_name for run, p in gw.runs.items() if p.lora_name}}


@router.post("/sessions")
async def create_session(body: SessionIn, request: Request, gw: AdminGateway) -> dict[str, Any]:
    """Mint the key of a session (the harness sends it as its API key)."""
    if body.session_id.startswith(OPEN_PREFIX):
        raise HTTPException(422, f"session_id: {OPEN_PREFIX!r} is the namespace of open-mode sessions")
    key = mint_session_key(body.session_id, request.app.state.settings.session_secret, group_id=body.group_id,
                           task_id=body.task_id, sample_index=body.sample_index, attempt=body.attempt, harness=body.harness,
                           ttl_s=request.app.state.settings.session_key_ttl_s, run=body.run)
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
