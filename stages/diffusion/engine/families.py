"""The pipeline families the step engine drives, each the denoising loop of its diffusers pipeline, cut per step.

    UNetFamily  StableDiffusionPipeline   (UNet2DConditionModel; Euler, Euler ancestral, DPM-Solver++, DDIM)
    SDXLFamily  StableDiffusionXLPipeline (the UNet with two text encoders, pooled text and size ids added)
    DiTFamily   StableDiffusion3Pipeline  (SD3Transformer2DModel; flow-matching Euler)
    PackedFamily                          (what the next two share: packed latents, the shift, true CFG, size packing)
    FluxFamily  FluxPipeline              (FluxTransformer2DModel on packed latents with RoPE ids; flow matching with
                                           the resolution-dependent shift; distilled guidance, true CFG on request)
    QwenImageFamily QwenImagePipeline     (QwenImageTransformer2DModel, an MMDiT over packed latents and a Qwen2.5-VL
                                           prompt of its own length; true CFG with its norm rescale; a 3-D VAE)

Each family does what its pipeline's `__call__` does, in the same order and with the same functions
(`encode_prompt`, `randn_tensor`, `retrieve_timesteps`, `scale_model_input`, the guidance formula, the VAE
decode and `image_processor.postprocess`), but for samples that each carry their own scheduler, timestep,
guidance scale and generator, so that one denoiser call can serve samples at different steps. With the
batch-invariant kernels on, a sample's rows in that call give the bits they give alone.

An image edit is prepared as the family's diffusers img2img pipeline (`edit_pipeline`) prepares it
(`stages.diffusion.engine.img2img`); from there on it is a sample like any other.
"""

from __future__ import annotations

import functools
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
    FluxImg2ImgPipeline,
    QwenImageImg2ImgPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionXLImg2ImgPipeline,
)
from diffusers.utils.torch_utils import randn_tensor

from contracts.errors import InvalidRequestError
from contracts.sampling import DiffusionSamplingParams
from stages.diffusers_private import lend_flux_img2img, lend_qwen_img2img, sdxl_time_ids, unpack_latents

from ..lora import FamilyAdapters
from .img2img import prepare_edit
from .packing import PackedFluxAttnProcessor, PackedQwenAttnProcessor, PackedRows, PackedStreams, padded
from .sample import CachedSteps, Sample, seeded_generator

#: From this many pixels per image the VAE decodes a batch one image at a time: a batched decode's
#: full-resolution activations outgrow the CPU caches (measured, tiny DiT at 256x256: 0.93x per image at
#: batch 8 vs 1 batched, 1.11x sliced). Bits are unaffected with invariance on.
SLICED_DECODE_PIXELS = 128 * 128


@contextmanager
def vae_slicing(vae, height: int, width: int, *, alone: bool = False) -> Iterator[None]:
    """The one slicing rule, for one decode of images of `height` x `width` (`alone`: one image at a time whatever
    the size, for a VAE whose batched decode is not batch-invariant): the VAE's setting restored after it, so a
    decode never depends on the one before."""
    if not hasattr(vae, "use_slicing"):
        yield
        return
    before = vae.use_slicing
    vae.use_slicing = alone or height * width >= SLICED_DECODE_PIXELS
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


