"""Sampling params: frozen, strict, no unknown fields, exact round trips, no generators."""

import json

import cloudpickle
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from contracts.invariance import MAX_SEED, MIN_SEED
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)

diffusion_params = st.builds(
    DiffusionSamplingParams,
    seed=st.one_of(st.none(), st.integers(MIN_SEED, MAX_SEED)),
    num_inference_steps=st.one_of(st.none(), st.integers(1, 500)),
    guidance_scale=st.one_of(st.none(), st.floats(0.0, 100.0)),
    height=st.one_of(st.none(), st.integers(1, 512).map(lambda v: v * 8)),
    width=st.one_of(st.none(), st.integers(1, 512).map(lambda v: v * 8)),
    negative_prompt=st.one_of(st.none(), st.text(max_size=40)),
    generator_device=st.one_of(st.none(), st.sampled_from(["cpu", "cuda", "cuda:1"])),
    latents=st.one_of(st.none(), st.lists(st.lists(finite, min_size=1, max_size=3), min_size=1, max_size=3)),
    sigmas=st.one_of(st.none(), st.lists(finite, min_size=1, max_size=5)),
)

llm_params = st.builds(
    LLMSamplingParams,
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.one_of(st.none(), st.integers(1, 100)),
    max_tokens=st.integers(1, 8192),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    seed=st.one_of(st.none(), st.integers(MIN_SEED, MAX_SEED)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@given(diffusion_params)
def test_diffusion_params_json_round_trip_is_exact(params):
    assert DiffusionSamplingParams.model_validate_json(params.model_dump_json()) == params
    assert DiffusionSamplingParams.model_validate(json.loads(params.model_dump_json())) == params


@given(diffusion_params)
def test_diffusion_params_cloudpickle_round_trip_is_exact(params):
    assert cloudpickle.loads(cloudpickle.dumps(params)) == params


@given(llm_params)
def test_llm_params_json_and_cloudpickle_round_trips_are_exact(params):
    assert LLMSamplingParams.model_validate_json(params.model_dump_json()) == params
    assert cloudpickle.loads(cloudpickle.dumps(params)) == params


@given(st.integers(MIN_SEED, MAX_SEED))
def test_diffusion_params_accept_every_seed_in_range(seed):
    assert DiffusionSamplingParams(seed=seed).seed == seed
    assert LLMSamplingParams(seed=seed).seed == seed


@given(st.one_of(st.integers(max_value=MIN_SEED - 1), st.integers(min_value=MAX_SEED + 1)))
def test_diffusion_params_refuse_every_seed_out_of_range(seed):
    with pytest.raises(ValidationError):
        DiffusionSamplingParams(seed=seed)
    with pytest.raises(ValidationError):
        LLMSamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [True, False, 1.0, 3.5, "1", "0x10", b"1", [1]])
def test_diffusion_params_seed_is_strict_integer_never_coerced(seed):
    with pytest.raises(ValidationError):
        DiffusionSamplingParams(seed=seed)
    with pytest.raises(ValidationError):
        DiffusionSamplingParams.model_validate_json(json.dumps({"seed": seed}) if not isinstance(seed, bytes) else '{"seed": "1"}')


def test_diffusion_params_are_frozen():
    params = DiffusionSamplingParams(seed=1)
    with pytest.raises(ValidationError):
        params.seed = 2


def test_diffusion_params_refuse_unknown_fields():
    with pytest.raises(ValidationError, match="num_images_per_prompt"):
        DiffusionSamplingParams(seed=1, num_images_per_prompt=2)


def test_from_params_accepts_instance_dict_and_diffusers_kwargs():
    reference = DiffusionSamplingParams(seed=5, num_inference_steps=4, height=64, width=64)
    assert DiffusionSamplingParams.from_params(reference) is reference
    assert DiffusionSamplingParams.from_params(reference.model_dump()) == reference
    assert DiffusionSamplingParams.from_params(seed=5, num_inference_steps=4, height=64, width=64) == reference


def test_from_params_keeps_every_caller_field_and_the_callers_seed():
    fields = dict(seed=17, num_inference_steps=3, guidance_scale=2.5, height=128, width=64,
                  negative_prompt="blurry", generator_device="cpu", latents=[[0.25]], sigmas=[1.0, 0.5])
    params = DiffusionSamplingParams.from_params(fields)
    assert params.model_dump(exclude_unset=True) == fields and params.scheduler is None and params.strength is None
    updated = DiffusionSamplingParams.from_params(params, num_inference_steps=5)
    assert updated.seed == 17 and updated.num_inference_steps == 5 and updated.sigmas == [1.0, 0.5]


def test_from_params_never_silently_drops_an_unknown_field():
    with pytest.raises(ValidationError, match="eta"):
        DiffusionSamplingParams.from_params({"seed": 1, "eta": 0.0})


def test_from_params_refuses_a_torch_generator_and_says_pass_seed():
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(3)
    with pytest.raises(TypeError, match="pass seed"):
        DiffusionSamplingParams.from_params(generator)
    for kwargs in ({"generator": generator}, {"generator": [generator, generator]}):
        with pytest.raises(ValidationError, match="pass seed"):
            DiffusionSamplingParams.from_params(**kwargs)
    with pytest.raises(ValidationError, match="pass seed"):
        DiffusionSamplingParams.from_params({"seed": 1, "generator": generator})


def test_from_params_refuses_other_types_with_a_clear_type_error():
    with pytest.raises(TypeError, match="mapping or keyword"):
        DiffusionSamplingParams.from_params(["seed", 1])


def test_params_hold_no_torch_objects():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValidationError):
        DiffusionSamplingParams(latents=torch.zeros(1, 4))


@pytest.mark.parametrize(
    "fields",
    [
        {"num_inference_steps": 0},
        {"height": 0},
        {"width": 100},
        {"guidance_scale": float("nan")},
        {"guidance_scale": -1.0},
        {"generator_device": "tpu"},
        {"sigmas": []},
    ],
)
def test_diffusion_params_refuse_out_of_range_values(fields):
    with pytest.raises(ValidationError):
        DiffusionSamplingParams(**fields)


def test_llm_params_to_vllm_builds_vllm_sampling_params():
    vllm = pytest.importorskip("vllm")
    params = LLMSamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=7, stop=["."], seed=11, logprobs=2)
    built = params.to_vllm()
    assert isinstance(built, vllm.SamplingParams)
    assert (built.temperature, built.top_p, built.top_k, built.max_tokens, built.seed, built.logprobs) == (
        0.5, 0.9, 20, 7, 11, 2)
    assert built.stop == ["."]
    assert LLMSamplingParams().to_vllm().top_k in (0, -1)  # disabled


@pytest.mark.parametrize("fields", [{"temperature": -0.1}, {"top_p": 0.0}, {"max_tokens": 0},
                                    {"min_tokens": 10, "max_tokens": 5}, {"logprobs": 21}, {"seed": "3"}])
def test_llm_params_refuse_invalid_values(fields):
    with pytest.raises(ValidationError):
        LLMSamplingParams(**fields)
