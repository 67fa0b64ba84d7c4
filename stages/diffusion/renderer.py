"""The renderer: one loaded diffusers pipeline and the rules for filling and rendering requests. No Ray, no HTTP.

BatchKey, Job      what decides whether two requests may share a whole-request batch; one image to render
encode_png         float pixels -> PNG bytes with the image's record in its text chunks (`contracts.provenance`)
DiffusionRenderer  loads the pipeline (kernels first, when the switch is on; without them it refuses to start
                   rather than serve batch-dependent bytes), fills a request's defaults, refuses what this
                   model cannot render, and renders a batch of same-key requests through the pipeline
                   itself (the audit and the request-level mode use it).
"""

from __future__ import annotations

import inspect
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.admission import ModelCapabilities
from contracts.config import DiffusionStageConfig
from contracts.cpu import hold_process_to_path
from contracts.errors import InvalidRequestError
from contracts.provenance import ImageOrigin, ImageRecord
from contracts.sampling import DiffusionSamplingParams, LoraChoice, StepCache, quality_steps, seed_or_picked
from stages.diffusion.engine import family_for
from stages.diffusion.engine.families import Family, vae_slicing
from stages.diffusion.engine.sample import seeded_generator
from stages.diffusion.lora import AdapterLibrary
from stages.diffusion.self_audit import leave_kernels_out_under_test_fault
from stages.diffusion.video_file import quantized
from stages.embedded import DEFAULT_MODELS, EMBEDDED_MODELS, embedded_adapters


@dataclass(frozen=True)
class BatchKey:
    """Everything that changes tensor shapes or the schedule: only equal keys share a forward. Its parts are the
    sampling fields marked `batch` (`contracts.sampling.DiffusionSamplingParams.batch_parts`), read as attributes
    (`key.height`, `key.has_latents`)."""

    parts: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, params: DiffusionSamplingParams) -> BatchKey:
        return cls(params.batch_parts())

    def __getattr__(self, name: str) -> Any:
        for part, value in self.parts:
            if part == name:
                return value
        raise AttributeError(name)


@dataclass(frozen=True)
class Job:
    """One image to render: its prompt, its resolved params, for an edit its init image, and what its PNG records."""

    prompt: str
    params: DiffusionSamplingParams  # resolved: no None left but negative_prompt/latents/sigmas/device
    image: Any = (
        None  # edits: the init image, preprocessed (1, 3, H, W) (stages.diffusion.engine.img2img); None: text-to-image
    )
    source: bytes | None = None  # edits: the init image as sent (its sha256 goes into the PNG's record)
    origin: ImageOrigin | None = None  # the client's prompt and its rewrite, when the ingress sent it
    previews: tuple[int, ...] = ()  # the steps after which a partial image is decoded (streaming)
    checkpoint_every: int = 0  # steps between two step-boundary checkpoints (0: none)
    resume: bytes | None = None  # a checkpoint's state to go on from (None: the first step)


def encode_png(image, record: ImageRecord | None = None) -> bytes:
    """float HxWx3 in [0, 1] -> PNG bytes, the way diffusers quantises (round(x * 255)), with the record's chunks."""
    import numpy as np
    from PIL import Image

    pixels = quantized(np.asarray(image))
    buffer = io.BytesIO()
    pnginfo = record.png_info() if record is not None else None  # none: no text chunks, as an empty PngInfo
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=6, pnginfo=pnginfo)
    return buffer.getvalue()


class ModelDirectoryError(ValueError):
    """The configured diffusion model is a local path that is not a diffusers model directory this diffusers loads,
    or its pipeline is not one this stage can serve."""


#: What the stage hands every pipeline it serves (`DiffusionRenderer._pipeline_inputs`): a pipeline whose `__call__`
#: lacks one of these is not a text-to-image pipeline this stage can drive (audio, video, upscalers, ...).
SERVED_CALL_PARAMETERS = (
    "prompt",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "generator",
    "output_type",
)


def check_serves(pipeline: type, model: str, video: bool = False) -> None:
    """Refuse, at start-up, a pipeline class this stage cannot call, naming the class and what its call lacks; a video
    pipeline (its call takes `num_frames`) is the video stage's only (`video`), an image one the image stage's."""
    accepted = inspect.signature(pipeline.__call__).parameters
    missing = [name for name in SERVED_CALL_PARAMETERS if name not in accepted]
    if missing:
        raise ModelDirectoryError(
            f"diffusion model {model!r} is a {pipeline.__name__}, which this stage cannot serve: its call takes no "
            f"{', '.join(missing)} (a text-to-image pipeline takes {', '.join(SERVED_CALL_PARAMETERS)})"
        )
    if ("num_frames" in accepted) != video:  # frames or images: what the stage encodes and answers with
        kind, stage = (
            ("a video", "the image stage serves images") if not video else ("an image", "the video stage serves videos")
        )
        raise ModelDirectoryError(f"diffusion model {model!r} is a {pipeline.__name__}, {kind} pipeline: {stage}")


