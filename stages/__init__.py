"""What runs inside the stage actors: kernels, the diffusion and LLM stages, embedded models, the start-up self-check
(audits, recorders and training are drivers: evidence/, training/)."""

from __future__ import annotations

import threading


def replica_id() -> str:
    """This Serve replica's id (operators and responses name replicas by it)."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests, audit): a process-local name
        return f"local-{threading.get_ident():x}"
