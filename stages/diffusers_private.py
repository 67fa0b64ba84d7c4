"""What the project reads of diffusers that diffusers does not publish: one home, guarded by the version it was read
from (as `stages.serve_replica` is for Ray Serve and `stages.kernels.vllm_mode` for vLLM).

The step engine drives a pipeline's parts one step at a time, so it calls helpers diffusers keeps private to its own
`__call__`: SDXL's time ids, FLUX's and Qwen-Image's latent packing and image ids, their img2img pipelines' VAE
encoding (lent to the engine's stand-in pipeline), FLUX's and Wan's attention projections (the packed and sequence-parallel attention processors), a
scheduler's mutable state (a step-boundary checkpoint), and Wan's float32 module list (building the tiny Wan). Each
was read from diffusers 0.42 (`READ_FROM`). On another diffusers a replica still starts, says so once in its log, and
its configuration (which names the diffusers version) is unverified until an audit or its self-audit proves it; a
helper that is gone raises `DiffusersPrivateError` naming it and the version, not an AttributeError deep in a step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import diffusers
import torch
from diffusers import (
    FluxImg2ImgPipeline,
    FluxPipeline,
    QwenImageImg2ImgPipeline,
    QwenImagePipeline,
    WanTransformer3DModel,
)
from diffusers.models.transformers import transformer_flux, transformer_wan

logger = logging.getLogger("ray.serve")

#: The diffusers versions whose private helpers below were read.
READ_FROM = ("0.42.",)
#: Scheduler attributes that are its configuration (made again from the model by the replica that resumes), not state.
SCHEDULER_CONFIGURATION = frozenset({"_internal_dict"})


class DiffusersPrivateError(RuntimeError):
    """A diffusers helper the step engine calls is not where diffusers `READ_FROM` kept it."""


@functools.cache
def _checked_version() -> None:
    if not diffusers.__version__.startswith(READ_FROM):
        logger.warning(
            "diffusers %s: the step engine calls private helpers read from diffusers %s; the replica's self-check and "
            "audit records decide whether its bits are verified",
            diffusers.__version__,
            ", ".join(READ_FROM),
        )


def _private(owner: Any, name: str) -> Any:
    _checked_version()
    try:
        return getattr(owner, name)
    except AttributeError:
        raise DiffusersPrivateError(
            f"diffusers {diffusers.__version__} has no {getattr(owner, '__name__', type(owner).__name__)}.{name}, "
            f"which the step engine calls (read from diffusers {', '.join(READ_FROM)})"
        ) from None


def sdxl_time_ids(pipe: Any, size: tuple[int, int], dtype: torch.dtype, projection_dim: int) -> torch.Tensor:
    """SDXL's micro-conditioning for an image of `size` (h, w), uncropped, as its pipeline makes it."""
    return _private(pipe, "_get_add_time_ids")(
        size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=projection_dim
    )


def unpack_latents(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A packed family's tokens back to (B, C, h, w) latents (FLUX, Qwen-Image)."""
    return _private(pipe, "_unpack_latents")(latents, height, width, pipe.vae_scale_factor)


def lend_flux_img2img(stand_in: Any) -> None:
    """The helpers FluxImg2ImgPipeline.prepare_latents calls on its pipeline, lent to the engine's stand-in."""
    stand_in._prepare_latent_image_ids = _private(FluxPipeline, "_prepare_latent_image_ids")
    stand_in._pack_latents = _private(FluxPipeline, "_pack_latents")
    stand_in._encode_vae_image = functools.partial(_private(FluxImg2ImgPipeline, "_encode_vae_image"), stand_in)


def lend_qwen_img2img(stand_in: Any) -> None:
    """The helpers QwenImageImg2ImgPipeline.prepare_latents calls on its pipeline, lent to the engine's stand-in."""
    stand_in._pack_latents = _private(QwenImagePipeline, "_pack_latents")
    stand_in._encode_vae_image = functools.partial(_private(QwenImageImg2ImgPipeline, "_encode_vae_image"), stand_in)


def flux_qkv_projections(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """FLUX attention's query, key and value projections (image, then text), as FluxAttnProcessor computes them."""
    return _private(transformer_flux, "_get_qkv_projections")(attn, hidden_states, encoder_hidden_states)


def wan_qkv_projections(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """Wan attention's query, key and value projections (keys and values of the text in its cross-attention), as
    WanAttnProcessor computes them (fused or not)."""
    return _private(transformer_wan, "_get_qkv_projections")(attn, hidden_states, encoder_hidden_states)


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """A scheduler's mutable state (its step index, begin index, a multistep solver's history...): every attribute
    but its configuration."""
    _checked_version()
    return {name: value for name, value in vars(scheduler).items() if name not in SCHEDULER_CONFIGURATION}


def restore_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    """Put a scheduler made from the same model and request in the state `scheduler_state` took."""
    _checked_version()
    vars(scheduler).update(state)


@contextlib.contextmanager
def wan_in_one_dtype() -> Iterator[None]:
    """Wan's transformer asks to keep some modules in float32 (`_keep_in_fp32_modules`), which diffusers 0.42 can load
    only through `accelerate` (not a dependency); the pipeline is cast to one dtype after loading anyway, so the
    request is dropped while loading (float32 loads are unchanged by it)."""
    kept = _private(WanTransformer3DModel, "_keep_in_fp32_modules")
    WanTransformer3DModel._keep_in_fp32_modules = None
    try:
        yield
    finally:
        WanTransformer3DModel._keep_in_fp32_modules = kept
