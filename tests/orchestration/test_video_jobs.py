"""The video jobs' bookkeeping (orchestration/video_jobs.py), in process against a stand-in video stage: jobs bounded in
number (503 when every slot is still rendering, else the oldest finished dropped), their MP4s bounded in bytes, expiry,
a failed render as a failed job saying why, a deleted job's render cancelled, and a render whose replica dies sent
again from its last checkpoint (with its controls: no checkpoints, and a replica that does not take it)."""

import asyncio

import pytest
from ray.exceptions import ActorUnavailableError

from contracts.errors import InvalidRequestError, QueueFullError
from contracts.results import RenderCheckpoint, RenderedVideo, RenderProgress, rendered_params
from contracts.sampling import DiffusionSamplingParams
from orchestration.config import AppConfig
from orchestration.video_jobs import VideoJobs, VideoPlan

STEPS = 4


class StandInStage:
    """The video stage's two methods as a handle offers them; each render waits for its release. `dies_after`: its
    first render's replica dies after that step (an infrastructure failure); `takes_checkpoints`: a render sent with
    a checkpoint goes on from its step (else it starts anew, as a replica of another identity does). `polled`: per
    render, the progress a client polling before each of its items sees (`poll`, set by the test)."""

    def __init__(self, mp4_bytes=100, fail=None, *, steps=STEPS, dies_after=None, takes_checkpoints=True):
        self.mp4_bytes, self.fail, self.steps = mp4_bytes, fail, steps
        self.dies_after, self.takes_checkpoints = dies_after, takes_checkpoints
        self.released: dict[int, asyncio.Event] = {}
        self.cancelled: list[int] = []
        self.sent: list = []  # each render's RenderJob, as sent
        self.poll, self.polled = None, []
        self.admit = self
        self.render = self

    def options(self, **_):
        return self

    def remote(self, job):
        return _Either(self, job)  # admit is awaited, render iterated

    async def admitted(self, job) -> DiffusionSamplingParams:
        if job.params.num_frames == 10:
            raise InvalidRequestError("num_frames must be 4k + 1", param="num_frames")
        resolved = {"num_frames": 9, "num_inference_steps": self.steps, "guidance_scale": 5.0, "height": 64, "width": 64}
        return job.params.model_copy(update=resolved)

    async def rendered(self, job):
        seed, steps = job.params.seed, self.steps
        self.released.setdefault(seed, asyncio.Event())
        self.sent.append(job)
        self.polled.append([])
        first = job.resume.step + 1 if job.resume is not None and self.takes_checkpoints else 1
        try:
            for step in range(first, steps + 1):
                yield self._polled(RenderProgress(step=step, steps=steps))
                if step == self.dies_after:
                    self.dies_after = None
                    raise ActorUnavailableError("the replica died", None)
                if job.checkpoint_every and step % job.checkpoint_every == 0 and step < steps:
                    yield self._polled(RenderCheckpoint(step=step, steps=steps, state=bytes([step]), made_by="r"))
            await self.released[seed].wait()
            if self.fail is not None:
                raise self.fail
            yield RenderedVideo(
                mp4=bytes([seed % 256]) * self.mp4_bytes, sha256=f"{seed:064x}", frames_sha256="f" * 64, num_frames=9,
                fps=8, batch_size=1, steps_co_batched=0, steps_computed=steps, replica="r", model="m",
                batch_invariant=True, kernel_backend="cpu", **rendered_params(job.params),
            )
        except asyncio.CancelledError:
            self.cancelled.append(seed)
            raise

    def _polled(self, item):
        if self.poll is not None:
            self.polled[-1].append(self.poll())
        return item


class _Either:
    """`handle.admit.remote(job)` is awaited; `handle.options(stream=True).render.remote(job)` is iterated."""

    def __init__(self, stage: StandInStage, job):
        self.stage, self.job = stage, job

    def __await__(self):
        return self.stage.admitted(self.job).__await__()

    def __aiter__(self):
        return self.stage.rendered(self.job).__aiter__()


def jobs(stage: StandInStage, **video) -> VideoJobs:
    ingress = {"retry_backoff_s": 0.0}  # a failed render is sent again at once
    config = AppConfig.model_validate({"video": {"batch_invariant": True, **video}, "ingress": ingress})
    config = config.with_resolved_switches()
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


RESUMES = {  # the stage's takes_checkpoints, the jobs' checkpoint_every
    "resumed": (True, 4),
    "control-no-checkpoints": (True, 0),
    "control-another-identity": (False, 4),  # sent with its checkpoint, started anew by the replica
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_a_render_whose_replica_dies_goes_on_from_its_last_checkpoint_its_progress_never_below_it(case):
    takes, every = RESUMES[case]

    async def run():
        stage = StandInStage(steps=12, dies_after=10, takes_checkpoints=takes)
        videos = jobs(stage, checkpoint_every=every)
        job = await videos.create(plan(3), "m")
        stage.poll = lambda: videos.get(job.id).progress
        for _ in range(20):
            await settle()
        stage.released[3].set()
        await settle()
        return stage, videos.get(job.id), videos.stats()

    stage, done, stats = asyncio.run(run())
    assert done.status == "completed" and done.sha256 == f"{3:064x}" and stats["retried"] == 1
    first, again = stage.sent
    assert first.resume is None and first.checkpoint_every == every
    # Checkpoints after steps 4 and 8 (none without them); the replica died after step 10, the job at 83%.
    before, after = stage.polled
    assert before[-1] == 75 and after[0] == 83
    if case == "resumed":  # sent again from step 8, which it went on from: 75% at its first step, never below 66%
        assert (again.resume.step, again.resume.state) == (8, bytes([8]))
        assert after == [83, 75, 83, 91] and min(after) >= 100 * 8 // 12
        assert (done.resumed_from_step, stats["resumed"]) == (8, 1)
    else:  # from step 1 again: below the checkpoint a resume would have kept, and not counted as resumed
        sent = None if every == 0 else RenderCheckpoint(step=8, steps=12, state=bytes([8]), made_by="r")
        assert again.resume == sent
        assert after[:3] == [83, 8, 16] and min(after) < 100 * 8 // 12
        assert (done.resumed_from_step, stats["resumed"]) == (None, 0)
