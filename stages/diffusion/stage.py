"""The diffusion stage's Ray Serve deployment: one entry point, `render(RenderJob)` (`contracts.jobs`), for
generations, edits and streams alike.

Admission (`contracts.admission`), a bounded number of requests in flight, the previews a job asks for (the step
engine's), then PNG bytes (their text chunks record how they were made: `contracts.provenance`), their sha256 and
provenance as a `RenderedImage`; its health check fails when the compute thread is gone or one step has run past
`stuck_after_s`. Nothing here knows about HTTP; errors are typed (`contracts.errors`) for the ingress to map.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from typing import Any, cast

from ray import serve

from contracts.config import DiffusionStageConfig
from contracts.errors import QueueFullError
from contracts.invariance import resolve_batch_invariant
from contracts.jobs import RenderJob
from contracts.provenance import ImageRecord
from contracts.results import Provenance, RenderedImage, StageDescription, rendered_params
from contracts.sampling import DiffusionSamplingParams
from stages import replica_id
from stages.metrics import image_counted, record_switch_state, timed_stage_call
from stages.scope import diffusion_configuration, diffusion_scope

from .admission import Admission
from .batching import Finished, RequestBatching, StepBatching, updates_then_result
from .engine.checkpoint import made_by
from .group import start_group
from .renderer import DiffusionRenderer, Job, check_serves, encode_png
from .self_audit import self_audit
from .self_check import diffusion_self_check


@serve.deployment
class DiffusionStage:
    """One pipeline per replica; step-level batching where the engine knows the pipeline, else whole requests."""

    def __init__(self, config: DiffusionStageConfig | Mapping | None = None):
        config = DiffusionStageConfig.model_validate(config if config is not None else {})
        batch_invariant = resolve_batch_invariant("diffusion", override=config.batch_invariant)
        self.config = config.model_copy(update={"batch_invariant": batch_invariant})
        self.batch_invariant = batch_invariant
        self.renderer = DiffusionRenderer(self.config)
        check_serves(type(self.renderer.pipe), self.renderer.model, self.config.serves_video)  # embedded ones too
        # What each image's record says of this stage (every Provenance field, so one added there is written too).
        self.provenance = Provenance(
            model=self.renderer.model,
            batch_invariant=batch_invariant,
            kernel_backend=self.renderer.kernels.backend,
            parallel=self.config.parallel if self.config.parallel.workers > 1 else None,
        )
        self.in_flight = 0
        self.replica = replica_id()
        step = self.renderer.capabilities.per_sample  # the step engine runs where it knows the pipeline
        # One image across several workers: started before the self-check, which then renders through the group.
        self.group = start_group(self.renderer, self.config, step)
        self.batching = (StepBatching if step else RequestBatching)(self.renderer, self.config)
        configuration = diffusion_configuration(self.renderer, self.batching.mode)
        identity = made_by(configuration, batch_invariant)  # whose checkpoints it resumes, and what its own say
        self.admission = Admission(self.renderer, batch_invariant, step_engine=step, identity=identity)
        # Strict: refuses here. A step replica checks itself against the golden table first (a second or so).
        engine = getattr(self.batching, "engine", None)
        check = (
            diffusion_self_check(self.renderer, engine, configuration)
            if batch_invariant and engine is not None
            else None
        )
        # Before traffic (Serve routes to a replica once its constructor returns): prove this configuration here.
        audit = self_audit(
            self.renderer, engine, configuration, config=self.config, replica=self.replica, group=self.group
        )
        self.scope = diffusion_scope(self.renderer, self.config, configuration, self_check=check, self_audit=audit)
        self.provenance = self.provenance.model_copy(update=self.scope.provenance())
        record_switch_state("diffusion", batch_invariant, self.renderer.kernels.backend)
        if self.config.warm_up:
            fewest = DiffusionSamplingParams(seed=0, num_inference_steps=self.renderer.capabilities.min_steps)
            self.batching.warm_up(Job("warm-up", self.renderer.resolve(fewest)))

    async def render(self, job: RenderJob):
        """The stage's one entry point: a generation or (`job.image`) an edit, as a stream of up to
        `job.partial_images` PartialImage previews, then the RenderedImage. Call it through a handle with
        `options(stream=True)`; `contracts.jobs.final_image` takes the image alone.

        Previews come from the step engine only (whole-request batching has no step to show: the image alone)."""
        async for item in updates_then_result(self._render, self._job(job), made_by=self.admission.identity):
            yield item

    def _job(self, job: RenderJob) -> Job:
        admitted = self.admission.job(job)
        # Strict: audited sizes only. The params are resolved: the size is set.
        self.scope.admit(cast(int, admitted.params.width), cast(int, admitted.params.height))
        return admitted

    async def _render(self, job: Job, on_preview=None, on_step=None, on_checkpoint=None) -> Any:
        """Render an admitted job; past `max_queued` requests in flight, QueueFullError."""
        if self.in_flight >= self.config.max_queued:
            raise QueueFullError(
                f"diffusion replica {self.replica} has {self.in_flight} requests in flight; retry shortly"
            )
        method = "generation" if job.image is None else "edit"
        self.in_flight += 1
        try:
            with timed_stage_call("diffusion", method):
                finished = await self.batching.render(job, on_preview, on_step, on_checkpoint)
                # Encoded off the event loop, and off the engine's thread (its next step need not wait for a PNG).
                return image_counted(method, await asyncio.to_thread(self._rendered, finished))
        finally:
            self.in_flight -= 1

    def _made(self, job: Job) -> tuple[Provenance, ImageRecord]:
        """What a finished job's file records: this replica's provenance at the job's size, and the whole record."""
        provenance = self.provenance.model_copy(
            update=self.scope.provenance(self.scope.for_size(cast(int, job.params.width), cast(int, job.params.height)))
        )
        return provenance, ImageRecord.of(job.prompt, job.params, provenance, job.origin, job.source)

    def _rendered(self, finished: Finished) -> RenderedImage:
        """A finished render as its PNG, the record of how it was made in its text chunks."""
        job = finished.job
        provenance, record = self._made(job)
        png = encode_png(finished.pixels, record)
        return RenderedImage(
            png=png,
            sha256=hashlib.sha256(png).hexdigest(),
            **rendered_params(job.params),
            batch_size=finished.batch_size,
            steps_co_batched=finished.steps_co_batched,
            steps_computed=finished.steps_computed,
            **provenance.model_dump(),
            replica=self.replica,
        )

    async def describe(self) -> StageDescription:
        config = self.config
        batching = {
            "mode": self.batching.mode,
            "max_batch_size": config.max_batch_size,
            "batch_wait_timeout_s": config.batch_wait_timeout_s,
            "max_queued": config.max_queued,
            "in_flight": self.in_flight,
            **self.batching.load(),
        }
        problem = await self.problem()
        return StageDescription(
            stage="video" if self.config.serves_video else "diffusion",
            replica=self.replica,
            **self.provenance.model_dump(),  # model, switch, kernel backend, verified scope
            kernels=self.renderer.kernels.to_dict(),
            kernels_installed=self.renderer.kernels.installed,
            running=problem is None,
            details={
                "device": self.renderer.device,
                "torch_threads": self.renderer.torch_threads,
                "pid": os.getpid(),
                "defaults": dict(self.renderer.defaults),
                "batching": batching,
                "loras": self.renderer.loras.names(),  # what a request's `lora` may name here (GET /v1/loras)
                "capabilities": self.renderer.capabilities.model_dump(mode="json"),
                "problem": problem,
                "self_audit": self.scope.self_audit.model_dump() if self.scope.self_audit else None,
                "parallel": self.group.describe(self.renderer) if self.group else None,
            },
        )

    async def problem(self) -> str | None:
        """Why this replica cannot serve: its compute thread is gone or stuck; None when it can."""
        if not self.batching.alive:
            return "the compute thread is gone"
        if self.group is not None and (lost := await self.group.check()):  # every worker asked
            return lost
        busy_s = self.batching.busy_s()
        if busy_s > self.config.stuck_after_s:
            unit = "step" if self.batching.mode == "step" else "batch"
            return f"the compute thread is stuck: one {unit} has run {busy_s:.0f} s (stuck_after_s={self.config.stuck_after_s:g})"
        return None

    async def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; raising makes it replace the replica."""
        problem = await self.problem()
        if problem is not None:
            raise RuntimeError(problem)
