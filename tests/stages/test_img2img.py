"""Image edits (image-to-image) on the step engine: diffusers' img2img bytes, solo and co-batched.

Real tiny pipelines (UNet and DiT), real kernels, the engine's own thread; no Ray. A solo edit gives the bytes of
the diffusers img2img pipeline built from the same components; co-batched with text-to-image samples and edits
at other strengths, an edit gives its solo bytes with the kernels on, and the control (kernels off) must differ.
The stage's own admission of an edit (`DiffusionStage.edit`) is checked here too, without Serve.
"""

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from contracts.config import DiffusionStageConfig
from contracts.errors import InvalidRequestError
from contracts.jobs import RenderJob, final_image
from contracts.sampling import DEFAULT_STRENGTH, DiffusionSamplingParams
from stages.diffusion import DiffusionStage
from stages.diffusion.engine import Sample
from stages.diffusion.engine.families import DiTFamily, UNetFamily
from stages.diffusion.engine.img2img import edit_steps
from stages.embedded import embedded_models

# The invariance verdict of the step-engine tests; the engines are the `engine` fixture (tests/stages/conftest.py).
from .conftest import ENGINES_ON
from .test_step_engine import check

pytestmark = pytest.mark.slow
UNET, DIT, SDXL, FLUX, QWEN = embedded_models("diffusion")
TARGET = ("the same fox, at night", 42)


def picture(seed: int = 0, size: tuple[int, int] = (64, 64)) -> Image.Image:
    """A smooth image with some texture (width, height), from a fixed seed."""
    width, height = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.linspace(0.2, 1, height)[:, None, None]
    return Image.fromarray(np.clip(ramp + rng.normal(0, 24, (height, width, 3)), 0, 255).astype("uint8"))


def edit(engine, prompt, seed, image=None, **fields) -> Sample:
    """An edit of `image` (default: `picture()`), its params resolved as the stage resolves them."""
    fields.setdefault("num_inference_steps", 4)
    params = engine.renderer.resolve(DiffusionSamplingParams(seed=seed, **fields), step_engine=True)
    init = engine.renderer.pipe.image_processor.preprocess(image or picture())
    return Sample(prompt, params, on_done=None, image=init)


def text_to_image(engine, prompt, seed, **fields) -> Sample:
    params = engine.renderer.resolve(DiffusionSamplingParams(seed=seed, num_inference_steps=4, **fields), step_engine=True)
    return Sample(prompt, params, on_done=None)


def diffusers_edit(engine, prompt, seed, *, strength, scheduler=None, image=None) -> np.ndarray:
    """The diffusers img2img pipeline of the engine's family, built from the served pipeline's components.

    A scheduler is swapped in afterwards, the way diffusers documents it (the constructor would rewrite a DDIM
    config's `clip_sample`), which is what the engine does per sample.
    """
    pipe, family = engine.renderer.pipe, engine.renderer.family
    img2img = family.edit_pipeline(**pipe.components)
    if scheduler:
        img2img.scheduler = family.SCHEDULERS[scheduler].from_config(pipe.scheduler.config)
    img2img.set_progress_bar_config(disable=True)
    image = image or picture()
    size = {"height": image.height, "width": image.width} if family.denoiser_name == "transformer" else {}
    with torch.inference_mode():
        return img2img(prompt, image=image, strength=strength, num_inference_steps=4,
                       guidance_scale=engine.renderer.defaults["guidance_scale"],
                       generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **size).images[0]


def test_an_edit_runs_as_many_steps_as_diffusers_img2img_runs():
    assert edit_steps(UNetFamily, 10, 0.8) == edit_steps(DiTFamily, 10, 0.8) == 8
    assert edit_steps(UNetFamily, 4, 1.0) == edit_steps(DiTFamily, 4, 1.0) == 4
    # int(4 * 0.2) = 0 steps for Stable Diffusion; SD3 rounds the other way and keeps one.
    assert (edit_steps(UNetFamily, 4, 0.2), edit_steps(DiTFamily, 4, 0.2)) == (0, 1)


@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)  # bits against diffusers: with the kernels on, as served
def test_a_solo_edit_gives_the_bytes_of_the_diffusers_img2img_pipeline(engine):
    schedulers = [None, *sorted(engine.renderer.family.SCHEDULERS)]
    for strength in (None, 0.5, 1.0):
        for scheduler in schedulers:
            (image,) = engine.render([edit(engine, *TARGET, strength=strength, scheduler=scheduler)])
            expected = diffusers_edit(engine, *TARGET, strength=strength or DEFAULT_STRENGTH, scheduler=scheduler)
            assert np.array_equal(image, expected), (strength, scheduler)


