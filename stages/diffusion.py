"""The diffusion stage: one diffusers pipeline per replica, batched without changing a bit of any image.

Read top to bottom:
  BatchKey, Job      what decides whether two requests may share a whole-request batch; one image to render
  DiffusionRenderer  loads the pipeline (kernels first, when the switch is on; without them it refuses to start
                     rather than serve batch-dependent bytes), fills a request's defaults, refuses what this
                     model cannot render, and renders a batch of same-key requests through the pipeline
                     itself (the audit and the request-level mode use it).
  StepBatching       the pipelines the step engine knows (`stages.engine`): samples join and leave
                     between denoising steps, cancelled ones leave at the next step boundary; image edits
                     (image-to-image, `stages.engine.img2img`) run there only.
  RequestBatching    any other pipeline: one @serve.batch queue per batch key, whole requests.
  DiffusionStage     the Ray Serve deployment: admission (`contracts.admission`), a bounded number of
                     requests in flight, PNG bytes (their text chunks record how they were made:
                     `contracts.provenance`), their sha256 and provenance as a `RenderedImage`; `stream` sends
                     partial images (the step engine's previews) before it; its health check fails when the
                     compute thread is gone or one step has run past `stuck_after_s`.

Nothing here knows about HTTP; errors are typed (`contracts.errors`) for the ingress to map.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import io
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ray import serve

from contracts.admission import admit_diffusion_params, admit_prompt
from contracts.config import DiffusionDefaults, DiffusionStageConfig
from contracts.errors import InvalidRequestError, QueueFullError
from contracts.images import admit_image, edit_size
from contracts.invariance import resolve_batch_invariant
from contracts.provenance import ImageOrigin, ImageRecord, png_info
from contracts.results import PartialImage, Provenance, RenderedImage, StageDescription
from contracts.sampling import DiffusionSamplingParams
from contracts.seeds import pick_seed
from stages import replica_id
from stages.embedded import DEFAULT_MODELS, EMBEDDED_MODELS
from stages.engine import Sample, StepEngine, family_for
from stages.engine.families import SLICED_DECODE_PIXELS
from stages.engine.sample import preview_steps
from stages.engine.img2img import edit_steps, strength_of
from stages.metrics import image_counted, record_queue_wait, record_switch_state, timed_stage_call
from stages.scope import diffusion_scope

#: The sampling params a RenderedImage reports (each one as the image was really rendered).
RENDERED_PARAMS = {"seed", "height", "width", "num_inference_steps", "guidance_scale"}


@dataclass(frozen=True)
class BatchKey:
    """Everything that changes tensor shapes or the schedule: only equal keys share a forward."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    has_negative_prompt: bool
    generator_device: str
    sigmas: tuple[float, ...] | None
    has_latents: bool

    @classmethod
    def of(cls, params: DiffusionSamplingParams) -> BatchKey:
        return cls(
            height=params.height,
            width=params.width,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            has_negative_prompt=params.negative_prompt is not None,
            generator_device=params.generator_device or "cpu",
            sigmas=tuple(params.sigmas) if params.sigmas is not None else None,
            has_latents=params.latents is not None,
        )


@dataclass(frozen=True)
class Job:
    """One image to render: its prompt, its resolved params, for an edit its init image, and what its PNG records."""

    prompt: str
    params: DiffusionSamplingParams  # resolved: no None left but negative_prompt/latents/sigmas/device
    image: Any = None  # edits: the init image, preprocessed (1, 3, H, W) (stages.engine.img2img); None: text-to-image
    source: bytes | None = None  # edits: the init image as sent (its sha256 goes into the PNG's record)
    origin: ImageOrigin | None = None  # the client's prompt and its rewrite, when the ingress sent it
    previews: tuple[int, ...] = ()  # the steps after which a partial image is decoded (streaming)


def encode_png(image, record: ImageRecord | None = None) -> bytes:
    """float HxWx3 in [0, 1] -> PNG bytes, the way diffusers quantises (round(x * 255)), with the record's chunks."""
    import numpy as np
    from PIL import Image

    pixels = (np.clip(image, 0.0, 1.0) * 255).round().astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=6, pnginfo=png_info(record))
    return buffer.getvalue()


