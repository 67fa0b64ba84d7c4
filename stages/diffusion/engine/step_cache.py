"""Per-sample step caching: a sample's denoiser call skipped while its input barely changes, decided from its own
values alone.

TeaCache's rule (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"): at each step
the relative L1 change of the model's input since the previous step is accumulated; while the sum stays under the
threshold the last computed output is reused, and once it reaches it the model runs and the sum starts again. The
first and the last step always run. Two departures, both for the step engine:
- The decision is made for each sample from that sample's tensors, each a (1, ...) tensor reduced whole, never from a
  batch-wide mean (ali-vilab/TeaCache #30 decides for the whole batch, so a sample's image follows its neighbours).
  With the batch-invariant kernels on, a cached sample co-batched with anything gives its solo bytes.
- The signal is the denoiser's input latents (the family's `cache_signal`), not the first block's timestep-modulated
  input: that needs a partial forward per family. TeaCache's per-model rescaling polynomials are calibrated on
  published checkpoints; none applies to these models, so the change is used as it is.
What is reused is the sample's last guided prediction (the noise or velocity its scheduler steps with): a cached
sample's rows stay out of the step's denoiser call, so the call is smaller and skipping saves real work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from contracts.sampling import StepCache


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
