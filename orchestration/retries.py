"""Idempotent retries: a stage call that failed for an infrastructure reason is sent again, to another replica.

A request's bytes are a pure function of its params and seed (both stages run with the image's own seed, and
the kernels make the batch irrelevant), so re-running a call on another replica gives exactly the bytes the
client would have got from the first one. Ray Serve does not retry in-flight calls; the ingress does, for
failures of the infrastructure only (a replica or its actor died, a node died, a replica is unavailable, the
LLM engine inside a replica is dead), a bounded number of times, inside the request's own deadline. A client
error is never retried. With a stage's invariance off a retry is still a sample of the same seed, but it may
be batched differently and so differ in the last bits from what the first attempt would have returned.
"""

from __future__ import annotations

import asyncio
import logging
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
    """Sends a call again after an infrastructure failure: `attempts` in all, waiting `backoff_s` x attempt between."""

    def __init__(self, attempts: int, backoff_s: float):
        self.attempts, self.backoff_s = attempts, backoff_s
        self.retried = 0  # calls sent again since start, for /health

    async def call(self, what: str, send: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return await send()
            except Exception as exc:
                await self._again_or_raise(what, exc, attempt)
        raise AssertionError("unreachable")

    async def stream(
        self, what: str, send: Callable[[], AsyncIterable[T]], *, restart: bool = False
    ) -> AsyncIterator[T]:
        """A streamed call's items, sent again after an infrastructure failure only while none has come: once an
        item is on its way to the client, a second attempt would repeat it. `restart`: sent again whatever has come,
        its items then coming again from the first (a caller that keeps only the latest, as a video job's progress)."""
        for attempt in range(1, self.attempts + 1):
            started = False
            try:
                async for item in send():
                    started = True
                    yield item
                return
            except Exception as exc:
                if started and not restart:
                    raise
                await self._again_or_raise(what, exc, attempt)

    async def _again_or_raise(self, what: str, exc: Exception, attempt: int) -> None:
        """Return (after the backoff) when the failed call is to be sent again; else raise `exc`."""
        if attempt == self.attempts or not is_infrastructure_failure(exc):
            raise exc
        self.retried += 1
        record("omniserve_retries_total", call=what, cause=type(cause_of(exc)).__name__)
        logger.warning(
            "%s failed (%s); sending it again (attempt %d of %d)",
            what,
            type(cause_of(exc)).__name__,
            attempt + 1,
            self.attempts,
        )
        await asyncio.sleep(self.backoff_s * attempt)
