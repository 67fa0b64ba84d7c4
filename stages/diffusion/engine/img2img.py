"""Image edits (image-to-image) on the step engine: each edit prepared exactly as diffusers' img2img pipeline does.

An edit is a sample with an init image and a strength. It joins, shares forwards, steps and decodes like any
other sample; only its preparation differs, and that preparation is the one of its family's diffusers
pipeline (`StableDiffusionImg2ImgPipeline`, `StableDiffusion3Img2ImgPipeline`), on the sample's own scheduler
and generator, after the family has set the full schedule (`retrieve_timesteps`) and the generator:

    timesteps  `get_timesteps(steps, strength)`: the schedule's last part only (`scheduler.set_begin_index`)
    latents    `prepare_latents`: VAE-encode the image, sample its latent distribution with the sample's
               generator (`retrieve_latents`), scale (and shift), draw the noise from the same generator,
               and noise the image to the first timestep (`add_noise`, or `scale_noise` for flow matching)

The pipelines' own methods are called on a stand-in that holds the sample's scheduler and the VAE, so the
arithmetic and the order of random draws are diffusers' to the letter. diffusers encodes each image on its own
when given one generator per sample; so does this, whatever the batch.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from contracts.sampling import DEFAULT_STRENGTH, DiffusionSamplingParams

if TYPE_CHECKING:
    from .families import Family
    from .sample import Sample


def strength_of(params: DiffusionSamplingParams) -> float:
    return DEFAULT_STRENGTH if params.strength is None else params.strength


def edit_steps(family: Family, steps: int, strength: float) -> int:
    """How many denoising steps an edit of `steps` steps at `strength` runs (diffusers' rule; 0: none)."""
    schedule = SimpleNamespace(scheduler=SimpleNamespace(timesteps=list(range(steps)), order=1))
    return len(family.edit_pipeline.get_timesteps(schedule, steps, strength, None)[0])


def prepare_edit(family: Family, sample: Sample) -> None:
    """The sample's schedule cut at its strength, and its initial latents: its image, noised to the first timestep."""
    pipeline = family.edit_pipeline
    stand_in = SimpleNamespace(scheduler=sample.scheduler, vae=family.pipe.vae)
    steps = sample.params.num_inference_steps
    sample.timesteps, _ = pipeline.get_timesteps(stand_in, steps, strength_of(sample.params), family.device)
    dtype = sample.conditioning["encoder_hidden_states"].dtype  # diffusers: the prompt embeddings' dtype
    first = sample.timesteps[:1].repeat(1)
    sample.latents = family.edit_latents(stand_in, sample, first, dtype)
