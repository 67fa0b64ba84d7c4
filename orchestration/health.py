"""`GET /health`: each stage's state, decided from facts, showing nothing an outsider should not see.

The facts: Serve's replica states (RUNNING replicas against the configured number) and the replicas' own
descriptions (`describe()`: the engine alive and not stuck, the switch, the kernels). A Serve handle cannot
address a replica, so the probe sends two describe() calls per RUNNING replica at once and keeps one answer per
replica: the router spreads concurrent calls, so usually every replica answers (best effort). A stage is

    running   as many replicas RUNNING as configured, and no replica that answered has a fault;
    degraded  it still serves, with less: fewer replicas RUNNING than configured, or some answered with a
              fault while others serve, or none answered in time although Serve runs some;
    down      it cannot serve: no replica RUNNING (none started yet, or all refused to start, e.g. invariance
              on without kernels), or every RUNNING replica has a fault.

A fault of a replica: its engine is not running (vLLM's engine core died; the diffusion compute thread is
gone or stuck), it runs with another switch than the app gave it, or invariance is on and its kernels are
not installed. A stage scaled to zero by its autoscaling config is `running` (its first request starts a
replica); the probe never asks a stage with no replica RUNNING, so it never scales one up.

Each stage also says whether its replicas run inside the verified scope (`verified`, and per replica `scope`: the
replica's verdict and, when unverified, the nearest audit record's differences; contracts/scope.py). That is
information, not a fault: an unverified replica serves (a strict one never starts).

The app's `status` is "ok" when every stage is running, "degraded" (still HTTP 200) when some stage serves
with less, "down" (HTTP 503) when some stage cannot serve. `reasons` says why, per stage.

What /health shows of a replica is a list of known-harmless details (`PUBLIC_DETAILS`), with every absolute
path in its text cut to its last part (`redact`): no model path, engine argument or spawn environment (they
can hold tokens or the site's layout). describe() through a Serve handle still has them, for operators.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any, Literal, cast

from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from contracts.config import DeploymentConfig, StageConfig
from contracts.invariance import Switches
from contracts.results import StageDescription
from contracts.scope import Verdict

from .config import DEPLOYMENT_NAMES, AppConfig
from .errors import http_error

StageState = Literal["running", "degraded", "down"]
#: What the probe learnt from a stage's replicas: one description per replica that answered, the error when
#: none did, None when none was asked (no replica RUNNING).
Answers = list[StageDescription] | BaseException | None
#: The replica details /health shows (the rest, e.g. model_path, engine_args, invariance, stay in describe()).
PUBLIC_DETAILS = (
    "device",
    "torch_threads",
    "embedded",
    "vllm_version",
    "startup_s",
    "defaults",
    "capabilities",  # what the model can render (contracts.admission), as admission and the OpenAPI document read it
    "batching",
    "problem",
    "in_flight",
    "requests_in_engine",
    "parallel",  # a diffusion replica's group: its degrees and workers (pid, node, device, threads, kernels, rows)
)
#: An absolute POSIX path (or ~/...) not inside a URL or a relative name; group 1 is its last part.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])~?/(?:[^\s/'\"`,;:()\[\]{}<>]+/)*([^\s/'\"`,;:()\[\]{}<>]+)")
_MESSAGE_CHARS = 500
#: The most describe() calls /health sends one stage at once.
MAX_DESCRIBE_CALLS = 16


class StageHealth(BaseModel):
    state: StageState
    reasons: list[str] = []  # the facts behind a state other than running (and a scaled-to-zero note)
    batch_invariant: bool  # as the app gave it
    model: str | None = None
    kernel_backend: str | None = None
    kernels_installed: bool | None = None
    kernels: Any = None
    describe: dict[str, Any] | None = None  # one answering replica: id, running, its public details
    replicas_described: int | None = None  # how many replicas answered describe()
    replicas: dict[str, Any] | None = None
    # Every replica that answered runs a configuration an audit record covers (contracts/scope.py); per replica,
    # its verdict and, when unverified, why. Informative: an unverified replica still serves (unless strict).
    verified: bool | None = None
    scope: dict[str, Verdict] | None = None
    # Per replica, its start-up self-audit (stages/diffusion/self_audit.py, stages/llm/self_audit.py): mode, runs,
    # seconds, whether the control varied, the differing cases, the record written or reused; null where it ran none
    # (invariance off, self_audit off, an LLM on CUDA).
    self_audit: dict[str, Any] | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "degraded", "down"]
    batch_invariant: Switches
    stages: dict[str, StageHealth]
    ingress: dict[str, Any]

    @property
    def http_status(self) -> int:
        """200 while every stage serves (degraded included), 503 when one cannot."""
        return 503 if self.status == "down" else 200


def redact(value: Any) -> Any:
    """`value` with every absolute path in its strings cut to its last part (`/home/me/models/x` -> `.../x`)."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(lambda m: f".../{m.group(1)}", value)
    if isinstance(value, Mapping):
        return {key: redact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item) for item in value]
    return value


