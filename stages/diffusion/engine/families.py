"""The pipeline families the step engine drives, each the denoising loop of its diffusers pipeline, cut per step.

    UNetFamily  StableDiffusionPipeline   (UNet2DConditionModel; Euler, Euler ancestral, DPM-Solver++, DDIM)
    DiTFamily   StableDiffusion3Pipeline  (SD3Transformer2DModel; flow-matching Euler)

Each family does what its pipeline's `__call__` does, in the same order and with the same functions
(`encode_prompt`, `randn_tensor`, `retrieve_timesteps`, `scale_model_input`, the guidance formula, the VAE
decode and `image_processor.postprocess`), but for samples that each carry their own scheduler, timestep,
guidance scale and generator, so that one denoiser call can serve samples at different steps. With the
batch-invariant kernels on, a sample's rows in that call give the bits they give alone.

An image edit is prepared as the family's diffusers img2img pipeline (`edit_pipeline`) prepares it
(`stages.diffusion.engine.img2img`); from there on it is a sample like any other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusionImg2ImgPipeline,
)
from diffusers.utils.torch_utils import randn_tensor

from .img2img import prepare_edit
from .sample import Sample, seeded_generator

#: From this many pixels per image the VAE decodes a batch one image at a time: a batched decode's
#: full-resolution activations outgrow the CPU caches (measured, tiny DiT at 256x256: 0.93x per image at
#: batch 8 vs 1 batched, 1.11x sliced). Bits are unaffected with invariance on.
SLICED_DECODE_PIXELS = 128 * 128


@contextmanager
def vae_slicing(vae, height: int, width: int) -> Iterator[None]:
    """The one slicing rule, for one decode of images of `height` x `width`: the VAE's setting restored after it,
    so a decode never depends on the one before."""
    if not hasattr(vae, "use_slicing"):
        yield
        return
    before = vae.use_slicing
    vae.use_slicing = height * width >= SLICED_DECODE_PIXELS
    try:
        yield
    finally:
        vae.use_slicing = before


def _timesteps(scheduler, steps: int | None, device: str, sigmas: list[float] | None, **kwargs: Any):
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

    timesteps, _ = retrieve_timesteps(scheduler, steps, device, None, sigmas, **kwargs)
    return timesteps


def _rows(sample: Sample, tensor: torch.Tensor) -> torch.Tensor:
    """The sample's input rows: [uncond, cond] with classifier-free guidance, [cond] without."""
    return torch.cat([tensor] * 2) if sample.cfg else tensor


def _guided(sample: Sample, prediction: torch.Tensor) -> torch.Tensor:
    if not sample.cfg:
        return prediction
    uncond, text = prediction.chunk(2)
    return uncond + cast(float, sample.params.guidance_scale) * (text - uncond)  # resolved params: set


class Family:
    """What the step engine needs of a pipeline: encode, prepare, denoise one step, decode."""

    #: Scheduler names a request may choose -> class; None keeps the pipeline's own.
    SCHEDULERS: dict[str, type[Any]] = {}
    denoiser_name: str
    #: The diffusers image-to-image pipeline whose preparation an edit follows (stages.diffusion.engine.img2img).
    edit_pipeline: type[Any]
    # Each family's own steps, declared for the engine (and this class's `prepare` and `decode`).
    encode: Callable[[list[Sample]], None]
    timesteps: Callable[[Sample], Any]
    denoise: Callable[[list[Sample]], list[torch.Tensor]]
    to_vae: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, pipe):
        self.pipe = pipe
        self.denoiser = getattr(pipe, self.denoiser_name)
        self.device = pipe.device

    @property
    def dtype(self) -> torch.dtype:
        return self.denoiser.dtype

    def make_scheduler(self, name: str | None):
        base = self.pipe.scheduler
        return (self.SCHEDULERS[name] if name else type(base)).from_config(base.config)

    def prepare(self, sample: Sample) -> None:
        """Its own scheduler, timesteps and generator, and its initial latents (drawn from its seed alone)."""
        params = sample.params
        sample.scheduler = self.make_scheduler(params.scheduler)
        sample.step_kwargs = frozenset(inspect.signature(sample.scheduler.step).parameters)
        sample.timesteps = self.timesteps(sample)
        sample.generator = seeded_generator(params)
        if sample.image is not None:
            prepare_edit(self, sample)  # its schedule starts at its strength, its latents at its noised image
            return
        sample.latents = self.initial_latents(sample)

    def initial_latents(self, sample: Sample) -> torch.Tensor:
        params = sample.params
        if params.latents is not None:
            return torch.tensor(params.latents, dtype=torch.float32).unsqueeze(0).to(self.device, self.dtype)
        factor = self.pipe.vae_scale_factor
        shape = (1, self.denoiser.config.in_channels, params.height // factor, params.width // factor)
        return randn_tensor(shape, generator=sample.generator, device=self.device, dtype=self.dtype)

    def step(self, sample: Sample, prediction: torch.Tensor) -> None:
        """Advance the sample by its own scheduler (its generator draws any noise the scheduler needs)."""
        extra = {"generator": sample.generator} if "generator" in sample.step_kwargs else {}
        if "eta" in sample.step_kwargs:
            extra["eta"] = 0.0
        output = sample.scheduler.step(prediction, sample.timestep, sample.latents, **extra, return_dict=True)
        sample.latents = output.prev_sample
        sample.prediction = getattr(output, "pred_original_sample", None)
        sample.step += 1

    def decode(self, latents: torch.Tensor):
        """Latents (N, C, h, w) -> float images (N, H, W, 3) in [0, 1]."""
        vae, factor = self.pipe.vae, self.pipe.vae_scale_factor
        with vae_slicing(vae, latents.shape[-2] * factor, latents.shape[-1] * factor):
            image = vae.decode(self.to_vae(latents), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])


