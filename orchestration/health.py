"""`GET /health`: each stage's state from the replicas' own descriptions, the switches, replica counts."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel
from ray import serve

from contracts.invariance import STAGES
from contracts.results import StageDescription

from .config import DEPLOYMENT_NAMES, AppConfig
from .errors import http_error


class StageHealth(BaseModel):
    state: str  # "running", "switch_mismatch" (the replica reports another switch than it was given), "unavailable"
    batch_invariant: bool  # as the app gave it
    model: str | None = None
    kernel_backend: str | None = None
    kernels: Any = None
    describe: dict[str, Any] | None = None
    error: str | None = None
    replicas: dict[str, Any] | None = None


class HealthResponse(BaseModel):
    status: str  # "ok" (200) or "degraded" (503)
    batch_invariant: dict[str, bool]
    stages: dict[str, StageHealth]
    ingress: dict[str, Any]


class HealthProbe:
    def __init__(self, handles: dict[str, Any], config: AppConfig):
        self.handles = handles
        self.config = config

    async def describe(self, stage: str) -> StageDescription:
        return await asyncio.wait_for(self.handles[stage].describe.remote(), self.config.ingress.health_timeout_s)

    async def report(self) -> HealthResponse:
        described = await asyncio.gather(*(self.describe(stage) for stage in STAGES), return_exceptions=True)
        replicas = await asyncio.to_thread(self.replica_counts)
        stages = {}
        for stage, info in zip(STAGES, described):
            switch = self.config.switches[stage]
            if isinstance(info, BaseException):
                stages[stage] = StageHealth(state="unavailable", batch_invariant=switch, error=http_error(info).message)
            else:
                # The replica's own view must match what the app passed it; a mismatch is a failure.
                stages[stage] = StageHealth(
                    state="running" if info.batch_invariant == switch else "switch_mismatch",
                    batch_invariant=switch, model=info.model, kernel_backend=info.kernel_backend,
                    kernels=info.kernels, describe=info.model_dump(),
                )
            stages[stage].replicas = replicas.get(stage)
        return HealthResponse(
            status="ok" if all(s.state == "running" for s in stages.values()) else "degraded",
            batch_invariant=self.config.switches,
            stages=stages,
            ingress={"replicas": replicas.get("ingress")},
        )

    def replica_counts(self) -> dict[str, dict]:
        """Configured and running replicas per deployment, from Serve's status (config alone if unavailable)."""
        counts = {part: {"configured": self.config.deployment(part).configured_replicas} for part in DEPLOYMENT_NAMES}
        try:
            app = serve.status().applications[serve.get_replica_context().app_name]
            for part, name in DEPLOYMENT_NAMES.items():
                deployment = app.deployments.get(name)
                if deployment is not None:
                    states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                    status = str(getattr(deployment.status, "value", deployment.status))
                    counts[part].update(running=states.get("RUNNING", 0), states=states, status=status)
        except Exception as exc:  # status is informative; health still answers from the config
            for part in counts:
                counts[part]["status_error"] = repr(exc)
        return counts
