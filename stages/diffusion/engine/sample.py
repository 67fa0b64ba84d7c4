"""One image being denoised: its request, its own scheduler, generator and latents, and what it shared."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from contracts.sampling import DiffusionSamplingParams

from .step_cache import CachedSteps

#: Where a sample's noise is drawn when its request names no device: the CPU's generator, so one seed gives one noise
#: whatever accelerator renders it.
DEFAULT_GENERATOR_DEVICE = "cpu"


def seeded_generator(params: DiffusionSamplingParams):
    """The one seed -> generator rule: a fresh torch.Generator per sample, never shared or reused, on its device,
    seeded with its own seed (so a sample's noise depends on its own seed only)."""
    import torch

    assert params.seed is not None  # resolved params: the seed is set
    return torch.Generator(params.generator_device or DEFAULT_GENERATOR_DEVICE).manual_seed(params.seed)


@dataclass(eq=False)
class Sample:
    prompt: str
    params: DiffusionSamplingParams  # resolved: every field the model needs is set (hence the casts below)
    # Called from the engine thread with the float image or an exception. None: unset (`StepEngine.render` sets it).
    on_done: Callable[[Any], None] | None
    on_partial: Callable[[int, Any], None] | None = None  # (partial index, float image) at `partial_steps`
    partial_steps: tuple[int, ...] = ()
    on_step: Callable[[int], None] | None = None  # (steps done) after each of its denoising steps: progress
    # Step-boundary checkpoints (stages.diffusion.engine.checkpoint): (steps done, state) after every
    # `checkpoint_every` steps but the last; `resume`: a state it starts from instead of its first step.
    on_checkpoint: Callable[[int, bytes], None] | None = None
    checkpoint_every: int = 0
    resume: bytes | None = None
    # Image edits: the init image, preprocessed by the pipeline's image processor, (1, 3, H, W); None: text-to-image.
    image: Any = None
    arrival: int = 0
    # time.monotonic() when it was made and when it left the queue for the running batch: its queue wait (metrics).
    created_at: float = field(default_factory=time.monotonic)
    joined_at: float | None = None
    cancelled: bool = False
    # Set by the family when the sample joins.
    scheduler: Any = None
    step_kwargs: frozenset[str] = frozenset()
    timesteps: Any = None
    generator: Any = None
    latents: Any = None
    prediction: Any = None  # the scheduler's estimate of the final latents, after the last step (if it gives one)
    conditioning: dict[str, Any] = field(default_factory=dict)
    adapters: tuple = ()  # its LoRA adapters and scales, in its request's order (stages.diffusion.lora.RowAdapters)
    step: int = 0
    # Provenance: the most samples that shared one of its forwards, and how many of its steps were shared.
    largest_batch: int = 0
    steps_co_batched: int = 0
    # Forwards it waited through while others ran (ages it, so a long sample is never starved).
    skipped: int = 0
    # Step caching (stages.diffusion.engine.step_cache), None: every step computed; and the steps whose denoiser call
    # held its rows.
    cache: CachedSteps | None = None
    steps_computed: int = 0

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance, as the pipelines decide it."""
        return cast(float, self.params.guidance_scale) > 1.0

    @property
    def shape(self) -> tuple[int, int]:
        return (cast(int, self.params.height), cast(int, self.params.width))

    @property
    def latent_key(self) -> tuple[int, int, int]:
        """What samples sharing a denoiser call (of a family that does not pack sizes) have in common: their frames
        (0: an image) and size."""
        return (self.params.num_frames or 0, *self.shape)

    @property
    def timestep(self):
        return self.timesteps[self.step]

    @property
    def remaining(self) -> int:
        return (
            len(self.timesteps) - self.step
            if self.timesteps is not None
            else cast(int, self.params.num_inference_steps)
        )

    def stepped(self) -> None:
        """Tell its caller (progress) that a step is done."""
        if self.on_step is not None and not self.cancelled:
            self.on_step(self.step)

    @property
    def finished(self) -> bool:
        return self.timesteps is not None and self.step >= len(self.timesteps)


def preview_steps(steps: int, count: int) -> tuple[int, ...]:
    """After which of `steps` denoising steps to decode `count` partial images: evenly spaced, never after the last
    (that one is the image itself), so fewer than `count` when there are too few steps."""
    return tuple(sorted({min(max(round(steps * j / (count + 1)), 1), steps - 1) for j in range(1, count + 1)} - {0}))
