"""How a replica batches: the step engine where it knows the pipeline, else whole requests.

StepBatching         the pipelines the step engine knows (`stages.diffusion.engine`): samples join and leave
                     between denoising steps, cancelled ones leave at the next step boundary; image edits
                     (image-to-image, `stages.diffusion.engine.img2img`) run there only; when Serve stops the
                     replica, its samples are handed off at the next step boundary to go on on another replica.
RequestBatching      any other pipeline: one @serve.batch queue per batch key, whole requests.
updates_then_result  one job as a stream: its previews as the engine decodes them (and, asked, its progress after
                     each step), then its image or video (or RenderMoved: handed off).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from ray import serve

from contracts.config import DiffusionStageConfig
from contracts.results import PartialImage, RenderCheckpoint, RenderMoved, RenderProgress
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.sample import Moved
from stages.metrics import record_queue_wait
from stages.serve_replica import ReplicaLifecycle

from .renderer import BatchKey, DiffusionRenderer, Job, encode_png

logger = logging.getLogger("ray.serve")
#: How often a replica looks whether Serve began stopping it: a sample hands off within a step of that and this.
STOP_POLL_S = 0.2


@dataclass(frozen=True)
class Finished:
    """A job's render before it is encoded (the stage encodes it): its float pixels (an image HxWx3 in [0, 1], or a
    video's frames), and how it was batched: the largest batch it was in, its steps computed with others, its steps."""

    job: Job
    pixels: Any
    batch_size: int
    steps_co_batched: int
    steps_computed: int


class StepBatching:
    """Step-level continuous batching on the step engine; a cancelled request leaves at the next step."""

    mode = "step"

    def __init__(self, renderer: DiffusionRenderer, config: DiffusionStageConfig):
        assert renderer.family is not None  # chosen only for a pipeline the step engine knows
        self.engine = StepEngine(
            renderer.family,
            max_batch_size=config.max_batch_size,
            torch_threads=config.torch_threads,
            pack_sizes=config.pack_sizes,
        )
        self.lifecycle = ReplicaLifecycle()
        if self.lifecycle.readable:
            threading.Thread(target=self._hand_off_when_stopped, name="diffusion-hand-off", daemon=True).start()

    def _hand_off_when_stopped(self) -> None:
        """Serve began stopping this replica: hand what it renders to another one at the next step boundary, where
        another runs (each goes on there from its step, the same bytes); else finish it here, within the
        deployment's `graceful_shutdown_timeout_s`."""
        while not self.lifecycle.stopping():
            if not self.engine.alive:
                return
            time.sleep(STOP_POLL_S)
        try:
            others = self.lifecycle.others_running()
        except Exception:  # Serve's controller unreachable: finish here, as without a hand-off
            logger.exception("stopping: could not read whether another replica runs; finishing here")
            others = False
        if others:
            logger.info("stopping: the samples in flight are handed off to another replica at the next step")
            self.engine.hand_off()
        else:
            logger.info("stopping with no other replica running: the samples in flight are finished here")

    async def render(self, job: Job, on_preview=None, on_step=None, on_checkpoint=None) -> Finished:
        """Render one job; `on_preview(index, float image)` is called on the engine's thread at `job.previews`,
        `on_step(steps done)` after each step, `on_checkpoint(steps done, state)` every `job.checkpoint_every`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_done(result: Any) -> None:  # on the engine's thread: settle on the event loop
            if not isinstance(result, BaseException):
                result = Finished(job, result, sample.largest_batch, sample.steps_co_batched, sample.steps_computed)
            loop.call_soon_threadsafe(_settle, future, result)

        sample = self.engine.submit(
            Sample(
                job.prompt,
                job.params,
                on_done=on_done,
                image=job.image,
                on_partial=on_preview,
                partial_steps=job.previews if on_preview else (),
                on_step=on_step,
                on_checkpoint=on_checkpoint,
                checkpoint_every=job.checkpoint_every,
                resume=job.resume,
            )
        )
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.cancel(sample)
            raise
        finally:
            record_queue_wait(sample)

    def warm_up(self, job: Job) -> None:
        self.engine.render([Sample(job.prompt, job.params, on_done=None)])

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def busy_s(self) -> float:
        """How long the engine's current step has run (0.0 while idle)."""
        started = self.engine.step_started
        return 0.0 if started is None else time.monotonic() - started

    def load(self) -> dict[str, Any]:
        """`/health`'s view of the batching: the engine's load, and whether it packs sizes into one call."""
        return {**self.engine.load(), "packs_sizes": self.engine.pack_sizes}


