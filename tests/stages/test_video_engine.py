"""Text to video on the step engine (issue 28, item 2): the tiny Wan 2.1 build (`omniserve/tiny-wan-video`: WanPipeline,
its video DiT, causal 3-D VAE and UMT5 encoder, random weights made here) driven sample by sample by `WanFamily`.

With the batch-invariant kernels on, a video rendered alone gives WanPipeline's own frames, and co-batched with unlike
videos (other prompts, seeds, step counts, guidance, frame counts) its solo frames, bit for bit. The control is the
same co-batched render with stock kernels: it must differ, or the check could not fail (else it skips, saying so).
"""

import numpy as np
import pytest
import torch

from contracts.config import DiffusionStageConfig
from contracts.cpu import cpu_isa
from contracts.errors import InvalidRequestError
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.families import WanFamily
from stages.embedded import EMBEDDED_MODELS
from stages.kernels import disable_batch_invariant_kernels

pytestmark = pytest.mark.slow
TARGET = ("a red fox running through snow", 42)
(WAN,) = (m.id for m in EMBEDDED_MODELS.values() if m.recipe == "wan")


def video(prompt: str, seed: int, *, steps: int = 4, guidance: float = 5.0, frames: int = 9) -> Sample:
    params = DiffusionSamplingParams(
        seed=seed, num_inference_steps=steps, guidance_scale=guidance, height=64, width=64, num_frames=frames
    )
    return Sample(prompt, params, on_done=None)


@pytest.fixture(scope="module", params=[True, False], ids=["on", "control"])
def engine(request):
    disable_batch_invariant_kernels()
    # The diffusion stage's own renderer: the kernels before the model, its size rules read off a video pipeline.
    renderer = DiffusionRenderer(DiffusionStageConfig(model=WAN, batch_invariant=request.param, torch_threads=1))
    family = renderer.family
    assert isinstance(family, WanFamily) and renderer.capabilities.size_multiple == 16  # VAE 8x, spatial patch 2
    engine = StepEngine(family, max_batch_size=4, torch_threads=1)
    engine.invariant = request.param
    yield engine
    engine.stop()
    disable_batch_invariant_kernels()


@pytest.fixture(scope="module")
def solo(engine):
    return engine.render([video(*TARGET)])[0]


def test_a_video_alone_gives_wanpipelines_own_frames(engine, solo):
    if not engine.invariant:
        pytest.skip("stock kernels: the pipeline's two one-row calls and the engine's one two-row call may differ")
    prompt, seed = TARGET
    with torch.inference_mode():
        reference = engine.family.pipe(
            prompt,
            negative_prompt="",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=5.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        ).frames[0]
    assert solo.shape == (9, 64, 64, 3) and solo.std() > 0
    assert np.array_equal(solo, reference)


def test_a_video_cobatched_with_unlike_videos_gives_its_solo_frames(engine, solo):
    neighbours = [
        video("a lighthouse at dusk, waves", 7, steps=6),
        video("two cats asleep", 9, steps=3, guidance=3.0),
        video("a paper boat on a river", 11, steps=5, guidance=1.0),  # no guidance: one row
        video("a short clip", 13, frames=5),  # another frame count: its own calls
    ]
    rendered = engine.render([neighbours[0], video(*TARGET), *neighbours[1:]])
    assert rendered[-1].shape == (5, 64, 64, 3)
    same = np.array_equal(rendered[1], solo)
    if engine.invariant:
        assert same, f"{int((rendered[1] != solo).sum())} of {solo.size} values differ"
    elif same:
        pytest.skip(
            f"measured on kernel path {cpu_isa()}: with stock kernels the co-batched video equalled its solo frames "
            "too, so the check above could not have failed here (on avx2: 0 differing values at 64x64 and 128x128, "
            "9 and 17 frames, 1 and 2 threads; on avx512 about 93,000 of 110,592)"
        )
    else:
        assert not same


def test_a_frame_count_the_vae_cannot_take_is_refused_naming_the_field_and_the_engine_serves_on(engine, solo):
    # 8 frames: not 4k + 1. The refusal reaches the request's caller; the video beside it renders as alone.
    with pytest.raises(InvalidRequestError, match="num_frames") as refused:
        engine.render([video(*TARGET, frames=8)])
    assert refused.value.param == "num_frames"
    if engine.invariant:
        assert np.array_equal(engine.render([video(*TARGET)])[0], solo)
