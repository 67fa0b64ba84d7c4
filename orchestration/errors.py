"""The one place where an exception becomes an HTTP status and an OpenAI-style error body.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Client mistakes are 4xx with a message naming the field; full queues are 503 with Retry-After;
only the server's own failures are 5xx, and their details stay in the log, not the body. A client mistake is a
typed one: an InvalidRequestError (a stage's too, across Ray), or the pydantic validation of a request model.
A bare ValueError or TypeError is the server's own failure, whatever its message says.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from contracts.errors import OmniError, QueueFullError, describe_validation_error
from contracts.http import is_request_error

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class HTTPError:
    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def cause_of(exc: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (RayTaskError keeps it as `.cause`)."""
    from ray.exceptions import RayTaskError

    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def _retry_after(seconds: float | None) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds or 1)))}


def client_error(errors: Sequence[Mapping[str, Any]], root: tuple[str, ...] = ()) -> HTTPError:
    """A 400 for pydantic errors (a request body FastAPI validated has `root=("body",)`)."""
    message, param, code = describe_validation_error(errors, root=root)
    return HTTPError(400, "invalid_request_error", message, param, code)


def http_error(exc: BaseException) -> HTTPError:
    """Map any exception raised while serving a request (here or in a replica) to its HTTP error."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    exc = cause_of(exc)
    if isinstance(exc, QueueFullError):
        return HTTPError(503, exc.error_type, exc.message, exc.param, exc.code, _retry_after(exc.retry_after_s))
    if isinstance(exc, OmniError):
        return HTTPError(exc.status_code, exc.error_type, exc.message, exc.param, exc.code)
    if isinstance(exc, BackPressureError):
        return HTTPError(
            503,
            "server_overloaded",
            f"the server is busy: {exc.message} Retry shortly.",
            code="queue_full",
            headers=_retry_after(exc.retry_after_s),
        )
    if isinstance(exc, ValidationError) and is_request_error(exc):
        return client_error(exc.errors(include_url=False))
    if isinstance(exc, ClientDisconnect):  # nobody reads the answer; not the server's failure either
        return HTTPError(
            400, "invalid_request_error", "the client disconnected before its body was read", code="client_disconnected"
        )
    if isinstance(exc, HTTPException):
        # Routing errors from FastAPI itself: unknown path (404), wrong method (405).
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        # Its headers kept: a 405 names the methods the route takes (`Allow`), as RFC 9110 requires.
        return HTTPError(exc.status_code, kind, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    if isinstance(exc, TimeoutError):
        return HTTPError(504, "timeout", "the request did not finish within the server's time limit", code="timeout")
    if isinstance(
        exc, (DeploymentUnavailableError, ReplicaUnavailableError, ActorDiedError, ActorUnavailableError)
    ) or (
        type(exc).__name__ in ("EngineDeadError", "NodeDiedError")  # vLLM's engine core, or a node, is gone
    ):
        return HTTPError(
            503,
            "server_unavailable",
            "a stage is unavailable; retry shortly",
            code="stage_unavailable",
            headers=_retry_after(5),
        )
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return HTTPError(500, "server_error", "internal server error (logged on the server)", code="internal_error")