class UNetFamily(Family):
    denoiser_name = "unet"
    edit_pipeline = StableDiffusionImg2ImgPipeline
    SCHEDULERS = {
        "euler": EulerDiscreteScheduler,
        "euler_ancestral": EulerAncestralDiscreteScheduler,
        "dpmpp_2m": DPMSolverMultistepScheduler,  # its default algorithm: DPM-Solver++ (2M)
        "ddim": DDIMScheduler,
    }

    @classmethod
    def serves(cls, pipe) -> bool:
        unet: Any = getattr(pipe, "unet", None)  # a StableDiffusionPipeline has one
        return type(pipe).__name__ == "StableDiffusionPipeline" and unet.config.time_cond_proj_dim is None

    def encode(self, samples: list[Sample]) -> None:
        cond, uncond = self.pipe.encode_prompt(
            [s.prompt for s in samples], self.device, 1, True, [s.params.negative_prompt or "" for s in samples]
        )
        for i, sample in enumerate(samples):
            rows = [uncond[i : i + 1], cond[i : i + 1]] if sample.cfg else [cond[i : i + 1]]
            sample.conditioning = {"encoder_hidden_states": torch.cat(rows)}

    def timesteps(self, sample: Sample):
        return _timesteps(sample.scheduler, sample.params.num_inference_steps, self.device, sample.params.sigmas)

    def initial_latents(self, sample: Sample) -> torch.Tensor:
        return super().initial_latents(sample) * sample.scheduler.init_noise_sigma

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        inputs = [s.scheduler.scale_model_input(_rows(s, s.latents), s.timestep) for s in samples]
        timesteps = [s.timestep.expand(x.shape[0]) for s, x in zip(samples, inputs, strict=True)]
        hidden = torch.cat([s.conditioning["encoder_hidden_states"] for s in samples])
        output = self.denoiser(
            torch.cat(inputs), torch.cat(timesteps), encoder_hidden_states=hidden, return_dict=False
        )[0]
        return [_guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor


class DiTFamily(Family):
    denoiser_name = "transformer"
    edit_pipeline = StableDiffusion3Img2ImgPipeline
    SCHEDULERS = {"flow_match_euler": FlowMatchEulerDiscreteScheduler}

    @classmethod
    def serves(cls, pipe) -> bool:
        return type(pipe).__name__ == "StableDiffusion3Pipeline"

    def encode(self, samples: list[Sample]) -> None:
        prompts = [s.prompt for s in samples]
        cond, uncond, pooled, uncond_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=[s.params.negative_prompt or "" for s in samples],
        )
        for i, sample in enumerate(samples):
            pick = (
                (lambda a, b, i=i: torch.cat([a[i : i + 1], b[i : i + 1]]))
                if sample.cfg
                else (lambda a, b, i=i: b[i : i + 1])
            )
            sample.conditioning = {
                "encoder_hidden_states": pick(uncond, cond),
                "pooled_projections": pick(uncond_pooled, pooled),
            }

    def timesteps(self, sample: Sample):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        config, kwargs = sample.scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            patch = self.denoiser.config.patch_size
            factor = self.pipe.vae_scale_factor
            seq_len = (sample.params.height // factor // patch) * (sample.params.width // factor // patch)
            kwargs["mu"] = calculate_shift(
                seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        return _timesteps(
            sample.scheduler, sample.params.num_inference_steps, self.device, sample.params.sigmas, **kwargs
        )

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        inputs = [_rows(s, s.latents) for s in samples]
        output = self.denoiser(
            hidden_states=torch.cat(inputs),
            timestep=torch.cat([s.timestep.expand(x.shape[0]) for s, x in zip(samples, inputs, strict=True)]),
            encoder_hidden_states=torch.cat([s.conditioning["encoder_hidden_states"] for s in samples]),
            pooled_projections=torch.cat([s.conditioning["pooled_projections"] for s in samples]),
            return_dict=False,
        )[0]
        return [_guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor + self.pipe.vae.config.shift_factor


FAMILIES = (UNetFamily, DiTFamily)


def family_for(pipe) -> Family | None:
    """The family that drives `pipe` step by step, or None (the stage then batches whole requests)."""
    for family in FAMILIES:
        if family.serves(pipe):
            return family(pipe)
    return None
