"""The video jobs' bookkeeping (orchestration/video_jobs.py), in process against a stand-in video stage: jobs bounded in
number (503 when every slot is still rendering, else the oldest finished dropped), their MP4s bounded in bytes, expiry,
a failed render as a failed job saying why, and a deleted job's render cancelled."""

import asyncio

import pytest

from contracts.errors import InvalidRequestError, QueueFullError
from contracts.results import RenderedVideo, RenderProgress, rendered_params
from contracts.sampling import DiffusionSamplingParams
from orchestration.config import AppConfig
from orchestration.video_jobs import VideoJobs, VideoPlan

STEPS = 4


class StandInStage:
    """The video stage's two methods as a handle offers them; each render waits for its release."""

    def __init__(self, mp4_bytes: int = 100, fail: Exception | None = None):
        self.mp4_bytes, self.fail = mp4_bytes, fail
        self.released: dict[int, asyncio.Event] = {}
        self.cancelled: list[int] = []
        self.admit = self
        self.render = self

    def options(self, **_):
        return self

    def remote(self, job):
        return _Either(self, job)  # admit is awaited, render iterated

    async def admitted(self, job) -> DiffusionSamplingParams:
        if job.params.num_frames == 10:
            raise InvalidRequestError("num_frames must be 4k + 1", param="num_frames")
        resolved = {"num_frames": 9, "num_inference_steps": STEPS, "guidance_scale": 5.0, "height": 64, "width": 64}
        return job.params.model_copy(update=resolved)

    async def rendered(self, job):
        seed = job.params.seed
        self.released.setdefault(seed, asyncio.Event())
        try:
            for step in range(1, STEPS + 1):
                yield RenderProgress(step=step, steps=STEPS)
            await self.released[seed].wait()
            if self.fail is not None:
                raise self.fail
            yield RenderedVideo(
                mp4=bytes([seed % 256]) * self.mp4_bytes, sha256=f"{seed:064x}", frames_sha256="f" * 64, num_frames=9,
                fps=8, batch_size=1, steps_co_batched=0, steps_computed=STEPS, replica="r", model="m",
                batch_invariant=True, kernel_backend="cpu", **rendered_params(job.params),
            )
        except asyncio.CancelledError:
            self.cancelled.append(seed)
            raise


class _Either:
    """`handle.admit.remote(job)` is awaited; `handle.options(stream=True).render.remote(job)` is iterated."""

    def __init__(self, stage: StandInStage, job):
        self.stage, self.job = stage, job

    def __await__(self):
        return self.stage.admitted(self.job).__await__()

    def __aiter__(self):
        return self.stage.rendered(self.job).__aiter__()


def jobs(stage: StandInStage, **video) -> VideoJobs:
    config = AppConfig.model_validate({"video": {"batch_invariant": True, **video}}).with_resolved_switches()
    return VideoJobs.func_or_class(None, stage, config)


def plan(seed: int, **params) -> VideoPlan:
    return VideoPlan(prompt="a boat", params=DiffusionSamplingParams(seed=seed, **params), llm_params=None)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_jobs_are_bounded_in_number_and_a_finished_one_makes_room():
    async def run():
        stage = StandInStage()
        videos = jobs(stage, max_jobs=2)
        first, second = await videos.create(plan(1), "m"), await videos.create(plan(2), "m")
        await settle()
        assert videos.get(first.id).status == "in_progress" and videos.get(first.id).progress == 99  # every step done
        with pytest.raises(QueueFullError):
            await videos.create(plan(3), "m")  # both still rendering
        stage.released[1].set()
        await settle()
        done = videos.get(first.id)
        assert (done.status, done.progress, done.sha256) == ("completed", 100, f"{1:064x}")
        assert videos.content(first.id)[1] == bytes([1]) * 100
        third = await videos.create(plan(3), "m")  # the finished one is dropped for it
        assert videos.get(first.id) is None and videos.get(second.id) is not None and videos.get(third.id) is not None
        for event in stage.released.values():
            event.set()
        await settle()

    asyncio.run(run())


def test_the_mp4s_are_bounded_in_bytes_oldest_dropped_and_jobs_expire():
    async def run():
        stage = StandInStage(mp4_bytes=700 << 10)  # two of them are over 1 MiB
        videos = jobs(stage, store_mib=1, ttl_s=0.2)
        first, second = await videos.create(plan(1), "m"), await videos.create(plan(2), "m")
        await settle()
        stage.released[1].set()
        await settle()
        stage.released[2].set()
        await settle()
        assert videos.get(first.id) is None and videos.get(second.id).status == "completed"
        assert videos.stats()["bytes"] == 700 << 10
        await asyncio.sleep(0.3)
        assert videos.get(second.id) is None and videos.stats()["bytes"] == 0

    asyncio.run(run())


def test_a_refused_request_makes_no_job_and_a_failed_render_is_a_failed_job_saying_why():
    async def run():
        stage = StandInStage(fail=InvalidRequestError("the stage refused it", param="num_inference_steps"))
        videos = jobs(stage)
        with pytest.raises(InvalidRequestError):
            await videos.create(plan(1, num_frames=10), "m")
        assert videos.stats()["jobs"] == 0
        job = await videos.create(plan(2), "m")
        stage.released.setdefault(2, asyncio.Event()).set()
        await settle()
        failed = videos.get(job.id)
        assert failed.status == "failed" and failed.error.param == "num_inference_steps"
        assert "refused" in failed.error.message and failed.expires_at is not None

    asyncio.run(run())


def test_a_job_deleted_while_rendering_cancels_its_render():
    async def run():
        stage = StandInStage()
        videos = jobs(stage)
        job = await videos.create(plan(5), "m")
        await settle()
        assert videos.delete(job.id) and videos.get(job.id) is None and not videos.delete(job.id)
        await settle()
        assert stage.cancelled == [5]

    asyncio.run(run())
