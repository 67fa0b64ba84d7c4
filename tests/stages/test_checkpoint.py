"""Step-boundary checkpoints (stages.diffusion.engine.sample): a sample exported at step k and resumed on another
engine, co-batched with unlike neighbours, ends with exactly the bytes of its uninterrupted render; and the video
stage's own (`VideoStage.render`, in process): its checkpoints in its stream, resumed by a replica of its identity
with the uninterrupted MP4's bytes, rendered anew by one of another.

Real tiny pipelines, the kernels on, the engine's own thread; "another replica" is a second renderer and engine built
from the same model. The control resumes from the latents and step alone (what a checkpoint of the latents would
give): the scheduler's past predictions (DPM-Solver++ 2M) and the generator's state (Euler ancestral's noise) are then
made again from the request, and the image differs, so the test can fail.
"""

import asyncio
import functools
import io
import threading

import numpy as np
import pytest
import torch

from contracts.config import DiffusionStageConfig
from contracts.jobs import RenderJob
from contracts.results import RenderCheckpoint, RenderedVideo, RenderProgress
from contracts.sampling import DiffusionSamplingParams, StepCache
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.sample import Moved
from stages.kernels import disable_batch_invariant_kernels
from tests.stages.conftest import DIT, UNET

pytestmark = pytest.mark.slow
STEPS, EVERY = 8, 3
PROMPT = "a red fox in the snow"


def replica(model: str) -> StepEngine:
    renderer = DiffusionRenderer(DiffusionStageConfig(model=model, batch_invariant=True, torch_threads=1))
    engine = StepEngine(renderer.family, max_batch_size=8, torch_threads=1)
    engine.renderer = renderer
    return engine


@pytest.fixture(scope="module")
def replicas(request):
    disable_batch_invariant_kernels()
    made = {model: (replica(model), replica(model)) for model in (UNET, DIT)}
    yield made
    for pair in made.values():
        for engine in pair:
            engine.stop()
    disable_batch_invariant_kernels()


def sample(engine: StepEngine, seed: int = 42, prompt: str = PROMPT, **fields) -> Sample:
    fields.setdefault("num_inference_steps", STEPS)
    params = engine.renderer.resolve(DiffusionSamplingParams(seed=seed, **fields), step_engine=True)
    return Sample(prompt, params, on_done=None)


def neighbours(engine: StepEngine) -> list[Sample]:
    """Unlike the resumed sample: other prompts, seeds, steps, guidance."""
    variants = [{"num_inference_steps": 5}, {"guidance_scale": 1.0, "num_inference_steps": 6}, {"guidance_scale": 9.0}]
    return [sample(engine, 100 + i, f"neighbour {i}, a lighthouse at dusk", **v) for i, v in enumerate(variants)]


def latents_only(state: bytes, fresh: Sample) -> bytes:
    """The control's checkpoint: its latents and step kept, scheduler and generator as a new sample of the request has
    them, moved to the step only."""
    loaded = torch.load(io.BytesIO(state), weights_only=False)
    loaded["scheduler"] = {"_step_index": loaded["step"]}
    loaded["generator"] = torch.Generator().manual_seed(fresh.params.seed).get_state()
    buffer = io.BytesIO()
    torch.save(loaded, buffer)
    return buffer.getvalue()


