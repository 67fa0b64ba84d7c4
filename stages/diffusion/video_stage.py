"""The video stage's Ray Serve deployment: the diffusion stage's replica (renderer, step engine, admission, verified
scope, kernels) serving a video family (Wan, `stages.diffusion.engine.families.WanFamily`), as its own deployment.

Its own deployment rather than a diffusion deployment's second model: a video holds the engine for many times an
image's time (frames x pixels per step), so a queue shared with images would put every image behind it, and the two
scale on different signals; a separate deployment has its own replicas, queue bound and switch, and the image stage is
untouched. The class is the diffusion stage's, so everything an image has (admission, provenance, the scope verdict,
health, cancellation at the next step) a video has too.

    render(RenderJob)  RenderProgress after each denoising step (and a RenderCheckpoint every `job.checkpoint_every`,
                       from which `job.resume` goes on: `orchestration.video_jobs`), then the RenderedVideo: an MP4
                       through the pinned encoder (`stages.diffusion.video_file`), its provenance in the container's
                       `comment` tag
    admit(RenderJob)   the params it would render with (frames, size, steps resolved), or the typed 4xx: the Videos API
                       answers a bad request before it queues a job
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from typing import cast

from ray import serve

from contracts.config import VideoStageConfig
from contracts.jobs import RenderJob
from contracts.results import RenderedVideo, rendered_params
from contracts.sampling import DiffusionSamplingParams

from .batching import Finished, StepBatching, updates_then_result
from .engine.families import WanFamily
from .renderer import Job, ModelDirectoryError
from .stage import DiffusionStage
from .video_file import encode_mp4, to_uint8


@serve.deployment
class VideoStage(DiffusionStage.func_or_class):  # type: ignore[name-defined]  # the class under the Deployment
    def __init__(self, config: VideoStageConfig | Mapping | None = None):
        config = VideoStageConfig.model_validate(config if config is not None else {})
        if config.batching != "step":
            raise ModelDirectoryError("the video stage renders on the step engine only: set batching to 'step'")
        super().__init__(config)
        if not isinstance(self.batching, StepBatching):  # a video pipeline the step engine has no family for
            raise ModelDirectoryError(
                f"video model {self.renderer.model!r} is a {type(self.renderer.pipe).__name__}, which the step engine "
                "does not drive (it drives WanPipeline)"
            )

    async def render(self, job: RenderJob):
        """A video job as a stream: its progress after each step, then its RenderedVideo. Call it through a handle with
        `options(stream=True)`."""
        made_by = self.admission.identity  # its checkpoints' (`job.checkpoint_every`), which a replica like it resumes
        async for item in updates_then_result(self._render, self._job(job), progress=True, made_by=made_by):
            yield item

    async def admit(self, job: RenderJob) -> DiffusionSamplingParams:
        """The resolved params `job` would render with; raises what `render` would refuse it for."""
        return self._job(job).params

    def _job(self, job: RenderJob) -> Job:
        admitted = super()._job(job.model_copy(update={"partial_images": 0}))  # a video shows progress, not previews
        frames = cast(WanFamily, self.renderer.family).frames(admitted.params)  # the model's rule (Wan: 4k + 1)
        self.config.check_frames(frames)
        return replace(admitted, params=admitted.params.model_copy(update={"num_frames": frames}))

    def _rendered(self, finished: Finished) -> RenderedVideo:  # a video, not an image
        """A finished render as its MP4, the record of how it was made in its `comment` tag."""
        job, frames = finished.job, finished.pixels
        provenance, record = self._made(job)
        mp4 = encode_mp4(frames, fps=self.config.fps, provenance=record.canonical())
        pixels = to_uint8(frames)
        return RenderedVideo(
            mp4=mp4,
            sha256=hashlib.sha256(mp4).hexdigest(),
            frames_sha256=hashlib.sha256(pixels.tobytes()).hexdigest(),
            num_frames=len(pixels),
            fps=self.config.fps,
            **rendered_params(job.params),
            batch_size=finished.batch_size,
            steps_co_batched=finished.steps_co_batched,
            steps_computed=finished.steps_computed,
            **provenance.model_dump(),
            replica=self.replica,
        )