class RequestBatching:
    """Whole-request batching: one @serve.batch queue per batch key (Serve has no keyed batching)."""

    mode = "request"

    def __init__(self, renderer: DiffusionRenderer, config: DiffusionStageConfig):
        self.renderer, self.config = renderer, config
        # Per batch key and request group (`DiffusionRenderer.request_group`: prompts of one length where it matters).
        self._queues: dict[tuple[BatchKey, tuple[int, ...]], Any] = {}
        self._batch_started: float | None = None  # time.monotonic() when the running batch began
        # One compute thread: batches run one at a time (the pipeline and its scheduler are stateful).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")

    async def render(self, job: Job, on_preview=None, on_step=None, on_checkpoint=None) -> Finished:
        """Render one job in a whole-request batch: no partial images nor progress (the pipeline has no step boundary
        to show)."""
        return await self._queue((BatchKey.of(job.params), self.renderer.request_group(job)))(job)

    def _queue(self, key: tuple[BatchKey, tuple[int, ...]]):
        queue = self._queues.get(key)
        if queue is None:

            @serve.batch(
                max_batch_size=self.config.max_batch_size, batch_wait_timeout_s=self.config.batch_wait_timeout_s
            )
            async def run_batch(jobs: list[Job]) -> list[Finished]:
                return await asyncio.get_running_loop().run_in_executor(self._compute, self._render, jobs)

            self._queues[key] = queue = run_batch
        return queue

    def _render(self, jobs: list[Job]) -> list[Finished]:
        self._batch_started = time.monotonic()
        try:
            images = self.renderer.render(jobs)
        finally:
            self._batch_started = None
        steps = [cast(int, job.params.num_inference_steps) for job in jobs]  # resolved: set
        return [
            Finished(job, image, len(jobs), n * (len(jobs) > 1), n)
            for job, image, n in zip(jobs, images, steps, strict=False)
        ]

    def warm_up(self, job: Job) -> None:
        self.renderer.render([job])

    @property
    def alive(self) -> bool:
        """The compute thread can still take batches (the executor starts it on the first one)."""
        return not self._compute._shutdown and all(thread.is_alive() for thread in self._compute._threads)

    def busy_s(self) -> float:
        """How long the running batch has run (0.0 while idle)."""
        started = self._batch_started
        return 0.0 if started is None else time.monotonic() - started

    def load(self) -> dict[str, Any]:
        """`/health`'s view of the batching: its queues, and why it is not the step engine where that was asked for."""
        load: dict[str, Any] = {"queues": len(self._queues)}
        if self.config.batching == "step":
            load["fallback"] = (
                f"the step engine has no family for {type(self.renderer.pipe).__name__}: whole requests are batched "
                "(same size, steps and guidance), no previews"
            )
        return load


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


async def updates_then_result(render, job: Job, *, progress: bool = False, made_by: str = ""):
    """`render(job, on_preview, on_step, on_checkpoint)` as a stream: each PartialImage as the engine decodes it,
    (`progress`) a RenderProgress after each step and (`job.checkpoint_every`) a RenderCheckpoint of the stage
    `made_by` every so many steps, then the result (RenderedImage, RenderedVideo), or RenderMoved where the engine
    handed the job off (its replica stops)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    steps = cast(int, job.params.num_inference_steps)  # resolved: set

    def preview(index: int, picture: Any) -> None:  # on the engine's thread, before its image is done
        partial = PartialImage(index=index, png=encode_png(picture), height=job.params.height, width=job.params.width)
        loop.call_soon_threadsafe(queue.put_nowait, partial)

    def step(done: int) -> None:  # on the engine's thread
        loop.call_soon_threadsafe(queue.put_nowait, RenderProgress(step=done, steps=steps))

    def checkpoint(done: int, state: bytes) -> None:  # on the engine's thread
        made = RenderCheckpoint(step=done, steps=steps, state=state, made_by=made_by)
        loop.call_soon_threadsafe(queue.put_nowait, made)

    rendering = asyncio.ensure_future(
        render(job, preview, step if progress else None, checkpoint if job.checkpoint_every else None)
    )
    rendering.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield item
        try:
            yield rendering.result()
        except Moved as moved:
            state = moved.state
            made = (
                None if state is None else RenderCheckpoint(step=moved.step, steps=steps, state=state, made_by=made_by)
            )
            yield RenderMoved(checkpoint=made)
    finally:
        rendering.cancel()  # the caller went away: the sample leaves the engine at its next step
