"""The diffusion stage's step engine: per-sample schedulers, continuous batching of denoising steps.

families   what a pipeline family does per step (UNet: Stable Diffusion; DiT: Stable Diffusion 3)
img2img    an edit's start: its timesteps cut by strength, its image encoded and noised (diffusers' own steps)
sample     one image being denoised
engine     the loop: samples join and leave between steps, one denoiser call per step
"""

from .engine import StepEngine
from .families import Family, family_for
from .sample import Sample

__all__ = ["Family", "Sample", "StepEngine", "family_for"]
