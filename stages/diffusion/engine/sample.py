"""One image being denoised: its request, its own scheduler, generator and latents, and what it shared; its step
cache (the steps it skips, decided from its own values) and its whole state at a step boundary (the checkpoint another
replica resumes it from)."""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from contracts.sampling import DiffusionSamplingParams, StepCache
from stages.diffusers_private import restore_scheduler_state, scheduler_state

# Per-sample step caching: a sample's denoiser call skipped while its input barely changes, decided from its own
# values alone.
#
# TeaCache's rule (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"): at each step
# the relative L1 change of the model's input since the previous step is accumulated; while the sum stays under the
# threshold the last computed output is reused, and once it reaches it the model runs and the sum starts again. The
# first and the last step always run. Two departures, both for the step engine:
# - The decision is made for each sample from that sample's tensors, each a (1, ...) tensor reduced whole, never from a
#   batch-wide mean (ali-vilab/TeaCache #30 decides for the whole batch, so a sample's image follows its neighbours).
#   With the batch-invariant kernels on, a cached sample co-batched with anything gives its solo bytes.
# - The signal is the denoiser's input latents (the family's `cache_signal`), not the first block's timestep-modulated
#   input: that needs a partial forward per family. TeaCache's per-model rescaling polynomials are calibrated on
#   published checkpoints; none applies to these models, so the change is used as it is.
# What is reused is the sample's last guided prediction (the noise or velocity its scheduler steps with): a cached
# sample's rows stay out of the step's denoiser call, so the call is smaller and skipping saves real work.


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean |current - previous| / mean |previous|, over one sample's tensor, in float64 (fixed order: one tensor)."""
    current, previous = current.double(), previous.double()
    return float((current - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12))


@dataclass
class CachedSteps:
    """One sample's step cache: its policy, what it accumulated, and its last computed prediction."""

    threshold: float
    previous: torch.Tensor | None = None  # its signal at the previous step
    accumulated: float = 0.0
    prediction: torch.Tensor | None = None  # its guided prediction at its last computed step
    computed: int = 0
    reused: int = 0

    @classmethod
    def of(cls, policy: StepCache | None) -> CachedSteps | None:
        return cls(float(policy.threshold)) if policy is not None and policy.threshold is not None else None

    def computes(self, signal: torch.Tensor, step: int, steps: int) -> bool:
        """Whether this step runs the denoiser for the sample (TeaCache's rule on its own signal)."""
        if self.previous is not None:
            self.accumulated += relative_l1(signal, self.previous)
        self.previous = signal
        if step == 0 or step == steps - 1 or self.prediction is None or self.accumulated >= self.threshold:
            self.accumulated = 0.0
            return True
        return False

    def kept(self, prediction: Any) -> torch.Tensor:
        """The prediction the sample steps with: a fresh one (kept for later steps), else the one kept."""
        if prediction is not None:
            self.prediction, self.computed = prediction, self.computed + 1
            return prediction
        assert self.prediction is not None  # `computes` runs the first step
        self.reused += 1
        return self.prediction


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
    # Step-boundary checkpoints (`Sample.export_state`): (steps done, state) after every
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
    # Step caching (`CachedSteps` above), None: every step computed; and the steps whose denoiser call
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

    def export_state(self) -> bytes:
        """The sample's state after its `step` steps (call between steps, on the engine's thread)."""
        state = {
            "step": self.step,
            "latents": self.latents,
            "prediction": self.prediction,
            "scheduler": scheduler_state(self.scheduler),
            "generator": self.generator.get_state(),
            "cache": self.cache,
            "largest_batch": self.largest_batch,
            "steps_co_batched": self.steps_co_batched,
            "steps_computed": self.steps_computed,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def restore(self) -> None:
        """A prepared sample that resumes (`resume`) put in its checkpoint's state; any other left as it is."""
        if self.resume is not None:
            self.import_state(self.resume)

    def import_state(self, data: bytes) -> None:
        """Put this prepared sample (`Family.prepare`: its scheduler, timesteps and generator made from its request) in the
        state `data` records."""
        state = torch.load(io.BytesIO(data), weights_only=False)  # its tensors where they were: one deployment's device
        if not 0 < state["step"] < len(self.timesteps):
            raise ValueError(f"a checkpoint after step {state['step']} of a sample of {len(self.timesteps)} steps")
        restore_scheduler_state(self.scheduler, state["scheduler"])
        self.generator.set_state(state["generator"])
        self.step, self.latents, self.prediction = state["step"], state["latents"], state["prediction"]
        self.cache = state["cache"]
        self.largest_batch, self.steps_co_batched = state["largest_batch"], state["steps_co_batched"]
        self.steps_computed = state["steps_computed"]


def preview_steps(steps: int, count: int) -> tuple[int, ...]:
    """After which of `steps` denoising steps to decode `count` partial images: evenly spaced, never after the last
    (that one is the image itself), so fewer than `count` when there are too few steps."""
    return tuple(sorted({min(max(round(steps * j / (count + 1)), 1), steps - 1) for j in range(1, count + 1)} - {0}))


# A sample's whole state at a step boundary, as bytes another replica can resume it from (`Sample.export_state`,
# `Sample.import_state`).
#
# What a sample carries from one step to the next, and nothing else: its latents, its scheduler's mutable state (step
# index, sigmas, a multistep solver's past predictions), its generator's state (the noise an ancestral scheduler still
# draws), its step, its step cache (what it accumulated, the prediction it reuses) and its provenance counters. What is
# made again on the replica that resumes it, from the request alone: its text conditioning, its adapters, its
# scheduler's configuration and timesteps (`Family.prepare`). With the batch-invariant kernels on, nothing about a
# sample depends on the batch it ran in, so a sample resumed from its state at step k ends with exactly the bytes of its
# uninterrupted render (tests/stages/test_checkpoint.py, with a control that drops part of the state).
#
# The bytes are `torch.save`'s and are loaded with pickle: a checkpoint is made by this service's own replicas and
# passed between them (`contracts.results.RenderCheckpoint`), never taken from a client. A replica resumes only the
# checkpoints of its own identity (`made_by`: what decides the bits), so a state is never continued by other arithmetic.


def made_by(configuration: Any, batch_invariant: bool) -> str:
    """The identity a checkpoint is resumed under: a digest of the replica's configuration (`contracts.scope`: model,
    weights, dtype, device, kernel path, versions, kernels, threads, batching mode) and its switch. Replicas of one
    identity compute the same bits from one state; a checkpoint of another identity is started anew."""
    return hashlib.sha256(f"{configuration.model_dump_json()} {batch_invariant}".encode()).hexdigest()


class Moved(Exception):
    """A sample handed off at a step boundary (`StepEngine.hand_off`): its state after `step` steps for a replica of
    the same identity to go on from (None: it had not stepped, and starts anew there)."""

    def __init__(self, step: int, state: bytes | None):
        super().__init__(f"handed off after step {step}")
        self.step, self.state = step, state

    @classmethod
    def of(cls, sample: Sample) -> Moved:
        return cls(sample.step, sample.export_state() if sample.step else None)