def check_model_directory(model: str, video: bool = False) -> dict[str, Any]:
    """A local `model` must be what `save_pretrained` writes: a model_index.json naming a pipeline class diffusers has;
    returns that index ({} for a hub id, left to diffusers). Raises ModelDirectoryError naming what was found instead."""
    import json

    import diffusers

    path = Path(model).expanduser()
    if not path.exists():
        if model.startswith(("/", ".", "~")):
            raise ModelDirectoryError(f"diffusion model directory {model!r} does not exist")
        return {}
    index = path / "model_index.json"
    if not index.is_file():
        found = sorted(entry.name for entry in path.iterdir())[:8] if path.is_dir() else ["a file, not a directory"]
        raise ModelDirectoryError(
            f"diffusion model {model!r} is not a diffusers model directory: it has no model_index.json "
            f"(found: {', '.join(found) or 'nothing'}); point it at a directory written by save_pretrained"
        )
    try:
        components = json.loads(index.read_text())
        pipeline = components.get("_class_name")
    except (ValueError, AttributeError) as err:
        raise ModelDirectoryError(
            f"diffusion model {model!r}: its model_index.json is not a JSON object ({err})"
        ) from err
    if not isinstance(pipeline, str) or not isinstance(getattr(diffusers, pipeline, None), type):
        raise ModelDirectoryError(
            f"diffusion model {model!r}: its model_index.json names the pipeline class {pipeline!r}, which diffusers "
            f"{diffusers.__version__} does not have"
        )
    check_serves(getattr(diffusers, pipeline), model, video)  # before any weights load
    return components


def load_pipeline(model: str, *, device: str, dtype: str, video: bool = False):
    """An embedded tiny pipeline (built locally) or a diffusers checkpoint, on `device`, progress bars off; `video`: for
    the video stage (a checkpoint of the other kind is refused, before its weights load when it is a directory)."""
    import torch

    if model in EMBEDDED_MODELS:
        from stages.embedded.diffusion import load_tiny_pipeline

        pipe = load_tiny_pipeline(EMBEDDED_MODELS[model].recipe, dtype=getattr(torch, dtype))
    else:
        from diffusers import DiffusionPipeline

        # Components saved as absent ([null, null], e.g. SD3 without T5) must be said absent again at load.
        absent = {name: None for name, entry in check_model_directory(model, video).items() if entry == [None, None]}
        pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=getattr(torch, dtype), **absent)
        check_serves(type(pipe), model, video)  # a hub id's class is known once loaded
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def vae_factor(pipe) -> int:
    """The VAE's spatial downsampling: an image pipeline's `vae_scale_factor`, a video one's (Wan) spatial factor."""
    return getattr(pipe, "vae_scale_factor_spatial", None) or pipe.vae_scale_factor


def model_defaults(pipe, model: str, size_multiple: int, config: DiffusionStageConfig) -> dict:
    """The model's own defaults (the embedded ones are small), overridden by the configured ones."""
    embedded = model in EMBEDDED_MODELS
    # The pipeline's own default size: its denoiser's sample size in latents (SD 1.x pipelines keep no attribute).
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    latent_side = (
        getattr(pipe, "default_sample_size", None)
        or getattr(getattr(denoiser, "config", None), "sample_size", None)
        or 64  # neither: 512 pixels at the usual 8x VAE
    )
    size = 64 if embedded else latent_side * vae_factor(pipe)
    if size * size > config.max_pixels:
        # The model's own size (FLUX, SDXL: 1024) past this server's limit: the largest square within it, so a
        # request that names no size (and the warm-up) is admitted.
        size = math.isqrt(config.max_pixels) // size_multiple * size_multiple
    defaults = {"num_inference_steps": 8 if embedded else 28, "guidance_scale": 5.0, "height": size, "width": size}
    configured = {name: getattr(config.defaults, name) for name in type(config.defaults).model_fields}
    return {**defaults, **{name: value for name, value in configured.items() if value is not None}}  # typed values


