"""The diffusion stage's Ray Serve deployment: one entry point, `render(RenderJob)` (`contracts.jobs`), for
generations, edits and streams alike.

Admission (`contracts.admission`), a bounded number of requests in flight, the previews a job asks for (the step
engine's), then PNG bytes (their text chunks record how they were made: `contracts.provenance`), their sha256 and
provenance as a `RenderedImage`; its health check fails when the compute thread is gone or one step has run past
`stuck_after_s`. Nothing here knows about HTTP; errors are typed (`contracts.errors`) for the ingress to map.

What a replica admits (`Admission`): a RenderJob into the Job it renders, or a typed error naming the field. Every
field is admitted once in this process, as the ingress admits a body (a job can be built without validation, and
nothing that crosses an actor boundary is trusted): prompt and params with `contracts.admission`'s functions, the
rest by the RenderJob model itself, then what this model and this replica can render (`DiffusionRenderer.resolve`).
A checkpoint to resume from is taken only where this replica's identity made it (`engine.sample.made_by`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from pydantic import ValidationError
from ray import serve

from contracts.admission import admit_diffusion_params, admit_prompt
from contracts.config import DiffusionStageConfig
from contracts.errors import InvalidRequestError, QueueFullError, invalid_request
from contracts.images import admit_image, edit_size
from contracts.invariance import resolve_batch_invariant
from contracts.jobs import RenderJob
from contracts.provenance import ImageRecord
from contracts.results import Provenance, RenderCheckpoint, RenderedImage, StageDescription, rendered_params
from contracts.sampling import DiffusionSamplingParams
from stages import replica_id
from stages.diffusion.engine.img2img import edit_steps, strength_of
from stages.diffusion.engine.sample import preview_steps
from stages.metrics import image_counted, record_switch_state, timed_stage_call
from stages.scope import diffusion_configuration, diffusion_scope

from .batching import Finished, RequestBatching, StepBatching, updates_then_result
from .engine.sample import made_by
from .group import start_group
from .renderer import DiffusionRenderer, Job, check_serves, encode_png
from .self_audit import self_audit
from .self_check import diffusion_self_check

# What a replica admits: a RenderJob into the Job it renders, or a typed error naming the field.

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Admission:
    """One replica's admission rules: its renderer, its switch, whether it runs the step engine, its identity (what
    a checkpoint it resumes must have been made by, `stages.diffusion.engine.sample.made_by`)."""

    renderer: DiffusionRenderer
    batch_invariant: bool
    step_engine: bool
    identity: str = ""

    def job(self, job: RenderJob) -> Job:
        """The admitted Job of a generation or edit, with its origin and the steps of its previews."""
        if not isinstance(job, RenderJob):
            raise InvalidRequestError(
                f"the diffusion stage renders a RenderJob, not {type(job).__name__}", code="invalid_type"
            )
        prompt = admit_prompt(job.prompt)
        params = admit_diffusion_params(job.params, batch_invariant=self.batch_invariant)
        try:
            job = RenderJob.model_validate({**dict(job), "prompt": prompt, "params": params})
        except ValidationError as err:
            raise invalid_request(err) from None
        if job.image is not None:
            admitted = self._edit(job.prompt, job.image, job.params)
            assert self.renderer.family is not None  # `_edit` refuses an edit without the step engine
            # Resolved params: steps and strength are set.
            steps = edit_steps(
                self.renderer.family,
                cast(int, admitted.params.num_inference_steps),
                cast(float, admitted.params.strength),
            )
        else:
            admitted = self._generation(job.prompt, job.params)
            steps = cast(int, admitted.params.num_inference_steps)
        return replace(
            admitted,
            origin=job.origin,
            previews=preview_steps(steps, job.partial_images),
            checkpoint_every=job.checkpoint_every if self.step_engine else 0,
            resume=self.resumable(job.resume),
        )

    def resumable(self, checkpoint: RenderCheckpoint | None) -> bytes | None:
        """The state to go on from: a checkpoint this replica's identity made (the same bits from there on); one of
        another identity, or none, starts the render at its first step (the same bytes, later)."""
        if checkpoint is None:
            return None
        if not self.step_engine or not self.identity or checkpoint.made_by != self.identity:
            logger.warning(
                "a checkpoint after step %d is another configuration's: rendered from the first step", checkpoint.step
            )
            return None
        return checkpoint.state

    def _generation(self, prompt: str, params: DiffusionSamplingParams) -> Job:
        """A text-to-image request (admitted by `job`); nothing is dropped or replaced (a strength is refused, never
        ignored)."""
        if params.strength is not None:
            raise InvalidRequestError(
                "strength applies to edits (an input image) only", param="strength", code="unsupported_value"
            )
        return Job(prompt, self.renderer.resolve(params, step_engine=self.step_engine))

    def _edit(self, prompt: str, image: bytes, params: DiffusionSamplingParams) -> Job:
        """An edit (admitted by `job`) with its init image (`contracts.images`), rendered at the image's own size: a
        requested size must be the image's; none requested, the image's."""
        if not self.step_engine:
            raise InvalidRequestError(
                f"image edits are not served for {self.renderer.model}: the step engine does not know its pipeline",
                param="image",
                code="unsupported_value",
            )
        picture = admit_image(image)
        width, height = edit_size(picture, params.width, params.height)
        if params.latents is not None:
            raise InvalidRequestError(
                "latents cannot be given with an image: the image decides the initial latents", param="latents"
            )
        resolved = self._edit_params(params.model_copy(update={"width": width, "height": height}))
        return Job(prompt, resolved, image=self.renderer.pipe.image_processor.preprocess(picture), source=image)

    def _edit_params(self, params: DiffusionSamplingParams) -> DiffusionSamplingParams:
        resolved = self.renderer.resolve(params.model_copy(update={"strength": strength_of(params)}), step_engine=True)
        assert self.renderer.family is not None  # called by `_edit`, after its step-engine check
        steps, strength = cast(int, resolved.num_inference_steps), cast(float, resolved.strength)  # resolved: set
        if edit_steps(self.renderer.family, steps, strength) < 1:
            raise InvalidRequestError(
                f"strength {resolved.strength} leaves none of {resolved.num_inference_steps} steps to run; "
                "raise strength or num_inference_steps",
                param="strength",
                code="out_of_range",
            )
        return resolved


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
