"""What a response says of how its images were made (orchestration.responses), without a server: `quality` in the
terms OpenAI's published schemas take, read back by the official client's own types."""

import pytest

from contracts.http import ImageCompletedEvent, ImagePartialEvent, ImagesResponse
from contracts.sampling import DiffusionSamplingParams, reported_quality
from orchestration.pipeline import ImagePlan
from orchestration.responses import delivery, event_delivery
from tests.openai_types import read_as_openai


def plan(**params) -> ImagePlan:
    return ImagePlan(prompt="x", enhance=False, seed=1, llm_params=[],
                     diffusion_params=[DiffusionSamplingParams(seed=1, **params)])


@pytest.mark.parametrize("asked,reported", [
    ({}, "high"),  # no quality: the default steps, which "high" stands for
    ({"quality": "auto"}, "high"),
    ({"quality": "hd"}, "high"),
    ({"quality": "high"}, "high"),
    ({"quality": "standard"}, "medium"),
    ({"quality": "medium"}, "medium"),
    ({"quality": "low"}, "low"),
    ({"num_inference_steps": 3}, None),  # a step count: no OpenAI term
])
def test_a_response_reports_the_quality_rendered_in_openais_terms_or_none(asked, reported):
    made = plan(**asked)
    params = made.diffusion_params[0]
    assert reported_quality(params.quality, params.num_inference_steps) == reported
    assert delivery(made)["quality"] == reported
    assert event_delivery(made)["quality"] == (reported or "auto")  # the events' schemas require one


def test_a_response_without_an_openai_quality_leaves_the_field_out_and_the_official_types_read_both():
    common = {"created": 0, "data": [], "model": "m", "size": "64x64", "invariance": {}}
    left_out = ImagesResponse(**common, **delivery(plan(num_inference_steps=3))).model_dump(mode="json")
    assert "quality" not in left_out
    said = ImagesResponse(**common, **delivery(plan(quality="auto"))).model_dump(mode="json")
    assert said["quality"] == "high"
    for body in (left_out, said):
        assert read_as_openai("images", body).quality == body.get("quality")
    event = {"b64_json": "", "created_at": 0, "size": "64x64", "image_index": 0, **event_delivery(plan(num_inference_steps=3))}
    partial = ImagePartialEvent(type="image_generation.partial_image", partial_image_index=0, **event)
    assert read_as_openai(partial.type, partial.model_dump(mode="json")).quality == "auto"
    assert "quality" in ImageCompletedEvent.model_json_schema()["properties"]
