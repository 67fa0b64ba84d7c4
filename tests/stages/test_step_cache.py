"""Per-sample step caching (stages/diffusion/engine/sample.py) on the step engine: a cached sample co-batched with
unlike neighbours (other prompts, seeds, step counts, cache settings) gives its solo bytes, kernels on, on the trained
default UNet and the tiny FLUX DiT. The control is the decision TeaCache makes from a batch-wide mean
(ali-vilab/TeaCache #30), in an engine that differs from the served one in that alone: the same co-batched sample then
computes other steps and its bytes differ. Skipping saves real work: a cached sample's rows leave the call."""

import numpy as np
import pytest
from pydantic import ValidationError

from contracts.admission import ModelCapabilities
from contracts.config import DiffusionStageConfig
from contracts.errors import InvalidRequestError
from contracts.provenance import ImageRecord, read_record
from contracts.results import Provenance
from contracts.sampling import DiffusionSamplingParams, StepCache
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.families import SDXLFamily
from stages.diffusion.engine.sample import relative_l1
from stages.diffusion.renderer import encode_png, step_cache
from stages.kernels import disable_batch_invariant_kernels

pytestmark = pytest.mark.slow

MODELS = {"default-unet": "omniserve/tiny-shapes-sd", "flux-dit": "omniserve/tiny-flux-dit"}
TARGET = ("a red circle on a blue background", 42, 20)  # prompt, seed, steps
CACHE = StepCache(method="teacache", threshold=0.2)


def batch_wide(family, batch: list[Sample]) -> list[Sample]:
    """TeaCache's decision from the batch's mean change (ali-vilab/TeaCache #30)."""
    cached, changes = [s for s in batch if s.cache is not None], []
    for sample in cached:
        signal = family.cache_signal(sample)
        previous, sample.cache.previous = sample.cache.previous, signal
        changes.append(0.0 if previous is None else relative_l1(signal, previous))
    mean = sum(changes) / len(changes) if changes else 0.0
    computed = [s for s in batch if s.cache is None]
    for sample in cached:
        state = sample.cache
        state.accumulated += mean
        if (
            sample.step in (0, len(sample.timesteps) - 1)
            or state.prediction is None
            or state.accumulated >= state.threshold
        ):
            state.accumulated = 0.0
            computed.append(sample)
    return computed


class BatchWideEngine(StepEngine):
    """The control: the served engine with TeaCache's batch-wide decision, nothing else changed."""

    computed = staticmethod(batch_wide)


@pytest.fixture(scope="module", params=list(MODELS))
def renderer(request):
    disable_batch_invariant_kernels()
    made = DiffusionRenderer(DiffusionStageConfig(model=MODELS[request.param], batch_invariant=True, torch_threads=1))
    yield made
    disable_batch_invariant_kernels()


def sample(renderer, prompt: str, seed: int, steps: int, cache: StepCache | None = CACHE, **fields) -> Sample:
    params = DiffusionSamplingParams(seed=seed, num_inference_steps=steps, cache=cache, **fields)
    return Sample(prompt, renderer.resolve(params, step_engine=True), on_done=None)


def neighbours(renderer) -> list[Sample]:
    """Unlike the target: other prompts, seeds and step counts, no cache, a looser and a tighter threshold."""
    return [
        sample(renderer, "a yellow star on a black background, left", 7, 12, None),
        sample(renderer, "a small green square", 8, 30, StepCache(method="teacache", threshold=0.6)),
        sample(renderer, "a cyan ring on a white background, top", 9, 9, StepCache(method="teacache", threshold=0.05)),
    ]


def render(engine_class, renderer, samples: list[Sample]) -> list[np.ndarray]:
    engine = engine_class(renderer.family, max_batch_size=8, torch_threads=1)
    try:
        return engine.render(samples)
    finally:
        engine.stop()


def test_a_cached_sample_cobatched_with_unlike_neighbours_gives_its_solo_bytes_and_skips_steps(renderer):
    alone = sample(renderer, *TARGET)
    (solo,) = render(StepEngine, renderer, [alone])
    target = sample(renderer, *TARGET)
    together = render(StepEngine, renderer, [target, *neighbours(renderer)])
    assert np.array_equal(together[0], solo)
    assert target.steps_computed == alone.steps_computed < TARGET[2]  # the same steps skipped, and some were
    assert target.cache.reused == TARGET[2] - target.steps_computed


