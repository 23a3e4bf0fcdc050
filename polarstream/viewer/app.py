"""The viewer's web app: read-only pages over the run indexes, and their static files.

    GET /                                    runs: prefixes, reward sparkline, reward and pass@k per policy, groups
    GET /r/{run}/group/{group_id}            a group's samples: reward, advantage, status; masked members and why
    GET /r/{run}/session/{session_id}        a session's calls in order, chains drawn as lanes
    GET /r/{run}/trace/{lane}/{session_id}   a lane's tokens: context vs sampled, logprob on hover, scrubbed spans
    GET /seq[?run=N]                         the index's change counter (what the pages poll)
    GET /static/viewer.css | viewer.js       served from the package: these machines reach no CDN

Bound to loopback it is open, like a notebook; bound anywhere else every request needs the admin token,
the gateway's convention (``Authorization: Bearer <POLAR_ADMIN_TOKEN>`` or ``X-Admin-Token``). A browser
cannot send a header on a link, so ``?token=`` once sets an HttpOnly cookie that carries it from then on.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from infra.reach import is_loopback

from . import pages
from .index import RunIndex

COOKIE = "polar_admin"
STATIC = {"viewer.css": "text/css; charset=utf-8", "viewer.js": "text/javascript; charset=utf-8"}
Handler = Callable[[Request], Awaitable[Response]]


def needs_token(host: str) -> bool:
    """Whether a viewer bound to ``host`` must ask for the admin token (anything but loopback)."""
    return not is_loopback(host)


def create_app(runs: Sequence[RunIndex], *, admin_token: str | None = None,
               decode: pages.Decode | None = None) -> Starlette:
    """The app over ``runs`` (one index per prefix). ``admin_token``: required on every request when
    set (``needs_token``); ``decode``: token id -> text for trace pages (ids are shown without one)."""

    def guarded(handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            if admin_token is None:
                return await handler(request)
            given = _given_token(request)
            if not given or not hmac.compare_digest(given.encode(), admin_token.encode()):
                return PlainTextResponse("admin token required: open this page with ?token=<POLAR_ADMIN_TOKEN> "
                                         "or send Authorization: Bearer <token>", status_code=401)
            if request.query_params.get("token"):  # from a link: keep it in a cookie, drop it from the URL
                response = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
                response.set_cookie(COOKIE, given, httponly=True, samesite="strict")
                return response
            return await handler(request)
        return endpoint

    def run_of(request: Request) -> tuple[int, RunIndex] | None:
        i = request.path_params["run"]
        return (i, runs[i]) if 0 <= i < len(runs) else None

    def page(html: str | None, what: str) -> HTMLResponse:
        return HTMLResponse(html) if html is not None else HTMLResponse(pages.not_found(what), status_code=404)

    async def runs_page(request: Request) -> Response:
        return HTMLResponse(pages.runs_page(runs))

    async def group(request: Request) -> Response:
        found, gid = run_of(request), request.path_params["group_id"]
        return page(pages.group_page(*found, gid) if found else None, f"group {gid}")

    async def session(request: Request) -> Response:
        found, sid = run_of(request), request.path_params["session_id"]
        return page(pages.session_page(*found, sid) if found else None, f"session {sid}")

    async def trace(request: Request) -> Response:
        found, sid, lane = run_of(request), request.path_params["session_id"], request.path_params["lane"]
        return page(pages.trace_page(*found, sid, lane, decode) if found else None, f"lane {lane} of session {sid}")

    async def seq(request: Request) -> Response:
        which = request.query_params.get("run", "")
        chosen = [runs[int(which)]] if which.isdigit() and int(which) < len(runs) else runs
        return JSONResponse({"seq": sum(r.seq for r in chosen)})

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found", status_code=404)
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name], headers={"cache-control": "max-age=300"})

    routes = [
        Route("/", guarded(runs_page)),
        Route("/r/{run:int}/group/{group_id:path}", guarded(group)),
        Route("/r/{run:int}/session/{session_id:path}", guarded(session)),
        Route("/r/{run:int}/trace/{lane:int}/{session_id:path}", guarded(trace)),
        Route("/seq", guarded(seq)),
        Route("/static/{name}", static),  # the stylesheet and script hold nothing recorded
    ]
    return Starlette(routes=routes)


def _given_token(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (request.headers.get("x-admin-token", "") or request.query_params.get("token", "")
            or request.cookies.get(COOKIE, ""))