def adapter_library(config: DiffusionStageConfig, model: str, pipe, family: Family | None) -> AdapterLibrary:
    """The replica's LoRA adapters: its `lora_dir`, else the embedded model's own; read for the family's denoiser and
    the pipeline's text encoders, in the denoiser's dtype. A pipeline without a family never loads one (requests
    naming one are refused): names only."""
    denoiser = family.denoiser_name if family else "unet"
    return AdapterLibrary(
        config.lora_dir if config.lora_dir is not None else embedded_adapters(model),
        type(pipe),
        (denoiser, *(n for n in Family.TEXT_ENCODERS if getattr(pipe, n, None) is not None)),
        config.lora_cache_mib << 20,
        dtype=family.dtype if family else None,
        device=pipe.device,
    )


def step_cache(cache: StepCache, capabilities: ModelCapabilities, step_engine: bool) -> StepCache:
    """An active step cache as the step engine runs it (whole-request batching refuses it): a threshold left out is
    the one measured for the model's family (its capabilities), filled in here so that the image's record says what
    ran."""
    if not step_engine or capabilities.family is None:
        raise step_engine_only("cache", "step caching is decided per sample", capabilities.model)
    if cache.threshold is not None:
        return cache
    if capabilities.cache_threshold is None:
        raise InvalidRequestError(
            f"no step-caching threshold has been measured for {capabilities.model}'s family ({capabilities.family}): "
            "give one",
            param="cache.threshold",
            code="missing",
        )
    return cache.model_copy(update={"threshold": capabilities.cache_threshold})


def step_engine_only(param: str, what: str, model: str) -> InvalidRequestError:
    """The 400 for a field only the step engine serves, from a replica that batches whole requests."""
    return InvalidRequestError(
        f"{what} by the step engine; this replica renders {model} by whole-request batches",
        param=param,
        code="unsupported_value",
    )