def last_line(message: str) -> str:
    """The last non-empty line of a message (of a traceback: the exception), redacted and bounded."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return redact(lines[-1][:_MESSAGE_CHARS]) if lines else ""


def replica_faults(switch: bool, info: StageDescription) -> list[str]:
    """What keeps the replica that answered describe() from serving what the app promises."""
    name = f"replica {info.replica}" if info.replica else "the replica"
    faults = []
    if not info.running:
        problem = info.details.get("problem")
        faults.append(f"{name}: its engine is not running" + (f" ({redact(problem)})" if problem else ""))
    if info.batch_invariant != switch:
        faults.append(f"{name} runs with batch_invariant={info.batch_invariant}, the app gave it {switch}")
    if switch and not info.kernels_installed:
        faults.append(f"{name}: batch invariance is on but its kernels are not installed")
    return faults


def wanted_replicas(config: DeploymentConfig) -> int:
    """The replicas a stage should have running: num_replicas, or the autoscaling minimum (Serve's default 1)."""
    if config.autoscaling_config is not None:
        return int(config.autoscaling_config.get("min_replicas", 1))
    return config.num_replicas or 1


def judge(switch: bool, wanted: int, replicas: Mapping[str, Any], answers: Answers) -> tuple[StageState, list[str]]:
    """A stage's state and the facts behind it.

    `replicas`: Serve's counts (`running` absent when Serve's status could not be read, `message` its status
    message); `answers`: one describe() per replica that answered, the error when none did, None when none was asked.
    """
    running = replicas.get("running")
    reasons = []
    if running is not None and running < wanted:
        why = f" ({replicas['status']}: {replicas['message']})" if replicas.get("message") else ""
        reasons.append(f"{running} of {wanted} replicas running{why}")
    if running == 0:
        return ("running", ["scaled to zero: the first request starts a replica"]) if wanted == 0 else ("down", reasons)
    if isinstance(answers, BaseException):
        reasons.append(f"no replica answered describe(): {redact(http_error(answers).message)}")
        return ("degraded" if running else "down"), reasons
    faults = [replica_faults(switch, answer) for answer in answers or []]
    serving = max(running or 0, len(answers or []), 1) - sum(bool(f) for f in faults)
    reasons += [fault for replica in faults for fault in replica]
    return ("down" if serving <= 0 else "degraded" if reasons else "running"), reasons


def stage_health(switch: bool, wanted: int, replicas: dict[str, Any], answers: Answers) -> StageHealth:
    state, reasons = judge(switch, wanted, replicas, answers)
    health = StageHealth(state=state, reasons=reasons, batch_invariant=switch, replicas=replicas)
    if answers and not isinstance(answers, BaseException):
        answer = answers[0]
        health = health.model_copy(
            update=dict(
                model=redact(answer.model),
                kernel_backend=answer.kernel_backend,
                kernels_installed=answer.kernels_installed,
                kernels=redact(answer.kernels),
                describe={
                    "replica": answer.replica,
                    "running": answer.running,
                    "details": redact({k: v for k, v in answer.details.items() if k in PUBLIC_DETAILS}),
                },
                replicas_described=len(answers),
                verified=all(a.verified for a in answers),
                scope={
                    a.replica or "unknown": Verdict(
                        verified=a.verified, differences=redact(a.scope_differences), by=redact(a.verified_by)
                    )
                    for a in answers
                },
                self_audit={a.replica or "unknown": redact(a.details.get("self_audit")) for a in answers},
            )
        )
    return health


class HealthProbe:
    def __init__(self, handles: Mapping[str, DeploymentHandle], config: AppConfig):
        self.handles = handles  # each stage's describe(): "llm", "diffusion", and "video" where the app serves videos
        self.config = config

    async def describe(self, stage: str) -> StageDescription:
        return await asyncio.wait_for(self.handles[stage].describe.remote(), self.config.ingress.health_timeout_s)

    async def describe_replicas(self, stage: str, running: int | None) -> list[StageDescription] | BaseException:
        """One description per replica that answered (two calls per RUNNING replica, at once), else the error."""
        calls = min(2 * (running or 1), MAX_DESCRIBE_CALLS)
        results = await asyncio.gather(*(self.describe(stage) for _ in range(calls)), return_exceptions=True)
        found = {result.replica: result for result in results if isinstance(result, StageDescription)}
        return list(found.values()) or next(r for r in results if isinstance(r, BaseException))

    async def report(self) -> HealthResponse:
        replicas = await asyncio.to_thread(self.replica_counts)
        asked = [
            stage for stage in self.handles if replicas[stage].get("running") != 0
        ]  # never wake one scaled to zero
        described = [self.describe_replicas(stage, replicas[stage].get("running")) for stage in asked]
        answers = dict(zip(asked, await asyncio.gather(*described), strict=True))
        # A describe can wait up to health_timeout_s (a replica busy or dying): the states reported are Serve's as of
        # the answers, not as of the ask (seen: an answer 13 s late still said "running" after an engine core died).
        replicas = await asyncio.to_thread(self.replica_counts)
        stages = {
            stage: stage_health(
                bool(cast(StageConfig, self.config.deployment(stage)).batch_invariant),  # resolved: a bool
                wanted_replicas(self.config.deployment(stage)),
                replicas[stage],
                answers.get(stage),
            )
            for stage in self.handles
        }
        states = {health.state for health in stages.values()}
        return HealthResponse(
            status="down" if "down" in states else "degraded" if "degraded" in states else "ok",
            batch_invariant=self.config.switches,
            stages=stages,
            ingress={"replicas": replicas["ingress"]},
        )

    def replica_counts(self) -> dict[str, dict]:
        """Configured and running replicas per deployment, from Serve's status (config alone if unavailable)."""
        counts: dict[str, dict[str, Any]] = {
            part: {"configured": self.config.deployment(part).configured_replicas} for part in self.config.parts
        }
        try:
            app = serve.status().applications[serve.get_replica_context().app_name]
            for part in self.config.parts:
                deployment = app.deployments.get(DEPLOYMENT_NAMES[part])
                if deployment is not None:
                    states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                    status = str(getattr(deployment.status, "value", deployment.status))
                    counts[part].update(running=states.get("RUNNING", 0), states=states, status=status)
                    if status != "HEALTHY" and deployment.message:
                        counts[part]["message"] = last_line(deployment.message)
        except Exception as exc:  # status is informative; health still answers from the describe() calls
            for part in counts:
                counts[part]["status_error"] = type(exc).__name__
        return counts
