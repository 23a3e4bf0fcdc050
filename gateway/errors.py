"""Gateway failures -> ``RequestError``, which each adapter renders in its provider's own shape.

This is the one place where engine, template, publish and pause failures get an HTTP status, so every
provider answers the same failure with the same status and a harness never sees a stack trace.
"""

from __future__ import annotations

from .canonical import ContextLengthError, RequestError
from .upstream import UpstreamContextOverflow, UpstreamError, UpstreamTimeout

_KIND_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                   504: "timeout_error"}


def kind_for_status(status: int) -> str:
    return _KIND_BY_STATUS.get(status, "api_error")


def from_upstream(e: UpstreamError) -> RequestError:
    """An engine failure as the harness should see it (timeout 504, transport 502, overflow, pass-through)."""
    if isinstance(e, UpstreamContextOverflow):
        return ContextLengthError(e.prompt_tokens, e.limit)
    if isinstance(e, UpstreamTimeout):
        return RequestError(504, f"upstream timeout: {e.message}", "timeout_error")
    return RequestError(e.status, f"upstream error: {e.message}", kind_for_status(e.status))


def unavailable(message: str, retry_after_s: int) -> RequestError:
    """503 with Retry-After: the call was not recorded and may be retried as it is."""
    return RequestError(503, message, "overloaded_error", headers={"Retry-After": str(retry_after_s)})


def unauthorized(message: str) -> RequestError:
    return RequestError(401, message, "authentication_error")
