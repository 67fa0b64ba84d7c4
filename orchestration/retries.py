"""Idempotent retries: a stage call that failed for an infrastructure reason is sent again, to another replica.

A request's bytes are a pure function of its params and seed (both stages run with the image's own seed, and
the kernels make the batch irrelevant), so re-running a call on another replica gives exactly the bytes the
client would have got from the first one. The ingress sends again failures of the infrastructure only (a replica
or its actor died, a node died, a replica is unavailable, the LLM engine inside a replica is dead), never a client
error. With a stage's invariance off a retry is still a sample of the same seed, but it may be batched differently
and so differ in the last bits from what the first attempt would have returned.

Bounded by time, not by count: a failed call is sent again until `window_s` after its first failure (and always
within the request's own deadline, `ingress.request_timeout_s`, which cancels it), waiting `backoff_s`, then twice
as long each time up to MAX_BACKOFF_S, each wait jittered to between half and all of it (so the calls a dead replica
failed together do not all return together). Counted retries lost requests: 4 attempts in 3 s ran out while Serve
still routed to the replica just killed (a 503 with the other replica alive, tests/reliability/test_replica_loss.py).

What Serve 2.60 offers for "another replica": no per-call exclusion on a DeploymentHandle. Its router drops a replica
that answered a call with ActorDiedError from its own set at once (`on_replica_actor_died`) and routes the calls it
had not yet placed elsewhere itself; ActorUnavailableError only invalidates the replica's queue-length cache, so the
router probes it again before using it; the controller's health check (`health_check_period_s`,
`health_check_timeout_s`) replaces the replica. The window is sized to outlast both (the default 60 s > Serve's
default 10 s period + 30 s timeout), and the backoff spaces the calls sent meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from stages.metrics import record

from .errors import cause_of

logger = logging.getLogger("ray.serve")
T = TypeVar("T")
#: Failures inside a replica that mean "this replica cannot serve", not "this request is wrong".
DEAD_ENGINE_ERRORS = frozenset({"EngineDeadError", "EngineGenerateError"})


def is_infrastructure_failure(exc: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, NodeDiedError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    exc = cause_of(exc)
    # ReplicaUnavailableError is not a RayActorError: Serve raises it for a call whose replica died under it (the
    # replica-loss test's rare 503 was one, measured).
    infrastructure = (
        RayActorError,
        ActorUnavailableError,
        NodeDiedError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )
    return isinstance(exc, infrastructure) or type(exc).__name__ in DEAD_ENGINE_ERRORS


class Retrying:
    """Sends a call again after an infrastructure failure until `window_s` after its first failure (0: never), the
    waits between starting at `backoff_s`, doubling up to MAX_BACKOFF_S, jittered (`jitter`: a draw in [0, 1))."""

    def __init__(self, window_s: float, backoff_s: float, *, jitter: Callable[[], float] = random.random):
        self.window_s, self.backoff_s, self.jitter = window_s, backoff_s, jitter
        self.retried = 0  # calls sent again since start, for /health
        self.moved = 0  # streamed calls sent again because their replica handed them off (it was stopping)

    async def call(self, what: str, send: Callable[[], Awaitable[T]]) -> T:
        failures = _Failures(self, what)
        while True:
            try:
                return await send()
            except Exception as exc:
                await failures.again_or_raise(exc)

    async def stream(
        self,
        what: str,
        send: Callable[[], AsyncIterable[T]],
        *,
        restart: bool = False,
        last: Callable[[T], bool] = lambda _: False,
        moved: Callable[[T], bool] = lambda _: False,
    ) -> AsyncIterator[T]:
        """A streamed call's items, sent again after an infrastructure failure only while none has come: once an
        item is on its way to the client, a second attempt would repeat it. `restart`: sent again whatever has come,
        its items then coming again from the first (a caller that keeps only the latest, as a video job's progress).
        `last(item)`: the stream's final item, after which its end is not awaited (a replica killed between its last
        item and its end of stream failed a call whose answer had come: a 503, seen in the replica-loss loop).
        `moved(item)`: the replica handed the call off (it is stopping): yielded, so that the caller's next `send()`
        goes on from where it was, then sent again after a short wait (Serve routes it elsewhere meanwhile)."""
        failures = _Failures(self, what)
        while True:
            started = False
            try:
                async for item in send():
                    yield item
                    if moved(item):
                        break
                    started = True
                    if last(item):
                        return
                else:
                    return
            except Exception as exc:
                if started and not restart:
                    raise
                await failures.again_or_raise(exc)
                continue
            self.moved += 1
            record("omniserve_retries_total", call=what, cause="handed off")
            await asyncio.sleep(self.wait_s(1))

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1, 2, ...): exponential, capped, then between half and all of it."""
        full = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (retry - 1))
        return full * (0.5 + 0.5 * self.jitter())


#: The longest wait between two sends of one call: long enough not to hammer a stage that is restarting, short
#: enough that a replacement replica is used within a second or two of its start.
MAX_BACKOFF_S = 2.0


class _Failures:
    """One call's failures so far: when the first came, how many were sent again."""

    def __init__(self, retrying: Retrying, what: str):
        self.retrying, self.what = retrying, what
        self.first: float | None = None
        self.retries = 0

    async def again_or_raise(self, exc: Exception) -> None:
        """Return (after the backoff) when the failed call is to be sent again; else raise `exc`."""
        now = time.monotonic()
        self.first = now if self.first is None else self.first
        wait = self.retrying.wait_s(self.retries + 1)
        if not is_infrastructure_failure(exc) or now + wait - self.first > self.retrying.window_s:
            raise exc
        self.retries += 1
        self.retrying.retried += 1
        cause = type(cause_of(exc)).__name__
        record("omniserve_retries_total", call=self.what, cause=cause)
        logger.warning(
            "%s failed (%s); sending it again in %.2f s (retry %d, %.1f s of %.0f s used)",
            self.what,
            cause,
            wait,
            self.retries,
            now - self.first,
            self.retrying.window_s,
        )
        await asyncio.sleep(wait)
