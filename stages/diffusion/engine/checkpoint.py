"""A sample's whole state at a step boundary, as bytes another replica can resume it from.

What a sample carries from one step to the next, and nothing else: its latents, its scheduler's mutable state (step
index, sigmas, a multistep solver's past predictions), its generator's state (the noise an ancestral scheduler still
draws), its step, its step cache (what it accumulated, the prediction it reuses) and its provenance counters. What is
made again on the replica that resumes it, from the request alone: its text conditioning, its adapters, its
scheduler's configuration and timesteps (`Family.prepare`). With the batch-invariant kernels on, nothing about a
sample depends on the batch it ran in, so a sample resumed from its state at step k ends with exactly the bytes of its
uninterrupted render (tests/stages/test_checkpoint.py, with a control that drops part of the state).

The bytes are `torch.save`'s and are loaded with pickle: a checkpoint is made by this service's own replicas and
passed between them (`contracts.results.RenderCheckpoint`), never taken from a client. A replica resumes only the
checkpoints of its own identity (`made_by`: what decides the bits), so a state is never continued by other arithmetic.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch

from stages.diffusers_private import restore_scheduler_state, scheduler_state

from .sample import Sample


def made_by(configuration: Any, batch_invariant: bool) -> str:
    """The identity a checkpoint is resumed under: a digest of the replica's configuration (`contracts.scope`: model,
    weights, dtype, device, kernel path, versions, kernels, threads, batching mode) and its switch. Replicas of one
    identity compute the same bits from one state; a checkpoint of another identity is started anew."""
    return hashlib.sha256(f"{configuration.model_dump_json()} {batch_invariant}".encode()).hexdigest()


def export_state(sample: Sample) -> bytes:
    """The sample's state after its `sample.step` steps (call between steps, on the engine's thread)."""
    state = {
        "step": sample.step,
        "latents": sample.latents,
        "prediction": sample.prediction,
        "scheduler": scheduler_state(sample.scheduler),
        "generator": sample.generator.get_state(),
        "cache": sample.cache,
        "largest_batch": sample.largest_batch,
        "steps_co_batched": sample.steps_co_batched,
        "steps_computed": sample.steps_computed,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class Moved(Exception):
    """A sample handed off at a step boundary (`StepEngine.hand_off`): its state after `step` steps for a replica of
    the same identity to go on from (None: it had not stepped, and starts anew there)."""

    def __init__(self, step: int, state: bytes | None):
        super().__init__(f"handed off after step {step}")
        self.step, self.state = step, state

    @classmethod
    def of(cls, sample: Sample) -> Moved:
        return cls(sample.step, export_state(sample) if sample.step else None)


def resume(sample: Sample) -> None:
    """A prepared sample that resumes (`sample.resume`) put in its checkpoint's state; any other left as it is."""
    if sample.resume is not None:
        import_state(sample, sample.resume)


def import_state(sample: Sample, data: bytes) -> None:
    """Put a prepared sample (`Family.prepare`: its scheduler, timesteps and generator made from its request) in the
    state `data` records."""
    state = torch.load(io.BytesIO(data), weights_only=False)  # its tensors where they were: one deployment's device
    if not 0 < state["step"] < len(sample.timesteps):
        raise ValueError(f"a checkpoint after step {state['step']} of a sample of {len(sample.timesteps)} steps")
    restore_scheduler_state(sample.scheduler, state["scheduler"])
    sample.generator.set_state(state["generator"])
    sample.step, sample.latents, sample.prediction = state["step"], state["latents"], state["prediction"]
    sample.cache = state["cache"]
    sample.largest_batch, sample.steps_co_batched = state["largest_batch"], state["steps_co_batched"]
    sample.steps_computed = state["steps_computed"]
