"""The diffusion stage: one diffusers pipeline per replica, keyed dynamic batching, bit-identical output.

Read top to bottom:
  DiffusionRenderer  loads the pipeline (kernels first, when the switch is on), fills a request's
                     defaults, and renders a batch of same-key requests: one CPU generator per sample,
                     built here from the seed, then PNG bytes and their sha256.
  DiffusionStage     the Ray Serve deployment: admission (seed contract, shapes), one @serve.batch
                     queue per batch key, a bounded number of requests in flight, provenance.

Nothing here knows about HTTP; errors are typed (`contracts.errors`) for the ingress to map.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import io
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ray import serve

from contracts.errors import InvalidRequestError, QueueFullError
from contracts.invariance import SeedContractError, resolve_batch_invariant, validate_seed_contract
from contracts.sampling import DiffusionSamplingParams

#: Embedded tiny pipelines, by model id (no download: built locally, see stages.embedded.diffusion).
EMBEDDED_DEFAULT = "omniserve/tiny-sd-unet"
MAX_PROMPT_CHARS = 4000
# From this many pixels per image the VAE decodes a batch one image at a time. A batched decode's
# full-resolution activations outgrow the CPU caches, so each image costs more in a batch than
# alone (measured, tiny DiT at 256x256 with kernels on: 0.93x per image at batch 8 vs 1 batched,
# 1.11x sliced; at 64x64 batching the decode pays: 1.69x batched vs 1.54x sliced). Bits are
# unaffected with invariance on: the decoder is batch-invariant either way.
SLICED_DECODE_PIXELS = 128 * 128


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
    """One image to render: plain data only."""

    prompt: str
    params: DiffusionSamplingParams  # resolved: no None left but negative_prompt/latents/sigmas/device


def encode_png(image) -> bytes:
    """float HxWx3 in [0, 1] -> PNG bytes, the way diffusers quantises (round(x * 255))."""
    import numpy as np
    from PIL import Image

    pixels = (np.clip(image, 0.0, 1.0) * 255).round().astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()


class DiffusionRenderer:
    """A loaded pipeline plus the rules for filling and rendering requests. No Ray, no HTTP."""

    def __init__(
        self,
        model: str | None = None,
        *,
        batch_invariant: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        torch_threads: int | None = None,
        defaults: dict | None = None,
        max_pixels: int = 512 * 512,
    ):
        import torch

        from stages.kernels import current_report, enable_batch_invariant_kernels

        self.batch_invariant = batch_invariant
        self.device = device
        self.torch_threads = torch_threads
        if torch_threads:
            torch.set_num_threads(torch_threads)
        # Kernels go in before the model loads, so nothing is built or warmed with stock kernels.
        self.kernels = enable_batch_invariant_kernels(device) if batch_invariant else current_report()
        self.model = model or EMBEDDED_DEFAULT
        self.pipe = self._load(self.model, getattr(torch, dtype))
        self.pipe.set_progress_bar_config(disable=True)
        self.max_pixels = max_pixels
        # Sizes must be whole latent patches: the VAE's factor times the DiT's patch size.
        patch = getattr(getattr(self.pipe, "transformer", None), "config", None)
        self.size_multiple = self.pipe.vae_scale_factor * (getattr(patch, "patch_size", 1) or 1)
        self.accepts_sigmas = "sigmas" in inspect.signature(self.pipe.scheduler.set_timesteps).parameters
        self.defaults = self._defaults(defaults or {})

    def _load(self, model: str, dtype):
        from stages.embedded.diffusion import MODEL_IDS, load_tiny_pipeline

        embedded = {model_id: kind for kind, model_id in MODEL_IDS.items()}
        if model in embedded:
            pipe = load_tiny_pipeline(embedded[model], dtype=dtype)
        else:
            from diffusers import DiffusionPipeline

            pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
        return pipe.to(self.device)

    def _defaults(self, given: dict) -> dict:
        embedded = self.model.startswith("omniserve/")
        size = 64 if embedded else self.pipe.default_sample_size * self.pipe.vae_scale_factor
        defaults = {
            "num_inference_steps": 8 if embedded else 28,
            "guidance_scale": 5.0,
            "height": size,
            "width": size,
        }
        unknown = set(given) - set(defaults)
        if unknown:
            raise ValueError(f"unknown diffusion defaults: {sorted(unknown)}")
        return {**defaults, **given}

    def resolve(self, params: DiffusionSamplingParams, *, seed: int | None = None) -> DiffusionSamplingParams:
        """Fill unset fields with this model's defaults; refuse what this model cannot render."""
        filled = {k: v for k, v in self.defaults.items() if getattr(params, k) is None}
        if params.seed is None:
            # Only reachable with invariance off: the seed contract refuses seedless requests when on.
            filled["seed"] = seed if seed is not None else secrets.randbits(63)
        resolved = params.model_copy(update=filled) if filled else params
        height, width = resolved.height, resolved.width
        for name, value in (("height", height), ("width", width)):
            if value % self.size_multiple:
                raise InvalidRequestError(f"{name} must be a multiple of {self.size_multiple} for {self.model}, got {value}", param=name)
        if height * width > self.max_pixels:
            raise InvalidRequestError(f"{width}x{height} exceeds this deployment's limit of {self.max_pixels} pixels", param="size")
        if resolved.sigmas is not None:
            if not self.accepts_sigmas:
                raise InvalidRequestError(f"{self.model}'s scheduler does not take sigmas", param="sigmas")
            if len(resolved.sigmas) != resolved.num_inference_steps:
                raise InvalidRequestError("sigmas must have num_inference_steps entries", param="sigmas")
        if resolved.generator_device and resolved.generator_device.split(":")[0] not in ("cpu", self.device.split(":")[0]):
            raise InvalidRequestError(f"generator_device {resolved.generator_device!r} is not available here", param="generator_device")
        if resolved.latents is not None:
            self._latents_tensor(resolved)  # shape check at admission, not inside a batch
        return resolved

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

    def render(self, jobs: list[Job], **pipeline_kwargs: Any):
        """Render same-key jobs in one forward; returns float images (N, H, W, 3) in [0, 1]."""
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # per thread: OpenMP settings do not follow threads
        key = BatchKey.of(jobs[0].params)
        assert all(BatchKey.of(job.params) == key for job in jobs), "a batch mixes keys"
        # One generator per sample, created here from its seed; never shared, never reused.
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
        vae = getattr(self.pipe, "vae", None)
        if hasattr(vae, "use_slicing"):
            vae.use_slicing = key.height * key.width >= SLICED_DECODE_PIXELS
        with torch.inference_mode():
            return self.pipe(**kwargs, **pipeline_kwargs).images

    def warm_up(self) -> None:
        """One small render so the first request does not pay for kernel set-up."""
        params = self.resolve(DiffusionSamplingParams(seed=0, num_inference_steps=1))
        self.render([Job("warm-up", params)])


