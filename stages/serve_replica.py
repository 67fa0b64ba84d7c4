"""What the project reads of Ray Serve that Serve does not publish: one home, guarded by the version it was read from.

Serve tells a replica nothing when it starts stopping it (a scale-down, a redeploy, its application deleted): it stops
routing new calls to it, waits for the calls in flight (up to the deployment's `graceful_shutdown_timeout_s`), then
calls `__del__`. Its replica actor sets `_shutting_down` as that begins (Serve 2.60,
`ray/serve/_private/replica.py: Replica._perform_graceful_shutdown`), and only that says it early enough for a
replica to hand its in-flight work to another one instead of finishing it alone (the diffusion stage's step-boundary
hand-off). On another Serve, or outside a replica, `stopping()` says None: the replica then finishes what it has.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ray.serve")

#: The Serve versions whose replica actor was read for `_replica_impl._shutting_down`.
READ_FROM = ("2.60.",)


def _replica_impl() -> Any | None:
    """This process's Serve replica (the object that drains it), or None."""
    import ray
    from ray._private import worker

    if not ray.__version__.startswith(READ_FROM) or not ray.is_initialized():
        return None
    actor_id = ray.get_runtime_context().get_actor_id()
    if actor_id is None:
        return None
    actor = getattr(worker.global_worker, "actors", {}).get(ray.ActorID.from_hex(actor_id))
    impl = getattr(actor, "_replica_impl", None)
    return impl if isinstance(getattr(impl, "_shutting_down", None), bool) else None


def serve_namespace() -> str:
    """The Ray namespace `serve run` uses (Serve's own constant)."""
    from ray.serve._private.constants import SERVE_NAMESPACE

    return SERVE_NAMESPACE


def running(deployment: Any) -> int:
    """A deployment's RUNNING replicas, from its `serve.status()` entry (its states are Serve's private enum)."""
    return sum(
        count for state, count in deployment.replica_states.items() if getattr(state, "value", state) == "RUNNING"
    )


class ReplicaLifecycle:
    """Whether Serve has begun stopping this replica, and whether another replica of its deployment runs."""

    def __init__(self) -> None:
        try:
            self._impl = _replica_impl()
        except Exception:  # an unexpected Ray: nothing read, nothing handed off
            logger.exception("could not read this replica's Serve state; in-flight work is finished here on stop")
            self._impl = None

    @property
    def readable(self) -> bool:
        return self._impl is not None

    def stopping(self) -> bool | None:
        """True once Serve began stopping this replica; None where that cannot be read."""
        return None if self._impl is None else bool(self._impl._shutting_down)

    @staticmethod
    def others_running() -> bool:
        """Another replica of this deployment is RUNNING (Serve's controller counts this one STOPPING by now)."""
        from ray import serve

        context = serve.get_replica_context()
        status = serve.status().applications.get(context.app_name)
        deployment = status.deployments.get(context.deployment) if status else None
        return deployment is not None and running(deployment) > 0
