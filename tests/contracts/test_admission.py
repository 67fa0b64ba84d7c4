"""Admission (contracts.admission): the ingress and a stage called directly refuse alike."""

import pytest

from contracts.admission import DiffusionLimits, admit_diffusion_params, admit_llm_params, admit_messages, admit_prompt
from contracts.errors import InvalidRequestError
from contracts.http import ImageGenerationRequest
from contracts.invariance import SeedContractError
from contracts.sampling import MAX_PROMPT_CHARS, DiffusionSamplingParams


def refusal(call, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        call(*args, **kwargs)
    return caught.value


@pytest.mark.parametrize("prompt", ["", "   ", 7, None, "x" * (MAX_PROMPT_CHARS + 1)])
def test_a_bad_prompt_is_refused_with_the_same_message_as_over_http(prompt):
    stage = refusal(admit_prompt, prompt)
    assert stage.param == "prompt"
    from pydantic import ValidationError

    from contracts.errors import invalid_request

    with pytest.raises(ValidationError) as http:
        ImageGenerationRequest.model_validate({"prompt": prompt})
    ingress = invalid_request(http.value)
    assert (stage.message, stage.param, stage.code) == (ingress.message, ingress.param, ingress.code)


@pytest.mark.parametrize("params,param", [
    ({"seed": True}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1, "height": 60}, "height"),
    ({"seed": 1, "num_images_per_prompt": 2}, "num_images_per_prompt"),
    ({"num_inference_steps": 2}, "seed"),  # seedless under invariance
    ({"seed": 1, "latents": [[[0.0]]]}, "latents"),
])
def test_diffusion_params_refusals_name_the_field(params, param):
    assert refusal(admit_diffusion_params, params, batch_invariant=True).param == param


def test_the_seed_contract_is_an_invalid_request_with_its_own_code():
    error = refusal(admit_diffusion_params, {}, batch_invariant=True)
    assert isinstance(error, SeedContractError) and error.code == "seed_contract" and error.status_code == 400
    assert admit_diffusion_params({}, batch_invariant=False) == DiffusionSamplingParams()


def test_a_generator_is_refused_and_the_message_says_pass_seed():
    torch = pytest.importorskip("torch")
    error = refusal(admit_diffusion_params, torch.Generator(), batch_invariant=False)
    assert "seed=<int>" in error.message and error.param == "params"


def test_llm_params_and_messages_name_the_field():
    assert refusal(admit_llm_params, {"temperature": 3.0}, batch_invariant=False).param == "temperature"
    assert refusal(admit_llm_params, {"temperature": 1.0}, batch_invariant=True).param == "seed"
    assert admit_llm_params({"temperature": 0.0}, batch_invariant=True).seed is None  # greedy needs no seed
    assert refusal(admit_messages, [{"role": "robot", "content": "hi"}]).param == "messages.0.role"
    assert refusal(admit_messages, []).param == "messages"
    assert refusal(admit_messages, ["hi"]).param == "messages.0"


def test_serving_limits_refuse_steps_and_pixels_past_the_deployments_bound():
    limits = DiffusionLimits(max_pixels=128 * 128, max_inference_steps=10)
    limits.check_limits(DiffusionSamplingParams(num_inference_steps=10, height=128, width=128))
    assert refusal(limits.check_limits, DiffusionSamplingParams(num_inference_steps=11)).param == "num_inference_steps"
    error = refusal(limits.check_limits, DiffusionSamplingParams(height=128, width=136))
    assert error.param == "size" and "136x128" in error.message
    limits.check_limits(DiffusionSamplingParams())  # unset fields are checked once the stage fills its defaults