@serve.deployment(max_ongoing_requests=64)
class DiffusionStage:
    """One pipeline per replica, keyed dynamic batching. `DiffusionStage.func_or_class` is the plain class."""

    def __init__(
        self,
        model: str | None = None,
        *,
        batch_invariant: bool | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        torch_threads: int | None = None,
        max_batch_size: int = 8,
        batch_wait_timeout_s: float = 0.05,
        max_queued: int = 64,
        defaults: dict | None = None,
        max_pixels: int = 512 * 512,
        warm_up: bool = True,
    ):
        if max_batch_size < 1 or max_queued < max_batch_size:
            raise ValueError("need 1 <= max_batch_size <= max_queued")
        self.batch_invariant = resolve_batch_invariant("diffusion", override=batch_invariant)
        self.renderer = DiffusionRenderer(
            model, batch_invariant=self.batch_invariant, device=device, dtype=dtype,
            torch_threads=torch_threads, defaults=defaults, max_pixels=max_pixels,
        )
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.max_queued = max_queued
        self.in_flight = 0
        self._queues: dict[BatchKey, Any] = {}
        # One compute thread: batches run one at a time (the pipeline and its scheduler are stateful),
        # and the event loop stays free to admit and queue requests meanwhile.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")
        self.replica = _replica_id()
        if warm_up:
            self.renderer.warm_up()

    def admit(self, prompt: Any, params: Any) -> Job:
        """Validate one request into a Job, or raise InvalidRequestError. Nothing is dropped or replaced."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompt is longer than {MAX_PROMPT_CHARS} characters", param="prompt")
        try:
            params = DiffusionSamplingParams.from_params(params)
            validate_seed_contract(params, batch_invariant=self.batch_invariant)
        except SeedContractError as err:
            raise InvalidRequestError(str(err), param=err.param) from err
        except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
            raise InvalidRequestError(str(err), param=_first_field(err)) from err
        return Job(prompt, self.renderer.resolve(params))

    async def generate(self, prompt: str, params: dict | DiffusionSamplingParams | None = None) -> dict:
        """Render one image; returns PNG bytes and provenance."""
        job = self.admit(prompt, params or {})
        if self.in_flight >= self.max_queued:
            raise QueueFullError(f"diffusion replica {self.replica} has {self.in_flight} requests in flight; retry shortly")
        self.in_flight += 1
        try:
            return await self._queue(BatchKey.of(job.params))(job)
        finally:
            self.in_flight -= 1

    def _queue(self, key: BatchKey):
        """The @serve.batch queue for one key (Serve has no keyed batching, so one queue per key)."""
        queue = self._queues.get(key)
        if queue is None:

            @serve.batch(max_batch_size=self.max_batch_size, batch_wait_timeout_s=self.batch_wait_timeout_s)
            async def run_batch(jobs: list[Job]) -> list[dict]:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._compute, self._render, jobs)

            self._queues[key] = queue = run_batch
        return queue

    def _render(self, jobs: list[Job]) -> list[dict]:
        images = self.renderer.render(jobs)
        results = []
        for job, image in zip(jobs, images):
            png = encode_png(image)
            params = job.params
            results.append({
                "png": png,
                "sha256": hashlib.sha256(png).hexdigest(),
                "seed": params.seed,
                "height": params.height,
                "width": params.width,
                "num_inference_steps": params.num_inference_steps,
                "guidance_scale": params.guidance_scale,
                "batch_size": len(jobs),
                "batch_invariant": self.batch_invariant,
                "kernel_backend": self.renderer.kernels.backend,
                "model": self.renderer.model,
                "replica": self.replica,
            })
        return results

    async def describe(self) -> dict:
        return {
            "stage": "diffusion",
            "model": self.renderer.model,
            "replica": self.replica,
            "batch_invariant": self.batch_invariant,
            "kernels": self.renderer.kernels.to_dict(),
            "device": self.renderer.device,
            "torch_threads": self.renderer.torch_threads,
            "defaults": self.renderer.defaults,
            "batching": {"max_batch_size": self.max_batch_size, "batch_wait_timeout_s": self.batch_wait_timeout_s,
                         "max_queued": self.max_queued, "in_flight": self.in_flight},
        }

    def check_health(self) -> None:
        if self._compute._shutdown:
            raise RuntimeError("the compute thread is gone")


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests, audit): a process-local name
        return f"local-{threading.get_ident():x}"


def _first_field(err: Exception) -> str | None:
    errors = getattr(err, "errors", None)
    if callable(errors):
        for item in errors():
            loc = item.get("loc") or ()
            if loc:
                return str(loc[0])
    return None

