"""Draining before the app stops: what SIGTERM to the app process (`cli.run`, what `make serve` runs) sets off.

Serve's own shutdown (`serve.shutdown`, what Ctrl-C runs) stops the HTTP proxies with the replicas, so a request in
flight is cut. Draining comes first: the app process writes DRAINING into Ray's internal KV; every ingress replica
reads it within POLL_S (`Drain.watch`) and from then answers each new request 503 (`code: shutting_down`,
`Retry-After`, `Connection: close`; a load balancer's /health probe too), while every request it admitted runs to its
end, through both stages, unchanged. Once none is left it writes DRAINED_PREFIX + its replica id; the app process
(`wait_drained`) waits for as many as the app has ingress replicas, or its bound, and only then removes the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from .errors import HTTPError

logger = logging.getLogger("ray.serve")

NAMESPACE = "omniserve"
DRAINING = b"draining"
DRAINED_PREFIX = b"drained/"
#: How often an ingress replica reads the flag: the longest a new request may still be admitted after SIGTERM.
POLL_S = 0.2

SHUTTING_DOWN = HTTPError(
    503,
    "server_unavailable",
    "the server is shutting down and admits no new request; retry shortly (elsewhere)",
    code="shutting_down",
    headers={"Retry-After": "5", "Connection": "close"},
)


def _kv_get(key: bytes) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=NAMESPACE)


def _kv_put(key: bytes, value: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


class Drain:
    """One ingress replica's part: whether the app drains (read from the KV by `watch`), what is in flight."""

    def __init__(self, replica: str):
        self.replica = replica
        self.in_flight = 0
        self.draining = False

    def start(self) -> None:
        """Watch from now on (the replica's constructor runs on its event loop; outside one, nothing to watch)."""
        try:
            self._watching = asyncio.get_running_loop().create_task(self.watch())
        except RuntimeError:
            pass

    async def watch(self) -> None:
        """Read the flag every POLL_S; once draining and idle, say so (once)."""
        while not self.draining:
            await asyncio.sleep(POLL_S)
            self.draining = await asyncio.to_thread(_kv_get, DRAINING) is not None
        logger.info("draining: no new request admitted; %d in flight", self.in_flight)
        while self.in_flight:
            await asyncio.sleep(POLL_S)
        await asyncio.to_thread(_kv_put, DRAINED_PREFIX + self.replica.encode(), b"1")
        logger.info("drained: every admitted request answered")


class DrainGate:
    """Pure ASGI middleware: refuses new requests once the app drains, counts the admitted ones to their end."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await _refuse(send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)  # a stream counts until its last event is sent
        finally:
            self.drain.in_flight -= 1


async def _refuse(send) -> None:
    body = json.dumps(SHUTTING_DOWN.body()).encode()
    headers = {**SHUTTING_DOWN.headers, "Content-Type": "application/json", "Content-Length": str(len(body))}
    await send(
        {
            "type": "http.response.start",
            "status": SHUTTING_DOWN.status,
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --- the app process's side ---------------------------------------------------------------------------------


def start_draining() -> None:
    _kv_put(DRAINING, b"1")


def wait_drained(ingress_replicas: int, timeout_s: float, log: Callable[[str], None]) -> bool:
    """Wait until every ingress replica (`ingress_replicas`: how many ran when the drain began; none starts during
    one) has drained; False past timeout_s."""
    from ray.experimental.internal_kv import _internal_kv_list

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        drained = len(_internal_kv_list(DRAINED_PREFIX, namespace=NAMESPACE))
        if drained >= ingress_replicas:
            log(f"drained: {drained} ingress replica(s) answered every request they admitted")
            return True
        time.sleep(POLL_S)
    log(f"not drained within {timeout_s:g} s: the requests still in flight are cut")
    return False