def guided(sample: Sample, prediction: torch.Tensor) -> torch.Tensor:
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

    #: Latent pixels packed into one token per side (FLUX: 2): image sides are multiples of VAE factor x this.
    latent_packing = 1
    #: Whether a request may give its initial latents (as (C, h, w), unpacked).
    takes_latents = True
    #: Whether samples of different image sizes may share a denoiser call (FLUX: token sequences padded, attention
    #: per sample, `stages.diffusion.engine.packing`); else a call holds one latent shape.
    packs_sizes = False
    #: Whether the VAE decodes one image at a time at every size (Qwen-Image's 3-D VAE: its batched decode gave other
    #: bits, measured: 5 of 144 images of a mixed load differed between request batching and the step engine).
    decodes_alone = False
    #: Whether the diffusers pipeline, given a batch, pads its prompts to the longest and masks the padding (Qwen-Image):
    #: the masked attention's bits then follow the batch's longest prompt, so whole-request batches must hold prompts of
    #: one token count (`token_counts`; the step engine encodes them so anyway).
    pads_prompts = False
    #: Whether every text encoder call of `encode` takes every joining sample's prompt (or negative prompt), in order:
    #: then text-encoder layers of an adapter apply per row there too; else a request naming one is refused.
    encodes_in_order = False
    TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
    #: Step caching's threshold where a request gives none (docs/performance.md); None: not measured, a request gives it.
    cache_threshold: float | None = None
    #: The denoiser call's inputs every row shares (given whole to each worker of a parallel group); the rest are per row.
    shared_inputs: frozenset[str] = frozenset()

    def token_counts(self, prompts: list[str]) -> list[int]:
        """Each prompt's token count as the pipeline encodes it (only families that pad prompts need it)."""
        raise NotImplementedError

    def __init__(self, pipe):
        self.pipe = pipe
        self.denoiser = getattr(pipe, self.denoiser_name)
        self.device = pipe.device
        self.adapters = FamilyAdapters(pipe, self.denoiser_name, self.TEXT_ENCODERS if self.encodes_in_order else ())
        # The denoiser's prediction for a call's rows; a parallel group puts its own here (stages.diffusion.group).
        self.predict: Callable[..., torch.Tensor] = self.call_denoiser

    def call_denoiser(self, **inputs: Any) -> torch.Tensor:
        """The denoiser's prediction for a call's rows, computed in this process."""
        return self.denoiser(**inputs, return_dict=False)[0]

    def rows(self, sample: Sample) -> int:
        """The sample's rows in a denoiser call: two with classifier-free guidance, else one."""
        return 2 if sample.cfg else 1

    def condition(self, samples: list[Sample]) -> None:
        """Joining samples' adapters attached, then `encode`, each text encoder's rows with their sample's adapters."""
        self.adapters.attach(samples)
        with self.adapters.text_rows(samples):
            self.encode(samples)

    def forward(self, samples: list[Sample]) -> list[torch.Tensor]:
        """`denoise`, each row with its sample's LoRA adapters (none: the base model's rows, untouched)."""
        with self.adapters.denoiser.rows([s.adapters for s in samples for _ in range(self.rows(s))]):
            return self.denoise(samples)

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
        sample.cache = CachedSteps.of(params.cache)
        if sample.image is not None:
            prepare_edit(self, sample)  # its schedule starts at its strength, its latents at its noised image
            return
        sample.latents = self.initial_latents(sample)

    def cache_signal(self, sample: Sample) -> torch.Tensor:
        """What step caching compares from step to step: the sample's latents as its denoiser takes them."""
        return sample.latents

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

    def edit_latents(self, stand_in: Any, sample: Sample, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An edit's initial latents: its image encoded and noised to `timestep`, by its img2img pipeline's own code."""
        return self.edit_pipeline.prepare_latents(
            stand_in, sample.image, timestep, 1, 1, dtype, self.device, sample.generator
        )

    def decode(self, latents: torch.Tensor, shape: tuple[int, int]):
        """Latents of images of `shape` (height, width) -> float images (N, H, W, 3) in [0, 1]."""
        vae = self.pipe.vae
        with vae_slicing(vae, *shape, alone=self.decodes_alone):
            image = self.frame(vae.decode(self.to_vae(self.unpack(latents, shape)), return_dict=False)[0])
        return self.pipe.image_processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])

    def unpack(self, latents: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The VAE's (N, C, h, w) from the denoiser's latents (packed ones unpacked: FLUX)."""
        return latents

    def frame(self, decoded: torch.Tensor) -> torch.Tensor:
        """The images (N, 3, H, W) from what the VAE decoded (a 3-D VAE's first frame: Qwen-Image)."""
        return decoded


class UNetFamily(Family):
    denoiser_name = "unet"
    # Measured on the default model (issue 25, 50 steps, 64x64): 2.08x images/s, every image >= 35.3 dB PSNR against
    # its uncached render, no drop in the semantic hit rates (0.3: 2.55x, one image at 29.3 dB).
    cache_threshold: float | None = 0.2
    encodes_in_order = True  # `encode_prompt` over every sample's prompts, then their negative prompts
    edit_pipeline: type[Any] = StableDiffusionImg2ImgPipeline
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
        output = self.predict(sample=torch.cat(inputs), timestep=torch.cat(timesteps), encoder_hidden_states=hidden)
        return [guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor


class SDXLFamily(UNetFamily):
    """StableDiffusionXLPipeline: the UNet loop, with SDXL's added conditioning per sample (its pooled text embedding
    and its six size ids: original size, crop origin, target size, the request's height and width at (0, 0))."""

    edit_pipeline = StableDiffusionXLImg2ImgPipeline
    cache_threshold = None  # not measured on SDXL (UNetFamily's is the default SD model's): a request gives one

    @classmethod
    def serves(cls, pipe) -> bool:
        unet: Any = getattr(pipe, "unet", None)
        return type(pipe).__name__ == "StableDiffusionXLPipeline" and unet.config.time_cond_proj_dim is None

    def encode(self, samples: list[Sample]) -> None:
        negatives = [s.params.negative_prompt for s in samples]
        cond, uncond, pooled, uncond_pooled = self.pipe.encode_prompt(
            prompt=[s.prompt for s in samples],
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=[n or "" for n in negatives],
        )
        # diffusers' rule for a request without a negative prompt: zero embeddings, not the empty prompt's.
        zeros = self.pipe.config.force_zeros_for_empty_prompt
        encoder = self.pipe.text_encoder_2
        projection = encoder.config.projection_dim if encoder is not None else int(pooled.shape[-1])
        for i, sample in enumerate(samples):
            blank = zeros and negatives[i] is None
            negative = torch.zeros_like(uncond[i : i + 1]) if blank else uncond[i : i + 1]
            negative_pooled = torch.zeros_like(uncond_pooled[i : i + 1]) if blank else uncond_pooled[i : i + 1]
            height, width = sample.shape
            time_ids = sdxl_time_ids(self.pipe, (height, width), cond.dtype, projection).to(self.device)
            pick = (lambda a, b: torch.cat([a, b])) if sample.cfg else (lambda a, b: b)
            sample.conditioning = {
                "encoder_hidden_states": pick(negative, cond[i : i + 1]),
                "text_embeds": pick(negative_pooled, pooled[i : i + 1]),
                "time_ids": pick(time_ids, time_ids),
            }

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        inputs = [s.scheduler.scale_model_input(_rows(s, s.latents), s.timestep) for s in samples]
        timesteps = [s.timestep.expand(x.shape[0]) for s, x in zip(samples, inputs, strict=True)]
        joined = {k: torch.cat([s.conditioning[k] for s in samples]) for k in samples[0].conditioning}
        output = self.predict(
            sample=torch.cat(inputs),
            timestep=torch.cat(timesteps),
            encoder_hidden_states=joined["encoder_hidden_states"],
            added_cond_kwargs={"text_embeds": joined["text_embeds"], "time_ids": joined["time_ids"]},
        )
        return [guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return latents / config.scaling_factor
        channels = latents.shape[1]
        mean_t = torch.tensor(mean).view(1, channels, 1, 1).to(latents.device, latents.dtype)
        std_t = torch.tensor(std).view(1, channels, 1, 1).to(latents.device, latents.dtype)
        return latents * std_t / config.scaling_factor + mean_t


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
        output = self.predict(
            hidden_states=torch.cat(inputs),
            timestep=torch.cat([s.timestep.expand(x.shape[0]) for s, x in zip(samples, inputs, strict=True)]),
            encoder_hidden_states=torch.cat([s.conditioning["encoder_hidden_states"] for s in samples]),
            pooled_projections=torch.cat([s.conditioning["pooled_projections"] for s in samples]),
        )
        return [guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor + self.pipe.vae.config.shift_factor


class PackedFamily(Family):
    """What FLUX and Qwen-Image share: latents packed 2x2 into tokens, sigmas from 1 to 1/steps shifted by the image's
    token count (`calculate_shift`), true CFG (a second row on the negative prompt when its scale is above 1), and
    samples of different sizes in one call (`stages.diffusion.engine.packing`)."""

    denoiser_name = "transformer"
    SCHEDULERS = {"flow_match_euler": FlowMatchEulerDiscreteScheduler}
    latent_packing = 2
    takes_latents = False  # the pipelines take them packed; a request's (C, h, w) would be ambiguous
    packs_sizes = True

    def __init__(self, pipe):
        super().__init__(pipe)
        # diffusers' processor when a call holds one size; per-sample attention when it holds several.
        self.denoiser.set_attn_processor(self.attention_processor())
        #: The pipeline's own `true_cfg_scale` default, for a request that names none (FLUX: 1.0, Qwen-Image: 4.0).
        self.true_cfg_default = float(inspect.signature(type(pipe).__call__).parameters["true_cfg_scale"].default)

    @staticmethod
    def attention_processor() -> Any:
        raise NotImplementedError

    def true_cfg_scale(self, sample: Sample) -> float:
        scale = sample.params.true_cfg_scale
        return self.true_cfg_default if scale is None else scale

    def true_cfg(self, sample: Sample) -> bool:
        """diffusers' `do_true_cfg`: a negative prompt and a true CFG scale above 1."""
        return self.true_cfg_scale(sample) > 1.0 and sample.params.negative_prompt is not None

    def rows(self, sample: Sample) -> int:
        return 2 if self.true_cfg(sample) else 1  # [negative, positive] with true CFG

    def timesteps(self, sample: Sample):
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        steps = cast(int, sample.params.num_inference_steps)
        config = sample.scheduler.config
        sigmas: Any = sample.params.sigmas or np.linspace(1.0, 1 / steps, steps)  # diffusers' FLUX default
        if config.get("use_flow_sigmas", False):
            sigmas = None
        rows, columns = self.token_grid(sample)
        mu = calculate_shift(
            rows * columns,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        timesteps = _timesteps(sample.scheduler, steps, self.device, sigmas, mu=mu)
        sample.scheduler.set_begin_index(0)  # as the pipeline's `__call__` does (an edit's preparation moves it)
        return timesteps

    def token_grid(self, sample: Sample) -> tuple[int, int]:
        """The sample's image tokens: rows and columns of packed latent pixels."""
        height, width = sample.shape
        side = self.pipe.vae_scale_factor * self.latent_packing
        return height // side, width // side

    def unpack(self, latents: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return unpack_latents(self.pipe, latents, *shape)


class FluxFamily(PackedFamily):
    """FluxPipeline: latents packed 2x2 into tokens, with their RoPE position ids (image) and zeros (text); sigmas
    from 1 to 1/steps, shifted by the image's token count; `guidance_scale` embedded (distilled guidance, one row);
    with a negative prompt and `true_cfg_scale` > 1, a second row on the negative prompt, combined as diffusers does."""

    edit_pipeline = FluxImg2ImgPipeline
    # Measured on the tiny FLUX DiT (issue 25, 50 steps, 64x64): 5.50x images/s, every image >= 36.5 dB PSNR (0.3 at 8
    # steps: 35.8 dB; 0.3 at 50 steps not measured). Random weights: a real checkpoint's own threshold may differ.
    cache_threshold: float | None = 0.2
    shared_inputs = frozenset({"txt_ids", "img_ids"})  # the call's text ids and the longest sample's image ids
    #: FluxPipeline's default T5 sequence length: a different one gives other bits.
    max_sequence_length = 512

    @staticmethod
    def attention_processor():
        return PackedFluxAttnProcessor()

    @classmethod
    def serves(cls, pipe) -> bool:
        return type(pipe).__name__ == "FluxPipeline"

    def _encode(self, prompts: list[str]):
        return self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )

    def encode(self, samples: list[Sample]) -> None:
        cond, pooled, text_ids = self._encode([s.prompt for s in samples])
        twice = [s for s in samples if self.true_cfg(s)]
        negative = self._encode([cast(str, s.params.negative_prompt) for s in twice]) if twice else None
        for i, sample in enumerate(samples):
            rows = {"encoder_hidden_states": cond[i : i + 1], "pooled_projections": pooled[i : i + 1]}
            if negative is not None and sample in twice:
                j = twice.index(sample)
                rows = {
                    "encoder_hidden_states": torch.cat([negative[0][j : j + 1], rows["encoder_hidden_states"]]),
                    "pooled_projections": torch.cat([negative[1][j : j + 1], rows["pooled_projections"]]),
                }
            sample.conditioning = {**rows, "txt_ids": text_ids}

    def initial_latents(self, sample: Sample) -> torch.Tensor:
        height, width = sample.shape
        channels = self.denoiser.config.in_channels // 4
        latents, image_ids = self.pipe.prepare_latents(
            1, channels, height, width, self.dtype, self.device, sample.generator
        )
        sample.conditioning["img_ids"] = image_ids
        return latents

    def edit_latents(self, stand_in: Any, sample: Sample, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # FluxImg2ImgPipeline.prepare_latents reads more of its pipeline than the VAE and scheduler.
        stand_in.vae_scale_factor = self.pipe.vae_scale_factor
        stand_in.latent_channels = self.pipe.vae.config.latent_channels
        lend_flux_img2img(stand_in)
        height, width = sample.shape
        channels = self.denoiser.config.in_channels // 4
        latents, image_ids = FluxImg2ImgPipeline.prepare_latents(
            stand_in, sample.image, timestep, 1, channels, height, width, dtype, self.device, sample.generator
        )
        sample.conditioning["img_ids"] = image_ids
        return latents

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        rows = [2 if self.true_cfg(s) else 1 for s in samples]
        tokens = [s.latents.shape[1] for s in samples]
        longest = max(tokens)
        latents = torch.cat([padded(s.latents, longest) for s, n in zip(samples, rows, strict=True) for _ in range(n)])
        # diffusers: the timestep in the latents' dtype, then / 1000; the guidance in float32.
        timestep = torch.cat([s.timestep.expand(n).to(s.latents.dtype) for s, n in zip(samples, rows, strict=True)])
        guidance = None
        if self.denoiser.config.guidance_embeds:
            guidance = torch.cat(
                [
                    torch.full([n], cast(float, s.params.guidance_scale), device=self.device, dtype=torch.float32)
                    for s, n in zip(samples, rows, strict=True)
                ]
            )
        text_ids = samples[0].conditioning["txt_ids"]  # T5 padded to max_sequence_length: one text length
        packed = None
        if len(set(tokens)) > 1:
            # The RoPE table each sample's solo call computes (FluxTransformer2DModel.forward), one per row.
            tables = [self.denoiser.pos_embed(torch.cat((text_ids, s.conditioning["img_ids"]))) for s in samples]
            packed = PackedRows(
                lengths=tuple(len(text_ids) + t for t, n in zip(tokens, rows, strict=True) for _ in range(n)),
                rotary=tuple(table for table, n in zip(tables, rows, strict=True) for _ in range(n)),
            )
        output = self.predict(
            hidden_states=latents,
            timestep=timestep / 1000,
            guidance=guidance,
            pooled_projections=torch.cat([s.conditioning["pooled_projections"] for s in samples]),
            encoder_hidden_states=torch.cat([s.conditioning["encoder_hidden_states"] for s in samples]),
            txt_ids=text_ids,
            # Packed: the longest sample's ids (their RoPE table is unused: each row has its own).
            img_ids=samples[tokens.index(longest)].conditioning["img_ids"],
            joint_attention_kwargs={"packed": packed} if packed else None,
        )
        predictions = []
        for sample, t, prediction in zip(samples, tokens, output.split(rows), strict=True):
            prediction = prediction[:, :t]  # its own tokens: the padding dropped
            if len(prediction) == 2:
                negative, positive = prediction.chunk(2)
                prediction = negative + self.true_cfg_scale(sample) * (positive - negative)
            predictions.append(prediction)
        return predictions

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor + self.pipe.vae.config.shift_factor


class QwenImageFamily(PackedFamily):
    """QwenImagePipeline: FLUX's packed 2x2 latents, sigmas and resolution shift (its unpacked latents: (N, C, 1 frame,
    h, w)), with its own MMDiT call. Its prompt is the Qwen2.5-VL encoder's last hidden state over the chat template,
    without the template's system prefix, so every prompt has its own length: a call's text is padded to the longest
    like its image tokens, and attention runs per row over that row's own text and image (`PackedQwenAttnProcessor`)
    with the RoPE tables its solo call computes. No distilled guidance (a request's `guidance_scale` is ignored, as
    diffusers ignores it); with a negative prompt and `true_cfg_scale` > 1 (the pipeline's default: 4), a second row on
    the negative prompt, combined and rescaled to the positive prediction's norm as diffusers does. The VAE is 3-D (one
    frame) and decodes one image at a time (`decodes_alone`)."""

    edit_pipeline = QwenImageImg2ImgPipeline
    #: QwenImagePipeline's default `max_sequence_length`.
    max_sequence_length = 512
    pads_prompts = True
    decodes_alone = True

    @staticmethod
    def attention_processor():
        return PackedQwenAttnProcessor()

    @classmethod
    def serves(cls, pipe) -> bool:
        return type(pipe).__name__ == "QwenImagePipeline" and not pipe.transformer.config.guidance_embeds

    def token_counts(self, prompts: list[str]) -> list[int]:
        """Tokens of each prompt in its chat template, as `_get_qwen_prompt_embeds` tokenizes it."""
        pipe = self.pipe
        tokens = pipe.tokenizer(
            [pipe.prompt_template_encode.format(p) for p in prompts],
            max_length=pipe.tokenizer_max_length + pipe.prompt_template_encode_start_idx,
            truncation=True,
        ).input_ids
        return [len(t) for t in tokens]

    def _embed(self, prompts: list[str]) -> list[torch.Tensor]:
        """Each prompt's embeddings (1, its length, D). Prompts of one token count are encoded together, so no row is
        padded: a padded row's attention would reduce over more keys than its solo encoding does."""
        pipe = self.pipe
        counts = self.token_counts(prompts)
        embedded: dict[int, torch.Tensor] = {}
        for length in dict.fromkeys(counts):
            same = [i for i, n in enumerate(counts) if n == length]
            embeds, _ = pipe.encode_prompt(
                [prompts[i] for i in same], self.device, 1, max_sequence_length=self.max_sequence_length
            )
            embedded.update((i, embeds[j : j + 1]) for j, i in enumerate(same))
        return [embedded[i] for i in range(len(prompts))]

    def encode(self, samples: list[Sample]) -> None:
        twice = [s for s in samples if self.true_cfg(s)]
        texts = self._embed([s.prompt for s in samples] + [cast(str, s.params.negative_prompt) for s in twice])
        negatives = dict(zip(twice, texts[len(samples) :], strict=True))
        for sample, text in zip(samples, texts, strict=False):
            # Its rows' prompts, in the order of its rows: [negative, positive] with true CFG, else [positive].
            sample.conditioning = {
                "encoder_hidden_states": text,
                "rows": [negatives[sample], text] if sample in negatives else [text],
            }

    def initial_latents(self, sample: Sample) -> torch.Tensor:
        height, width = sample.shape
        return self.pipe.prepare_latents(
            1, self.denoiser.config.in_channels // 4, height, width, self.dtype, self.device, sample.generator
        )

    def edit_latents(self, stand_in: Any, sample: Sample, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # QwenImageImg2ImgPipeline.prepare_latents reads more of its pipeline than the VAE and scheduler.
        stand_in.vae_scale_factor = self.pipe.vae_scale_factor
        stand_in.latent_channels = self.pipe.vae.config.z_dim
        lend_qwen_img2img(stand_in)
        height, width = sample.shape
        channels = self.denoiser.config.in_channels // 4
        return QwenImageImg2ImgPipeline.prepare_latents(
            stand_in, sample.image, timestep, 1, channels, height, width, dtype, self.device, sample.generator
        )

    def image_shape(self, sample: Sample) -> list[tuple[int, int, int]]:
        """QwenImagePipeline's `img_shapes` entry: (frames, token rows, token columns)."""
        return [(1, *self.token_grid(sample))]

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        rows = [(s, text) for s in samples for text in s.conditioning["rows"]]
        images = [s.latents.shape[1] for s, _ in rows]
        texts = [text.shape[1] for _, text in rows]
        packed = None
        if len(set(images)) > 1 or len(set(texts)) > 1:
            # The RoPE tables each row's solo call computes (QwenImageTransformer2DModel.forward), one per row.
            packed = PackedStreams(
                text=tuple(texts),
                image=tuple(images),
                rotary=tuple(
                    self.denoiser.pos_embed([self.image_shape(s)], max_txt_seq_len=n, device=self.device)
                    for (s, _), n in zip(rows, texts, strict=True)
                ),
            )
        longest = rows[images.index(max(images))][0]
        output = self.predict(
            hidden_states=torch.cat([padded(s.latents, max(images)) for s, _ in rows]),
            # diffusers: the timestep in the latents' dtype, then / 1000.
            timestep=torch.cat([s.timestep.expand(1).to(s.latents.dtype) for s, _ in rows]) / 1000,
            encoder_hidden_states=torch.cat([padded(text, max(texts)) for _, text in rows]),
            encoder_hidden_states_mask=None,  # packed: each row attends to its own text; else no row is padded
            img_shapes=[self.image_shape(longest)] * len(rows),
            attention_kwargs={"packed": packed} if packed else None,
        )
        predictions, counts = [], [len(s.conditioning["rows"]) for s in samples]
        for sample, prediction in zip(samples, output.split(counts), strict=True):
            prediction = prediction[:, : sample.latents.shape[1]]  # its own tokens: the padding dropped
            if len(prediction) == 2:
                negative, positive = prediction.chunk(2)
                combined = negative + self.true_cfg_scale(sample) * (positive - negative)
                # diffusers: the guided prediction rescaled, token by token, to the positive prediction's norm.
                scale = torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
                prediction = combined * scale
            predictions.append(prediction)
        return predictions

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_latents(self.pipe.vae, latents)

    def frame(self, decoded: torch.Tensor) -> torch.Tensor:
        return decoded[:, :, 0]  # (N, 3, 1 frame, H, W)


def wan_vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Denoised latents as a Wan-style 3-D VAE (Wan's, Qwen-Image's) decodes them: un-normalised per channel."""
    config = vae.config
    latents = latents.to(vae.dtype)
    view = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(view).to(latents.device, latents.dtype)
    std = 1.0 / torch.tensor(config.latents_std).view(view).to(latents.device, latents.dtype)
    return latents / std + mean  # diffusers' order of operations: divided by the inverse


class WanFamily(Family):
    """Wan 2.1 text-to-video (WanPipeline): a sample is a video, its latents (1, C, frames, h, w) with the VAE's
    time compression (4k + 1 frames -> k + 1 latent frames); guidance as the pipeline's two calls, one call of two rows
    here. Videos of one frame count and size share a call (`Sample.latent_key`); each decodes alone (the causal VAE
    decodes a clip frame by frame with its chunk cache) into float frames (frames, H, W, 3)."""

    denoiser_name = "transformer"
    takes_latents = False
    decodes_alone = True
    DEFAULT_FRAMES = 9  # the embedded model's: 3 latent frames

    @classmethod
    def serves(cls, pipe) -> bool:
        return type(pipe).__name__ == "WanPipeline"

    @functools.cached_property
    def text_tokens(self) -> int:
        """The text length every prompt is padded to, as WanPipeline calls it (its `encode_prompt` defaults to
        another): the zero padding is attended to, so it must be the pipeline's."""
        return inspect.signature(type(self.pipe).__call__).parameters["max_sequence_length"].default

    @property
    def frame_step(self) -> int:
        """A clip's frames are frame_step x k + 1: its VAE compresses time frame_step times after the first frame."""
        return int(self.pipe.vae_scale_factor_temporal)

    def frames(self, params: DiffusionSamplingParams) -> int:
        """The frames `params` ask for (None: DEFAULT_FRAMES), refused (a 400 naming `num_frames`) where the VAE
        cannot make them."""
        frames, step = params.num_frames or self.DEFAULT_FRAMES, self.frame_step
        if (frames - 1) % step:
            raise InvalidRequestError(
                f"num_frames must be {step}k + 1 for this model (its VAE compresses time {step}x), got {frames}",
                param="num_frames",
                code="invalid_value",
            )
        return frames

    def encode(self, samples: list[Sample]) -> None:
        cond, uncond = self.pipe.encode_prompt(
            prompt=[s.prompt for s in samples],
            negative_prompt=[s.params.negative_prompt or "" for s in samples],
            do_classifier_free_guidance=True,
            num_videos_per_prompt=1,
            max_sequence_length=self.text_tokens,
            device=self.device,
        )
        for i, sample in enumerate(samples):
            rows = torch.cat([uncond[i : i + 1], cond[i : i + 1]]) if sample.cfg else cond[i : i + 1]
            sample.conditioning = {"encoder_hidden_states": rows}

    def timesteps(self, sample: Sample):
        return _timesteps(sample.scheduler, sample.params.num_inference_steps, self.device, sample.params.sigmas)

    def initial_latents(self, sample: Sample) -> torch.Tensor:
        height, width = sample.shape
        return self.pipe.prepare_latents(
            1,
            self.denoiser.config.in_channels,
            height,
            width,
            self.frames(sample.params),
            torch.float32,  # the pipeline's own latents dtype, whatever the transformer's
            self.device,
            sample.generator,
        )

    def denoise(self, samples: list[Sample]) -> list[torch.Tensor]:
        inputs = [_rows(s, s.latents.to(self.dtype)) for s in samples]
        output = self.predict(
            hidden_states=torch.cat(inputs),
            timestep=torch.cat([s.timestep.expand(x.shape[0]) for s, x in zip(samples, inputs, strict=True)]),
            encoder_hidden_states=torch.cat([s.conditioning["encoder_hidden_states"] for s in samples]),
        )
        return [guided(s, rows) for s, rows in zip(samples, output.split([x.shape[0] for x in inputs]), strict=False)]

    def to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_latents(self.pipe.vae, latents)

    def decode(self, latents: torch.Tensor, shape: tuple[int, int]):
        """Each video alone: float frames (frames, H, W, 3) in [0, 1], as WanPipeline's np output."""
        videos = [self.pipe.vae.decode(self.to_vae(one), return_dict=False)[0] for one in latents.split(1)]
        return [self.pipe.video_processor.postprocess_video(video, output_type="np")[0] for video in videos]


FAMILIES = (UNetFamily, SDXLFamily, DiTFamily, FluxFamily, QwenImageFamily, WanFamily)


def family_for(pipe) -> Family | None:
    """The family that drives `pipe` step by step, or None (the stage then batches whole requests)."""
    for family in FAMILIES:
        if family.serves(pipe):
            return family(pipe)
    return None