@pytest.mark.parametrize("batch", [3, 8])
def test_cobatched_edits_give_their_solo_bytes(engine, batch):
    """Edits at other strengths, steps, schedulers and images, and text-to-image samples, share the target's forwards."""
    schedulers = sorted(engine.renderer.family.SCHEDULERS)
    edits = [{"prompt": TARGET[0], "seed": TARGET[1], "strength": 0.75}] + [
        {"prompt": f"edit {i}", "seed": 200 + i, "image": picture(i + 1), "strength": (0.5, 1.0, 0.9)[i % 3],
         "scheduler": schedulers[i % len(schedulers)], "num_inference_steps": (4, 6, 3)[i % 3]}
        for i in range((batch - 1) // 2)
    ]
    others = [text_to_image(engine, f"neighbour {i}, a lighthouse", 100 + i, guidance_scale=(5.0, 1.0, 9.5)[i % 3])
              for i in range(batch - len(edits))]
    solos = [engine.render([edit(engine, **spec)])[0] for spec in edits]
    target, *rest = [edit(engine, **spec) for spec in edits]
    together = engine.render([target, *rest, *others])
    assert target.largest_batch == batch
    if engine.invariant:
        assert all(np.array_equal(a, b) for a, b in zip(together, solos))
    check(engine, np.array_equal(together[0], solos[0]))


# --- the stage's admission of an edit (no Serve: the deployment's class itself) ------------------------


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def edited(stage, image: bytes, params: dict):
    """An edit through the stage's one entry point, in this process: the image at the end of its stream."""
    job = RenderJob(prompt="a fox", params=DiffusionSamplingParams(**params), image=image)
    return asyncio.run(final_image(stage.render(job)))


@pytest.fixture(scope="module")
def stage():
    stage = DiffusionStage.func_or_class(DiffusionStageConfig(model=UNET, batch_invariant=False, torch_threads=1, warm_up=False))
    yield stage
    stage.batching.engine.stop()


def test_the_stage_renders_an_edit_at_the_image_size_and_reproduces_it(stage):
    wide = png(picture(3, (96, 64)))
    params = {"seed": 5, "num_inference_steps": 3, "strength": 0.6}
    first = edited(stage, wide, params)
    again = edited(stage, wide, {**params, "width": 96, "height": 64})
    stronger = edited(stage, wide, {**params, "strength": 1.0})  # 3 steps, not int(3 * 0.6) = 1
    assert (first.width, first.height) == (96, 64) and Image.open(io.BytesIO(first.png)).size == (96, 64)
    assert first.png == again.png and stronger.png != first.png


@pytest.mark.parametrize("image, params, param", [
    (b"not an image", {}, "image"),
    (png(picture()), {"width": 128, "height": 128}, "image"),  # not the image's size
    (png(picture(0, (60, 64))), {}, "image"),  # no size asked and the image's is no multiple of 8
    (png(picture(), "GIF"), {}, "image"),
    ("a path, not bytes", {}, "image"),
    (png(picture()), {"strength": 0.2, "num_inference_steps": 4}, "strength"),  # int(4 * 0.2) = 0 steps left
    (png(picture()), {"strength": 0}, "strength"),
    (png(picture()), {"latents": [[[0.0]]]}, "latents"),
], ids=["not-an-image", "wrong-size", "odd-size", "gif", "not-bytes", "no-step-left", "zero-strength", "latents"])
def test_the_stage_refuses_a_bad_edit_naming_the_field(stage, image, params, param):
    with pytest.raises(InvalidRequestError) as refused:
        stage.admission.job(RenderJob.model_construct(prompt="a fox", image=image, params={"seed": 1, **params}))
    assert refused.value.param == param, refused.value.message


def test_request_level_batching_refuses_edits_naming_the_image():
    stage = DiffusionStage.func_or_class(DiffusionStageConfig(model=UNET, batching="request", batch_invariant=False,
                                                             torch_threads=1, warm_up=False))
    with pytest.raises(InvalidRequestError) as refused:
        edited(stage, png(picture()), {"seed": 1})
    assert refused.value.param == "image" and "not served" in refused.value.message