def test_control_a_batch_wide_decision_changes_the_same_cobatched_samples_bytes(renderer):
    alone = sample(renderer, *TARGET)
    (solo,) = render(BatchWideEngine, renderer, [alone])  # alone, the batch's mean is its own change
    (served,) = render(StepEngine, renderer, [sample(renderer, *TARGET)])
    assert np.array_equal(solo, served)
    target = sample(renderer, *TARGET)
    together = render(BatchWideEngine, renderer, [target, *neighbours(renderer)])
    assert not np.array_equal(together[0], solo), "the control did not vary: the check above could not fail"


def test_cache_off_or_unset_computes_every_step_and_gives_the_uncached_bytes(renderer):
    samples = [sample(renderer, *TARGET, cache=None), sample(renderer, *TARGET, cache=StepCache(method="off"))]
    images = render(StepEngine, renderer, samples)
    assert np.array_equal(images[0], images[1])
    assert [s.steps_computed for s in samples] == [TARGET[2]] * 2 and samples[1].cache is None


def test_a_threshold_is_bounded_with_teacache_and_refused_with_off():
    assert DiffusionSamplingParams(cache={"method": "teacache"}).cache == StepCache(method="teacache", threshold=None)
    for bad in (
        {"method": "off", "threshold": 0.1},
        {"method": "teacache", "threshold": 0},
        {"method": "fbcache", "threshold": 0.1},
        {"method": "teacache", "threshold": 11},
    ):
        with pytest.raises(ValidationError):
            DiffusionSamplingParams(cache=bad)


def test_teacache_without_a_threshold_runs_its_familys_measured_one_and_records_it(renderer):
    measured = renderer.family.cache_threshold
    assert measured == 0.2  # docs/performance.md: the default UNet's and the tiny FLUX DiT's
    alone = renderer.resolve(DiffusionSamplingParams(seed=1, cache={"method": "teacache"}), step_engine=True)
    assert alone.cache == StepCache(method="teacache", threshold=measured)
    given = sample(renderer, *TARGET, cache=StepCache(method="teacache", threshold=measured))
    left_out = sample(renderer, *TARGET, cache=StepCache(method="teacache"))
    images = render(StepEngine, renderer, [given, left_out])
    assert np.array_equal(images[0], images[1]) and given.steps_computed == left_out.steps_computed < TARGET[2]
    stage = Provenance(model=renderer.model, batch_invariant=True, kernel_backend="cpu")
    record = ImageRecord.of(TARGET[0], left_out.params, stage, None)  # as the stage writes it: the resolved params
    assert read_record(encode_png(images[1], record)).params.cache.threshold == measured


def test_a_family_without_a_measured_threshold_asks_for_one_naming_cache_threshold():
    # An SDXL model's capabilities as its replica computes them (no pipeline needed: the family's measured threshold).
    unmeasured = ModelCapabilities(model="an-sdxl-model", device="cpu", family="SDXLFamily", per_sample=True,
                                   cache_threshold=SDXLFamily.cache_threshold)
    with pytest.raises(InvalidRequestError) as refused:
        step_cache(StepCache(method="teacache"), unmeasured, step_engine=True)
    assert refused.value.param == "cache.threshold" and "give one" in refused.value.message
    assert "an-sdxl-model" in refused.value.message and "SDXLFamily" in refused.value.message
    given = StepCache(method="teacache", threshold=0.1)
    assert step_cache(given, unmeasured, step_engine=True) == given


def test_whole_request_batching_refuses_step_caching_naming_cache():
    renderer = DiffusionRenderer(DiffusionStageConfig(model=MODELS["default-unet"], torch_threads=1))
    with pytest.raises(InvalidRequestError) as refused:
        renderer.resolve(DiffusionSamplingParams(seed=1, cache=CACHE), step_engine=False)
    assert refused.value.param == "cache"


def test_a_deployments_default_cache_applies_to_requests_without_one_and_off_overrides_it():
    config = DiffusionStageConfig(model=MODELS["default-unet"], torch_threads=1,
                                  defaults={"cache": {"method": "teacache", "threshold": 0.3}})
    renderer = DiffusionRenderer(config)
    assert renderer.resolve(DiffusionSamplingParams(seed=1), step_engine=True).cache == StepCache(
        method="teacache", threshold=0.3)
    off = renderer.resolve(DiffusionSamplingParams(seed=1, cache={"method": "off"}), step_engine=True)
    assert off.cache == StepCache(method="off") and not off.cache.active
