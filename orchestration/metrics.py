"""The ingress's request metrics: one ASGI middleware around the whole API (names in `contracts.metrics`).

Per request: `omniserve_requests_total` and, for 4xx/5xx, `omniserve_request_errors_total` by route and status
class; `omniserve_request_latency_seconds` until the response's last byte (a stream's last event, not its
headers); `omniserve_requests_in_flight`, this replica's requests being answered. The route is the matched route's
path, so unknown paths share one label instead of growing the series without bound.
"""

from __future__ import annotations

import time
from typing import Any

from contracts.metrics import UNMATCHED_ROUTE, status_class
from stages.metrics import record


def route_of(scope: dict[str, Any]) -> str:
    """The path of the route that answered (Starlette leaves it in the scope), else `UNMATCHED_ROUTE`."""
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED_ROUTE


class RequestMetrics:
    """Pure ASGI (not BaseHTTPMiddleware), so that a streamed response is timed to its end."""

    def __init__(self, app):
        self.app = app
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), 500  # an exception that escapes is answered 500 by Starlette

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self._in_flight(+1)
        try:
            await self.app(scope, receive, sending)
        finally:
            self._in_flight(-1)
            route, label = route_of(scope), status_class(status)
            record("omniserve_requests_total", route=route, status_class=label)
            if label in ("4xx", "5xx"):
                record("omniserve_request_errors_total", route=route, status_class=label)
            record("omniserve_request_latency_seconds", time.monotonic() - started, route=route, status_class=label)

    def _in_flight(self, change: int) -> None:
        self.in_flight += change
        record("omniserve_requests_in_flight", self.in_flight)
