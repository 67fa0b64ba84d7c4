"""The jobs behind OpenAI's Videos API: a video is made in the background while its client polls.

    VideoJobs.create(plan) -> Video     admitted by the video stage first (a bad request is a 4xx, no job made), then
                                        queued: the LLM stage rewrites the prompt (unless `enhance_prompt` is false),
                                        the video stage renders it, `progress` following its steps
    VideoJobs.get(id) -> Video | None   the job as it stands; None once dropped, expired or never made
    VideoJobs.content(id)               the MP4 of a completed job
    VideoJobs.delete(id)                drop it; a job still rendering is cancelled (it leaves the engine at its next
                                        step)

One deployment of one replica, like the image store: Serve's proxy sends a poll to any ingress replica, so the job
must be where every one of them finds it. Bounded: at most `max_jobs` jobs (a new one drops the oldest finished one;
none finished: 503), each kept `ttl_s` after it finished, the MP4s at most `store_mib` (the oldest finished dropped
first; a single MP4 over the bound is kept alone). Ids are 128 random bits and nothing lists other clients' jobs. A
lost replica loses its jobs (Serve starts a new, empty one): the seed and the request reproduce a video bit for bit.

A lost video stage replica costs a job the steps since its last checkpoint: the job keeps its render's latest
step-boundary state (a RenderCheckpoint every `VideoStageConfig.checkpoint_every` steps) and sends it with the render
again; a replica of the same identity goes on from that step (the same bytes), another starts anew.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from contracts.config import VideoStageConfig
from contracts.errors import InvalidRequestError, ModelNotFoundError, NotFoundError, QueueFullError
from contracts.jobs import RenderJob
from contracts.results import RenderCheckpoint, RenderedVideo, RenderMoved, RenderProgress, StageDescription
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams
from contracts.videos import Video, VideoCreateRequest, VideoDeleted, VideoError, clip_seconds

from .config import AppConfig
from .errors import http_error
from .pipeline import ImagePipeline, RewriteCache
from .retries import Retrying

logger = logging.getLogger("ray.serve")

#: Progress while rendering: the steps done, up to this; the encoding and hand-over after the last step take the rest.
RENDERED_PROGRESS = 99


@dataclass(frozen=True)
class VideoPlan:
    """An admitted video request (`admit_video`, called by `VideoFront.create`): the prompt, its rewrite's params
    (None: not rewritten)."""

    prompt: str
    params: DiffusionSamplingParams
    llm_params: LLMSamplingParams | None


def admit_video(request: VideoCreateRequest, config: AppConfig) -> VideoPlan:
    """The serving limits and the seed contract (a missing seed is refused under invariance), as for an image."""
    video = cast(VideoStageConfig, config.video)  # admitted only where the app serves videos
    asked = request.diffusion_params(request.seed, video.fps)
    seed = video.admit(asked, batch_invariant=bool(video.batch_invariant))
    if asked.num_frames is not None:
        video.check_frames(asked.num_frames)
    return VideoPlan(
        prompt=request.prompt,
        params=asked.model_copy(update={"seed": seed}),
        llm_params=config.llm.enhance_params(seed) if request.enhance_prompt else None,
    )


@dataclass
class _Job:
    video: Video
    task: asyncio.Task | None = None
    mp4: bytes = b""
    expires: float | None = None  # time.monotonic() past which it is dropped; None: not finished
    # Its render's last step-boundary state (`VideoStageConfig.checkpoint_every`), sent with the render again when its
    # replica is lost; and the step the last such send asked to go on from, until its first progress says if it did.
    checkpoint: RenderCheckpoint | None = None
    resuming: int | None = None

    def sent(self, render: RenderJob) -> RenderJob:
        """`render` as it is sent now: from its last checkpoint, where it has one."""
        self.resuming = None if self.checkpoint is None else self.checkpoint.step
        return render.model_copy(update={"resume": self.checkpoint})

    def progressed(self, item: RenderProgress) -> bool:
        """Its progress after a step; True where this is a send's first and it went on from the checkpoint sent (its
        first step is then the checkpoint's next; a replica of another identity starts at step 1)."""
        resumed = self.resuming is not None and item.step > self.resuming
        if self.resuming is not None and not resumed:
            logger.warning(
                "video %s: its checkpoint after step %d was not taken, rendered anew", self.video.id, self.resuming
            )
        update = {"resumed_from_step": self.resuming} if resumed else {}
        self.video = self.video.updated(progress=min(RENDERED_PROGRESS, 100 * item.step // item.steps), **update)
        self.resuming = None
        return resumed

    def kept(self, item: RenderCheckpoint | RenderMoved) -> None:
        """Its render's latest state: a checkpoint it streamed, or the one its stopping replica handed off with."""
        state = item if isinstance(item, RenderCheckpoint) else item.checkpoint
        self.checkpoint = state or self.checkpoint

    def finished(self, ttl_s: float, **fields: Any) -> None:
        """Completed or failed (`fields` say which and how): kept `ttl_s` from now, its checkpoint let go."""
        self.checkpoint, self.expires = None, time.monotonic() + ttl_s
        self.video = self.video.updated(completed_at=int(time.time()), expires_at=int(time.time() + ttl_s), **fields)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class VideoJobs:
    def __init__(self, llm: DeploymentHandle, video: DeploymentHandle, config: AppConfig):
        assert config.video is not None  # bound only where the app serves videos
        self.config, self.video = config.video, video
        retrying = Retrying(config.ingress.retry_window_s, config.ingress.retry_backoff_s)
        self.pipeline = ImagePipeline(llm, video, retrying, RewriteCache(config.rewrite_cache_entries))
        self.jobs: OrderedDict[str, _Job] = OrderedDict()  # oldest first
        self.bytes = 0
        self.resumed = 0  # renders that went on from a checkpoint on another replica (not from their first step)

    async def create(self, plan: VideoPlan, model: str) -> Video:
        params = cast(
            DiffusionSamplingParams,
            await self.pipeline.retrying.call(
                "the video stage's admission",
                lambda: self.video.admit.remote(RenderJob(prompt=plan.prompt, params=plan.params)),
            ),
        )
        self._make_room()
        frames, fps = cast(int, params.num_frames), self.config.fps  # resolved: set
        video = Video(
            id=f"video_{secrets.token_hex(16)}",
            created_at=int(time.time()),
            status="queued",
            progress=0,
            model=model,
            prompt=plan.prompt,
            seconds=clip_seconds(frames, fps),
            size=f"{params.width}x{params.height}",
            seed=cast(int, params.seed),
            num_frames=frames,
            fps=fps,
            num_inference_steps=cast(int, params.num_inference_steps),
            batch_invariant=bool(self.config.batch_invariant),
        )
        job = self.jobs[video.id] = _Job(video)
        job.task = asyncio.ensure_future(self._run(job, plan, params))
        return video

    def get(self, video_id: str) -> Video | None:
        self._expire()
        job = self.jobs.get(video_id)
        return None if job is None else job.video

    def content(self, video_id: str) -> tuple[Video, bytes] | None:
        """The job and its MP4 (empty until it completed)."""
        self._expire()
        job = self.jobs.get(video_id)
        return None if job is None else (job.video, job.mp4)

    def delete(self, video_id: str) -> bool:
        self._expire()
        if video_id not in self.jobs:
            return False
        self._drop(video_id)
        return True

    async def describe(self) -> StageDescription:
        """A video stage replica's description, for /health (the ingress reaches the video stage through the jobs)."""
        return await self.video.describe.remote()

    def stats(self) -> dict[str, float]:
        self._expire()
        running = sum(job.expires is None for job in self.jobs.values())
        retried = self.pipeline.retrying.retried  # renders (and rewrites) started again after a replica was lost
        return {
            "jobs": len(self.jobs),
            "running": running,
            "bytes": self.bytes,
            "max_jobs": self.config.max_jobs,
            "retried": retried,
            "resumed": self.resumed,
        }

    async def _run(self, job: _Job, plan: VideoPlan, params: DiffusionSamplingParams) -> None:
        try:
            rewrite, origin = await self.pipeline.origin(plan.prompt, plan.llm_params)
            prompt = rewrite.revised_prompt if rewrite else plan.prompt
            job.video = job.video.updated(status="in_progress", revised_prompt=prompt)
            render = RenderJob(
                prompt=prompt, params=params, origin=origin, checkpoint_every=self.config.checkpoint_every
            )

            def send() -> DeploymentResponseGenerator:
                return cast(
                    DeploymentResponseGenerator, self.video.options(stream=True).render.remote(job.sent(render))
                )

            # A replica lost mid-render: the render goes on on another from its last checkpoint (the same bytes: a
            # function of the request), its progress from there; nothing has reached the client but progress.
            # Handed off (RenderMoved: its replica stopped), it goes on from the step it had reached.
            last, moved = (lambda item: isinstance(item, RenderedVideo)), (lambda item: isinstance(item, RenderMoved))
            async for item in self.pipeline.retrying.stream("a video", send, restart=True, last=last, moved=moved):
                if isinstance(item, RenderProgress):
                    self.resumed += job.progressed(item)
                elif isinstance(item, (RenderCheckpoint, RenderMoved)):
                    job.kept(item)
                else:
                    self._completed(job, cast(RenderedVideo, item))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the job fails; the service goes on
            error = http_error(exc)
            failure = VideoError(
                code=error.code or error.type, message=error.message, param=error.param, type=error.type
            )
            job.finished(self.config.ttl_s, status="failed", error=failure)

    def _completed(self, job: _Job, made: RenderedVideo) -> None:
        while self.bytes + len(made.mp4) > self.config.store_mib << 20 and (oldest := self._oldest_finished()):
            self._drop(oldest)
        job.mp4, self.bytes = made.mp4, self.bytes + len(made.mp4)
        job.finished(
            self.config.ttl_s,
            status="completed",
            progress=100,
            sha256=made.sha256,
            frames_sha256=made.frames_sha256,
            batch_size=made.batch_size,
            steps_co_batched=made.steps_co_batched,
            replica=made.replica,
            verified=made.verified,
            verified_by=made.verified_by or None,
        )

    def _make_room(self) -> None:
        self._expire()
        while len(self.jobs) >= self.config.max_jobs:
            oldest = self._oldest_finished()
            if oldest is None:
                raise QueueFullError(
                    f"{len(self.jobs)} videos are being made, this server's limit (max_jobs); retry once one is done",
                    retry_after_s=5,
                )
            self._drop(oldest)

    def _oldest_finished(self) -> str | None:
        return next((video_id for video_id, job in self.jobs.items() if job.expires is not None), None)

    def _expire(self) -> None:
        now = time.monotonic()
        for video_id in [i for i, job in self.jobs.items() if job.expires is not None and job.expires <= now]:
            self._drop(video_id)

    def _drop(self, video_id: str) -> None:
        job = self.jobs.pop(video_id)
        self.bytes -= len(job.mp4)
        if job.task is not None and not job.task.done():
            job.task.cancel()  # its render stream closes: the sample leaves the engine at its next step


class VideoFront:
    """The ingress's side of the jobs: admission (the model a request names, limits, the seed contract), then the
    jobs deployment's answer; a job it no longer has is a 404 naming `video_id`."""

    def __init__(self, jobs: DeploymentHandle, app: AppConfig):
        self.jobs, self.app, self.config = jobs, app, cast(VideoStageConfig, app.video)

    async def create(self, request: VideoCreateRequest) -> Video:
        """A new video job, admitted here (limits, seed contract) and by the video stage (its model's rules)."""
        served = cast(str, self.config.model)
        if request.model is not None and request.model not in (served, "video"):
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; the video model is {served!r}",
                param="model",
                code="model_not_found",
            )
        return await self.jobs.create.remote(admit_video(request, self.app), served)

    async def get(self, video_id: str) -> Video:
        return cast(Video, await self._job("get", video_id))

    async def content(self, video_id: str) -> tuple[Video, bytes]:
        video, mp4 = await self._job("content", video_id)
        if video.status != "completed":
            raise InvalidRequestError(
                f"video {video_id!r} is {video.status.replace('_', ' ')} ({video.progress}%): its content is there once "
                "its status is completed",
                param="video_id",
                code="video_not_ready",
            )
        return video, mp4

    async def delete(self, video_id: str) -> VideoDeleted:
        await self._job("delete", video_id)
        return VideoDeleted(id=video_id)

    async def _job(self, method: str, video_id: str) -> Any:
        found = await getattr(self.jobs, method).remote(video_id)
        if found is None or found is False:
            raise NotFoundError(
                f"no video {video_id!r}: it expired (jobs last {self.config.ttl_s:g} s "
                "after they finish), was deleted or dropped for newer ones, or never existed",
                param="video_id",
                code="video_not_found",
            )
        return found