CASES = {
    "unet-euler-ancestral": (UNET, {"scheduler": "euler_ancestral"}),
    "unet-dpmpp-2m": (UNET, {"scheduler": "dpmpp_2m"}),
    "unet-step-cache": (UNET, {"scheduler": "dpmpp_2m", "cache": StepCache(method="teacache", threshold=0.3)}),
    "dit": (DIT, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_sample_resumed_from_its_checkpoint_on_another_engine_co_batched_gives_its_uninterrupted_bytes(replicas, case):
    model, fields = CASES[case]
    first, second = replicas[model]
    (uninterrupted,) = first.render([sample(first, **fields)])

    checkpoints: list[tuple[int, bytes]] = []
    checkpointed = sample(first, **fields)
    checkpointed.checkpoint_every, checkpointed.on_checkpoint = EVERY, lambda step, state: checkpoints.append((step, state))
    (image,) = first.render([checkpointed])
    assert [step for step, _ in checkpoints] == [3, 6]  # every 3 steps, none after the last
    assert np.array_equal(image, uninterrupted)  # taking checkpoints changes nothing

    for step, state in checkpoints:
        resumed = sample(second, **fields)
        resumed.resume = state
        images = second.render([*neighbours(second), resumed])
        assert np.array_equal(images[-1], uninterrupted), f"resumed after step {step}"
        assert resumed.step == STEPS


@pytest.mark.parametrize("case", ["unet-euler-ancestral", "unet-dpmpp-2m"])
def test_control_a_resume_from_the_latents_alone_differs(replicas, case):
    model, fields = CASES[case]
    first, second = replicas[model]
    (uninterrupted,) = first.render([sample(first, **fields)])
    checkpoints: list[bytes] = []
    checkpointed = sample(first, **fields)
    checkpointed.checkpoint_every, checkpointed.on_checkpoint = EVERY, lambda step, state: checkpoints.append(state)
    first.render([checkpointed])
    resumed = sample(second, **fields)
    resumed.resume = latents_only(checkpoints[0], resumed)
    (image,) = second.render([resumed])
    assert not np.array_equal(image, uninterrupted)


def test_samples_handed_off_at_a_step_boundary_go_on_on_another_engine_with_their_uninterrupted_bytes(replicas):
    """What a replica that Serve stops does (`StepEngine.hand_off`): every sample in flight leaves at the next step
    boundary with its state, and one arriving after leaves at once with none; each goes on on another engine,
    co-batched, with the bytes it would have had. Control: the target's state cut to its latents differs."""
    first, second = replicas[UNET]
    fields = {"scheduler": "euler_ancestral"}
    uninterrupted = first.render([sample(first, **fields), *neighbours(first)])
    stopping = StepEngine(first.family, max_batch_size=8, torch_threads=1)
    outcomes: dict[int, object] = {}
    told = threading.Semaphore(0)

    def tell(index: int, result: object) -> None:
        outcomes[index] = result
        told.release()

    moving = [sample(first, **fields), *neighbours(first)]
    moving[0].on_step = lambda step: stopping.hand_off() if step == 3 else None
    try:
        for index, one in enumerate(moving):
            one.on_done = functools.partial(tell, index)
            stopping.submit(one)
        for _ in moving:
            assert told.acquire(timeout=120)
        late = sample(first, **fields)
        late.on_done = functools.partial(tell, len(moving))
        stopping.submit(late)
        assert told.acquire(timeout=30)
    finally:
        stopping.stop()
    moved = [outcomes[i] for i in range(len(moving))]
    assert all(isinstance(m, Moved) for m in moved), moved
    assert [m.step for m in moved] == [3, 3, 3, 3]  # one batch: all left after the step the hand-off followed
    assert isinstance(outcomes[len(moving)], Moved) and outcomes[len(moving)].state is None

    resumed = [sample(second, **fields), *neighbours(second)]
    for one, m in zip(resumed, moved, strict=True):
        one.resume = m.state
    images = second.render(resumed[::-1])[::-1]  # another order, another engine
    for index, (image, expected) in enumerate(zip(images, uninterrupted, strict=True)):
        assert np.array_equal(image, expected), f"sample {index} handed off after step 3"

    control = sample(second, **fields)
    control.resume = latents_only(moved[0].state, control)
    (image,) = second.render([control])
    assert not np.array_equal(image, uninterrupted[0])


def test_a_checkpoint_of_another_step_count_is_refused_naming_it(replicas):
    first, second = replicas[UNET]
    checkpoints: list[bytes] = []
    checkpointed = sample(first, num_inference_steps=4)
    checkpointed.checkpoint_every, checkpointed.on_checkpoint = 3, lambda step, state: checkpoints.append(state)
    first.render([checkpointed])
    short = sample(second, num_inference_steps=2)
    short.resume = checkpoints[0]
    with pytest.raises(ValueError, match="after step 3 of a sample of 2 steps"):
        second.render([short])


def video_stage(**config):
    from stages.diffusion.video_stage import VideoStage

    defaults = {"batch_invariant": True, "torch_threads": 1, "warm_up": False, "self_audit": "off"}
    return VideoStage.func_or_class({**defaults, **config})


def streamed(stage, **fields) -> list:
    """A video job of 12 steps through the stage's entry point, as the jobs deployment iterates it."""
    params = DiffusionSamplingParams(seed=7, num_inference_steps=12, height=64, width=64, num_frames=9)

    async def items():
        return [item async for item in stage.render(RenderJob(prompt="a red ball bouncing", params=params, **fields))]

    return asyncio.run(items())


def steps_of(items: list) -> list[int]:
    return [item.step for item in items if isinstance(item, RenderProgress)]


def test_a_video_stage_streams_checkpoints_that_a_replica_of_its_identity_resumes_with_the_same_mp4():
    first, second, other = video_stage(), video_stage(), video_stage(torch_threads=2)
    assert first.admission.identity == second.admission.identity != other.admission.identity
    (uninterrupted,) = streamed(first)[-1:]  # no checkpoints asked: none sent
    items = streamed(first, checkpoint_every=EVERY)
    checkpoints = [item for item in items if isinstance(item, RenderCheckpoint)]
    assert [(c.step, c.steps, c.made_by) for c in checkpoints] == [(s, 12, first.admission.identity) for s in (3, 6, 9)]
    assert isinstance(items[-1], RenderedVideo) and items[-1].sha256 == uninterrupted.sha256  # taking them changes nothing
    for checkpoint in checkpoints:  # another replica goes on from each: its first step is the checkpoint's next
        resumed = streamed(second, checkpoint_every=EVERY, resume=checkpoint)
        assert steps_of(resumed) == list(range(checkpoint.step + 1, 13)), checkpoint.step
        assert (resumed[-1].sha256, resumed[-1].frames_sha256) == (uninterrupted.sha256, uninterrupted.frames_sha256)
    # A replica of another configuration, or a checkpoint naming another maker: from the first step.
    foreign = checkpoints[-1].model_copy(update={"made_by": other.admission.identity})
    for stage, checkpoint in ((other, checkpoints[-1]), (second, foreign)):
        assert steps_of(streamed(stage, resume=checkpoint)) == list(range(1, 13))