def load_pipeline(model: str, *, device: str, dtype: str):
    """An embedded tiny pipeline (built locally) or a diffusers checkpoint, on `device`, progress bars off."""
    import torch

    if model in EMBEDDED_MODELS:
        from stages.embedded.diffusion import load_tiny_pipeline

        pipe = load_tiny_pipeline(EMBEDDED_MODELS[model].recipe, dtype=getattr(torch, dtype))
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=getattr(torch, dtype))
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class DiffusionRenderer:
    """A loaded pipeline plus the rules for filling and rendering requests. No Ray, no HTTP.

    `config.batch_invariant` must already be resolved to a bool (the stage does it; the audit sets it).
    """

    def __init__(self, config: DiffusionStageConfig):
        import torch

        from stages.kernels import current_report, enable_batch_invariant_kernels

        self.config = config
        self.batch_invariant = bool(config.batch_invariant)
        self.device = config.device
        if self.device == "cpu":
            from contracts.cpu import hold_process_to_path

            hold_process_to_path()  # ATen, oneDNN and MKL at the kernel path's level: one path, one machine's bits
        self.torch_threads = config.torch_threads
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # Kernels go in before the model loads, so nothing is built or warmed with stock kernels.
        self.kernels = enable_batch_invariant_kernels(self.device) if self.batch_invariant else current_report()
        if self.batch_invariant and not self.kernels.installed:
            # Fail closed: stock kernels would answer with batch-dependent bytes while promising invariance.
            raise RuntimeError(f"diffusion batch invariance is on but its kernels are not installed, so this "
                               f"replica refuses to start: {self.kernels.reason}")
        self.model = config.model or DEFAULT_MODELS["diffusion"]
        self.pipe = load_pipeline(self.model, device=self.device, dtype=config.dtype)
        # Sizes must be whole latent patches: the VAE's factor times the DiT's patch size.
        patch = getattr(getattr(self.pipe, "transformer", None), "config", None)
        self.size_multiple = self.pipe.vae_scale_factor * (getattr(patch, "patch_size", 1) or 1)
        self.accepts_sigmas = "sigmas" in inspect.signature(self.pipe.scheduler.set_timesteps).parameters
        self.defaults = self._defaults(config.defaults)
        self.family = family_for(self.pipe)  # None: the step engine does not know this pipeline

    def _defaults(self, given: DiffusionDefaults) -> dict:
        """The model's own defaults (the embedded ones are small), overridden by the configured ones."""
        embedded = self.model in EMBEDDED_MODELS
        size = 64 if embedded else self.pipe.default_sample_size * self.pipe.vae_scale_factor
        defaults = {"num_inference_steps": 8 if embedded else 28, "guidance_scale": 5.0, "height": size, "width": size}
        return {**defaults, **given.model_dump(exclude_none=True)}

    # --- admission of resolved params: what this model can render -------------------------------------

    def resolve(self, params: DiffusionSamplingParams, *, step_engine: bool = False) -> DiffusionSamplingParams:
        """Fill unset fields with this model's defaults; refuse what exceeds the limits or this model.

        A scheduler other than the model's own is chosen per sample by the step engine only.
        """
        filled = {k: v for k, v in self.defaults.items() if getattr(params, k) is None}
        if params.seed is None:
            # Only reachable with invariance off: the seed contract refuses seedless requests when on.
            filled["seed"] = pick_seed()
        resolved = params.model_copy(update=filled) if filled else params
        self.config.check_limits(resolved)
        self._check_renderable(resolved)
        if resolved.scheduler is not None:
            served = sorted(self.family.SCHEDULERS) if step_engine and self.family else []
            if resolved.scheduler not in served:
                raise InvalidRequestError(
                    f"scheduler {resolved.scheduler!r} is not served for {self.model}; choose one of {served} or leave it out",
                    param="scheduler", code="unsupported_value")
        return resolved

    def _check_renderable(self, params: DiffusionSamplingParams) -> None:
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % self.size_multiple:
                raise InvalidRequestError(f"{name} must be a multiple of {self.size_multiple} for {self.model}, got {value}", param=name)
        if params.sigmas is not None:
            if not self.accepts_sigmas:
                raise InvalidRequestError(f"{self.model}'s scheduler does not take sigmas", param="sigmas")
            if len(params.sigmas) != params.num_inference_steps:
                raise InvalidRequestError("sigmas must have num_inference_steps entries", param="sigmas")
        if params.generator_device and params.generator_device.split(":")[0] not in ("cpu", self.device.split(":")[0]):
            raise InvalidRequestError(f"generator_device {params.generator_device!r} is not available here", param="generator_device")
        if params.latents is not None:
            self._latents_tensor(params)  # shape check at admission, not inside a batch

    def _latent_shape(self, params: DiffusionSamplingParams) -> tuple[int, ...]:
        denoiser = getattr(self.pipe, "unet", None) or self.pipe.transformer
        channels = denoiser.config.in_channels
        factor = self.pipe.vae_scale_factor
        return (channels, params.height // factor, params.width // factor)

    def _latents_tensor(self, params: DiffusionSamplingParams):
        import torch

        try:
            latents = torch.tensor(params.latents, dtype=torch.float32)
        except (ValueError, TypeError) as err:
            raise InvalidRequestError(f"latents must be a rectangular nested list: {err}", param="latents") from err
        if tuple(latents.shape) != self._latent_shape(params):
            raise InvalidRequestError(f"latents must have shape {list(self._latent_shape(params))}, got {list(latents.shape)}", param="latents")
        return latents

    # --- rendering --------------------------------------------------------------------------------------

    def render(self, jobs: list[Job], **pipeline_kwargs: Any):
        """Render same-key jobs in one forward; returns float images (N, H, W, 3) in [0, 1]."""
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # per thread: OpenMP settings do not follow threads
        key = BatchKey.of(jobs[0].params)
        assert all(BatchKey.of(job.params) == key for job in jobs), "a batch mixes keys"
        kwargs = self._pipeline_inputs(jobs, key)
        vae = getattr(self.pipe, "vae", None)
        if hasattr(vae, "use_slicing"):
            vae.use_slicing = key.height * key.width >= SLICED_DECODE_PIXELS  # see stages.engine.families
        with torch.inference_mode():
            return self.pipe(**kwargs, **pipeline_kwargs).images

    def _pipeline_inputs(self, jobs: list[Job], key: BatchKey) -> dict[str, Any]:
        """The pipeline's keyword arguments for one batch: one generator per sample, made here from its seed."""
        import torch

        # Never shared, never reused: a sample's noise depends on its own seed only.
        generators = [torch.Generator(key.generator_device).manual_seed(job.params.seed) for job in jobs]
        kwargs = dict(
            prompt=[job.prompt for job in jobs],
            generator=generators,
            num_inference_steps=key.num_inference_steps,
            guidance_scale=key.guidance_scale,
            height=key.height,
            width=key.width,
            output_type="np",
        )
        if key.has_negative_prompt:
            kwargs["negative_prompt"] = [job.params.negative_prompt for job in jobs]
        if key.sigmas is not None:
            kwargs["sigmas"] = list(key.sigmas)
        if key.has_latents:
            dtype = next(self.pipe.components[c] for c in ("unet", "transformer") if c in self.pipe.components).dtype
            kwargs["latents"] = torch.stack([self._latents_tensor(job.params) for job in jobs]).to(self.device, dtype)
        return kwargs


class StepBatching:
    """Step-level continuous batching on the step engine; a cancelled request leaves at the next step."""

    mode = "step"

    def __init__(self, renderer: DiffusionRenderer, config: DiffusionStageConfig, rendered):
        self.engine = StepEngine(renderer.family, max_batch_size=config.max_batch_size, torch_threads=config.torch_threads)
        self.rendered = rendered  # (job, float image, batch_size, steps_co_batched) -> RenderedImage

    async def render(self, job: Job, on_preview=None) -> RenderedImage:
        """Render one job; `on_preview(index, float image)` is called on the engine's thread at `job.previews`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_done(result: Any) -> None:  # on the engine's thread: encode there, settle on the event loop
            if not isinstance(result, BaseException):
                result = self.rendered(job, result, sample.largest_batch, sample.steps_co_batched)
            loop.call_soon_threadsafe(_settle, future, result)

        sample = self.engine.submit(Sample(job.prompt, job.params, on_done=on_done, image=job.image, on_partial=on_preview,
                                           partial_steps=job.previews if on_preview else ()))
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

    def load(self) -> dict[str, int]:
        return self.engine.load()


class RequestBatching:
    """Whole-request batching: one @serve.batch queue per batch key (Serve has no keyed batching)."""

    mode = "request"

    def __init__(self, renderer: DiffusionRenderer, config: DiffusionStageConfig, rendered):
        self.renderer, self.config, self.rendered = renderer, config, rendered
        self._queues: dict[BatchKey, Any] = {}
        self._batch_started: float | None = None  # time.monotonic() when the running batch began
        # One compute thread: batches run one at a time (the pipeline and its scheduler are stateful).
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")

    async def render(self, job: Job, on_preview=None) -> RenderedImage:
        """Render one job in a whole-request batch: no partial images (the pipeline has no step boundary to show)."""
        return await self._queue(BatchKey.of(job.params))(job)

    def _queue(self, key: BatchKey):
        queue = self._queues.get(key)
        if queue is None:

            @serve.batch(max_batch_size=self.config.max_batch_size, batch_wait_timeout_s=self.config.batch_wait_timeout_s)
            async def run_batch(jobs: list[Job]) -> list[RenderedImage]:
                return await asyncio.get_running_loop().run_in_executor(self._compute, self._render, jobs)

            self._queues[key] = queue = run_batch
        return queue

    def _render(self, jobs: list[Job]) -> list[RenderedImage]:
        self._batch_started = time.monotonic()
        try:
            images = self.renderer.render(jobs)
        finally:
            self._batch_started = None
        shared = len(jobs) > 1
        return [self.rendered(job, image, len(jobs), job.params.num_inference_steps * shared) for job, image in zip(jobs, images)]

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

    def load(self) -> dict[str, int]:
        return {"queues": len(self._queues)}


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


async def previews_then_image(render, job: Job):
    """`render(job, on_preview)` as a stream: each PartialImage as the engine decodes it, then the RenderedImage."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def preview(index: int, picture: Any) -> None:  # on the engine's thread, before its image is done
        partial = PartialImage(index=index, png=encode_png(picture), height=job.params.height, width=job.params.width)
        loop.call_soon_threadsafe(queue.put_nowait, partial)

    rendering = asyncio.ensure_future(render(job, preview))
    rendering.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield item
        yield rendering.result()
    finally:
        rendering.cancel()  # the caller went away: the sample leaves the engine at its next step


@serve.deployment
class DiffusionStage:
    """One pipeline per replica; step-level batching where the engine knows the pipeline, else whole requests."""

    def __init__(self, config: DiffusionStageConfig | Mapping | None = None):
        config = DiffusionStageConfig.model_validate(config if config is not None else {})
        batch_invariant = resolve_batch_invariant("diffusion", override=config.batch_invariant)
        self.config = config.model_copy(update={"batch_invariant": batch_invariant})
        self.batch_invariant = batch_invariant
        self.renderer = DiffusionRenderer(self.config)
        # What each image's record says of this stage (every Provenance field, so one added there is written too).
        self.provenance = Provenance(model=self.renderer.model, batch_invariant=batch_invariant,
                                     kernel_backend=self.renderer.kernels.backend)
        self.in_flight = 0
        self.replica = replica_id()
        step = self.config.batching == "step" and self.renderer.family is not None
        self.batching = (StepBatching if step else RequestBatching)(self.renderer, self.config, self._rendered)
        # Strict: refuses here. A step replica checks itself against the golden table first (a second or so).
        self.scope = diffusion_scope(self.renderer, self.config, self.batching.mode,
                                     getattr(self.batching, "engine", None))
        self.provenance = self.provenance.model_copy(update=self.scope.provenance())
        record_switch_state("diffusion", batch_invariant, self.renderer.kernels.backend)
        if self.config.warm_up:
            self.batching.warm_up(Job("warm-up", self.renderer.resolve(DiffusionSamplingParams(seed=0, num_inference_steps=1))))

    def admit(self, prompt: Any, params: Any) -> Job:
        """Validate one request into a Job, or raise InvalidRequestError. Nothing is dropped or replaced."""
        prompt = admit_prompt(prompt)
        params = admit_diffusion_params(params, batch_invariant=self.batch_invariant)
        return Job(prompt, self.renderer.resolve(params, step_engine=self.batching.mode == "step"))

    async def generate(self, prompt: str, params: Mapping | DiffusionSamplingParams | None = None,
                       origin: ImageOrigin | None = None) -> RenderedImage:
        """Render one image: PNG bytes (their record says `origin`'s prompt and rewrite), their sha256 and provenance."""
        return await self._render(self._job(prompt, params, None, origin))

    def _job(self, prompt: Any, params: Any, image: Any, origin: ImageOrigin | None, partial_images: int = 0) -> Job:
        """An admitted generation (`image` None) or edit, with its origin and the steps of its `partial_images` previews."""
        if image is not None:
            job = self.admit_edit(prompt, image, params or {})
            steps = edit_steps(self.renderer.family, job.params.num_inference_steps, job.params.strength)
        else:
            job = self.admit(prompt, params or {})
            if job.params.strength is not None:  # never silently ignored
                raise InvalidRequestError("strength applies to edits (an input image) only", param="strength", code="unsupported_value")
            steps = job.params.num_inference_steps
        self.scope.admit(job.params.width, job.params.height)
        return replace(job, origin=origin, previews=preview_steps(steps, partial_images))

    def admit_edit(self, prompt: Any, image: Any, params: Any) -> Job:
        """Validate one edit into a Job with its init image (`contracts.images`), or raise InvalidRequestError.

        The image is rendered at its own size: a requested size must be the image's; none requested, the image's.
        """
        if self.batching.mode != "step":
            raise InvalidRequestError(f"image edits are not served for {self.renderer.model}: the step engine does not "
                                      "know its pipeline", param="image", code="unsupported_value")
        prompt = admit_prompt(prompt)
        params = admit_diffusion_params(params, batch_invariant=self.batch_invariant)
        picture = admit_image(image)
        width, height = edit_size(picture, params.width, params.height)
        if params.latents is not None:
            raise InvalidRequestError("latents cannot be given with an image: the image decides the initial latents", param="latents")
        sized = params.model_copy(update={"width": width, "height": height, "strength": strength_of(params)})
        resolved = self.renderer.resolve(sized, step_engine=True)
        if edit_steps(self.renderer.family, resolved.num_inference_steps, resolved.strength) < 1:
            raise InvalidRequestError(f"strength {resolved.strength} leaves none of {resolved.num_inference_steps} steps to run; "
                                      "raise strength or num_inference_steps", param="strength", code="out_of_range")
        return Job(prompt, resolved, image=self.renderer.pipe.image_processor.preprocess(picture), source=image)

    async def edit(self, prompt: str, image: bytes, params: Mapping | DiffusionSamplingParams | None = None,
                   origin: ImageOrigin | None = None) -> RenderedImage:
        """Render one image from `image` (image-to-image, starting at `params.strength`): PNG bytes, sha256, provenance."""
        return await self._render(self._job(prompt, params, image, origin))

    async def stream(self, prompt: str, params: Mapping | DiffusionSamplingParams | None = None, image: bytes | None = None,
                     origin: ImageOrigin | None = None, partial_images: int = 0):
        """A generation (or, with `image`, an edit) as a stream: up to `partial_images` PartialImage previews, then
        the RenderedImage, the same bytes `generate`/`edit` return. Call it with `handle.options(stream=True)`.

        Previews come from the step engine only (whole-request batching has no step to show: the image alone)."""
        async for item in previews_then_image(self._render, self._job(prompt, params, image, origin, partial_images)):
            yield item

    async def _render(self, job: Job, on_preview=None) -> RenderedImage:
        """Render an admitted job; past `max_queued` requests in flight, QueueFullError."""
        if self.in_flight >= self.config.max_queued:
            raise QueueFullError(f"diffusion replica {self.replica} has {self.in_flight} requests in flight; retry shortly")
        method = "generation" if job.image is None else "edit"
        self.in_flight += 1
        try:
            with timed_stage_call("diffusion", method):
                return image_counted(method, await self.batching.render(job, on_preview))
        finally:
            self.in_flight -= 1

    def _rendered(self, job: Job, image: Any, batch_size: int, steps_co_batched: int) -> RenderedImage:
        provenance = self.provenance.model_copy(update=self.scope.provenance(self.scope.for_size(job.params.width, job.params.height)))
        record = ImageRecord.of(job.prompt, job.params, provenance, job.origin, job.source)
        png = encode_png(image, record)
        return RenderedImage(
            png=png,
            sha256=hashlib.sha256(png).hexdigest(),
            **job.params.model_dump(include=RENDERED_PARAMS),
            batch_size=batch_size,
            steps_co_batched=steps_co_batched,
            **provenance.model_dump(),
            replica=self.replica,
        )

    async def describe(self) -> StageDescription:
        config = self.config
        batching = {"mode": self.batching.mode, "max_batch_size": config.max_batch_size,
                    "batch_wait_timeout_s": config.batch_wait_timeout_s, "max_queued": config.max_queued,
                    "in_flight": self.in_flight, **self.batching.load()}
        problem = self.problem()
        return StageDescription(
            stage="diffusion",
            replica=self.replica,
            **self.provenance.model_dump(),  # model, switch, kernel backend, verified scope
            kernels=self.renderer.kernels.to_dict(),
            kernels_installed=self.renderer.kernels.installed,
            running=problem is None,
            details={"device": self.renderer.device, "torch_threads": self.renderer.torch_threads, "pid": os.getpid(),
                     "defaults": dict(self.renderer.defaults), "batching": batching, "problem": problem},
        )

    def problem(self) -> str | None:
        """Why this replica cannot serve: its compute thread is gone or stuck; None when it can."""
        if not self.batching.alive:
            return "the compute thread is gone"
        busy_s = self.batching.busy_s()
        if busy_s > self.config.stuck_after_s:
            unit = "step" if self.batching.mode == "step" else "batch"
            return f"the compute thread is stuck: one {unit} has run {busy_s:.0f} s (stuck_after_s={self.config.stuck_after_s:g})"
        return None

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; raising makes it replace the replica."""
        problem = self.problem()
        if problem is not None:
            raise RuntimeError(problem)