def capabilities(pipe, model: str, family: Family | None, config: DiffusionStageConfig) -> ModelCapabilities:
    """What this loaded model can render (`contracts.admission`), read from its pipeline once."""
    # Sizes must be whole latent patches: the VAE's factor times the DiT's patch size, or, where the family packs 2x2
    # latent pixels into one token (FLUX, Qwen-Image), times that packing (their transformer's patching).
    packing = family.latent_packing if family is not None else 1
    patch = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "patch_size", 1) or 1
    patch = patch[-1] if isinstance(patch, list | tuple) else patch  # a video DiT's (time, height, width)
    per_sample = config.batching == "step" and family is not None  # the step engine runs (the stage's rule too)
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    takes_latents = family is None or family.takes_latents
    return ModelCapabilities(
        model=model,
        device=config.device,
        family=type(family).__name__ if family is not None else None,
        per_sample=per_sample,
        size_multiple=vae_factor(pipe) * (packing if packing > 1 else patch),
        # Stretching one sigma to a terminal value divides 0 by 0 in diffusers' FlowMatchEulerDiscreteScheduler
        # (Qwen-Image's): its image would be NaN.
        min_steps=2 if pipe.scheduler.config.get("shift_terminal") else 1,
        sigmas="sigmas" in inspect.signature(pipe.scheduler.set_timesteps).parameters,
        true_cfg="true_cfg_scale" in inspect.signature(pipe.__call__).parameters,
        latent_channels=denoiser.config.in_channels if denoiser is not None and takes_latents else None,
        vae_factor=vae_factor(pipe),
        schedulers=tuple(sorted(family.SCHEDULERS)) if family is not None else (),
        cache_threshold=family.cache_threshold if family is not None else None,
        frame_step=getattr(family, "frame_step", None),
    )


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
            hold_process_to_path()  # ATen, oneDNN and MKL at the kernel path's level: one path, one machine's bits
        self.torch_threads = config.torch_threads
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # Kernels go in before the model loads, so nothing is built or warmed with stock kernels.
        self.kernels = enable_batch_invariant_kernels(self.device) if self.batch_invariant else current_report()
        if self.batch_invariant and not self.kernels.installed:
            # Fail closed: stock kernels would answer with batch-dependent bytes while promising invariance.
            raise RuntimeError(
                f"diffusion batch invariance is on but its kernels are not installed, so this "
                f"replica refuses to start: {self.kernels.reason}"
            )
        leave_kernels_out_under_test_fault(self.batch_invariant)
        self.model = config.model or DEFAULT_MODELS["diffusion"]
        self.pipe = load_pipeline(self.model, device=self.device, dtype=config.dtype, video=config.serves_video)
        self.family = family_for(self.pipe)  # None: the step engine does not know this pipeline
        self.capabilities = capabilities(self.pipe, self.model, self.family, config)
        self.defaults = model_defaults(self.pipe, self.model, self.capabilities.size_multiple, config)
        self.loras = adapter_library(config, self.model, self.pipe, self.family)
        if self.family is not None:
            self.family.adapters.library = self.loras
        call = inspect.signature(self.pipe.__call__).parameters
        self.prompt_and_size_rewrites = [name for name in ("use_resolution_binning", "clean_caption") if name in call]

    # --- admission of resolved params: what this model can render -------------------------------------

    def resolve(
        self, params: DiffusionSamplingParams, *, step_engine: bool = False, serving_limits: bool = True
    ) -> DiffusionSamplingParams:
        """Fill unset fields with this model's defaults; refuse what exceeds the limits or this model.

        A scheduler other than the model's own is chosen per sample by the step engine only. `serving_limits=False`:
        the replica's own requests (its golden self-check), never a client's, whatever the deployment's limits.
        """
        filled = {k: v for k, v in self.defaults.items() if getattr(params, k) is None}
        if params.quality is not None:  # rendered and recorded as the steps it stands for
            filled |= {
                "quality": None,
                "num_inference_steps": quality_steps(params.quality, self.defaults["num_inference_steps"]),
            }
        if params.seed is None:
            filled["seed"] = seed_or_picked(params.seed)
        resolved = params.model_copy(update=filled) if filled else params
        if serving_limits:
            self.config.check_limits(resolved)
        self.capabilities.check(resolved)
        if resolved.cache is not None and resolved.cache.active:
            cache = step_cache(resolved.cache, self.capabilities, step_engine)
            resolved = resolved.model_copy(update={"cache": cache})
        if resolved.lora:
            resolved = resolved.model_copy(update={"lora": self._adapters(resolved.lora, step_engine)})
        if resolved.scheduler is not None:
            served = list(self.capabilities.schedulers) if step_engine and self.family else []
            if resolved.scheduler not in served:
                raise InvalidRequestError(
                    f"scheduler {resolved.scheduler!r} is not served for {self.model}; choose one of {served} or leave it out",
                    param="scheduler",
                    code="unsupported_value",
                )
        return resolved

    def _adapters(self, choices: list[LoraChoice], step_engine: bool) -> list[LoraChoice]:
        """A request's adapters with their sha256 filled in; refused where this replica cannot apply them per row."""
        if not (step_engine and self.family):
            raise step_engine_only("lora", "LoRA adapters are applied per row", self.model)
        resolved = self.loras.resolve(choices)
        for choice in resolved:
            self.family.adapters.check(self.loras.get(choice.name))
        return resolved

    def request_group(self, job: Job) -> tuple[int, ...]:
        """What a whole-request batch must share besides its batch key: for a pipeline that pads a batch's prompts to
        the longest (Qwen-Image), the token counts of the prompt and the negative prompt, since the padded, masked
        attention gives other bits than a lone prompt's (measured: 12 of 13 co-batched audit runs differed with the
        kernels on, first in the first block's attention); nothing for the others."""
        if self.family is None or not self.family.pads_prompts:
            return ()
        return tuple(self.family.token_counts([job.prompt, job.params.negative_prompt or ""]))

    # --- rendering --------------------------------------------------------------------------------------

    def render(self, jobs: list[Job], **pipeline_kwargs: Any):
        """Render same-key jobs in one forward; returns float images (N, H, W, 3) in [0, 1]."""
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # per thread: OpenMP settings do not follow threads
        key = BatchKey.of(jobs[0].params)
        assert all(BatchKey.of(job.params) == key for job in jobs), "a batch mixes keys"
        kwargs = self._pipeline_inputs(jobs, key)
        alone = self.family is not None and self.family.decodes_alone
        with torch.inference_mode(), vae_slicing(getattr(self.pipe, "vae", None), key.height, key.width, alone=alone):
            return self.pipe(**kwargs, **pipeline_kwargs).images

    def _pipeline_inputs(self, jobs: list[Job], key: BatchKey) -> dict[str, Any]:
        """The pipeline's keyword arguments for one batch: one generator per sample, made here from its seed."""
        import torch

        generators = [seeded_generator(job.params) for job in jobs]
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
        if key.true_cfg_scale is not None:
            kwargs["true_cfg_scale"] = key.true_cfg_scale
        # PixArt and SANA would render at their nearest trained aspect-ratio bin and resize to the requested size, and
        # rewrite the prompt with whatever caption cleaners happen to be installed: a served image is rendered at the
        # size, and from the prompt, the request names.
        kwargs.update({name: False for name in self.prompt_and_size_rewrites})
        if key.has_latents:
            dtype = next(self.pipe.components[c] for c in ("unet", "transformer") if c in self.pipe.components).dtype
            latents = [torch.tensor(job.params.latents, dtype=torch.float32) for job in jobs]  # admitted: their shape
            kwargs["latents"] = torch.stack(latents).to(self.device, dtype)
        return kwargs
