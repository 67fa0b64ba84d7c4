"""What a replica admits: a RenderJob into the Job it renders, or a typed error naming the field.

Every field is admitted once in this process, as the ingress admits a body (a job can be built without validation,
and nothing that crosses an actor boundary is trusted): prompt and params with `contracts.admission`'s functions, the
rest by the RenderJob model itself, then what this model and this replica can render (`DiffusionRenderer.resolve`). A
checkpoint to resume from is taken only where this replica's identity made it (`engine.checkpoint.made_by`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import cast

from pydantic import ValidationError

from contracts.admission import admit_diffusion_params, admit_prompt
from contracts.errors import InvalidRequestError, invalid_request
from contracts.images import admit_image, edit_size
from contracts.jobs import RenderJob
from contracts.results import RenderCheckpoint
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion.engine.img2img import edit_steps, strength_of
from stages.diffusion.engine.sample import preview_steps

from .renderer import DiffusionRenderer, Job

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Admission:
    """One replica's admission rules: its renderer, its switch, whether it runs the step engine, its identity (what
    a checkpoint it resumes must have been made by, `stages.diffusion.engine.checkpoint.made_by`)."""

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
