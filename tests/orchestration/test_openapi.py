"""The served OpenAPI document says what the server enforces (orchestration.openapi), without a server: FastAPI's
document of the real routes (`orchestration.api` over the stub ingress of test_errors), narrowed as an app narrows it,
from a config and the stages' descriptions as /health reports them. The real app's document against its server is
test_schema_fuzz.py (slow)."""

import pytest

from contracts.http import MiB
from contracts.images import MAX_IMAGE_BYTES
from contracts.sampling import MAX_SEED, MIN_SEED
from orchestration.config import AppConfig
from orchestration.openapi import served_schema

from .test_errors import REACHED, StubIngress, StubVideos

BOTH_ON = {"llm": {"batch_invariant": True}, "diffusion": {"batch_invariant": True, "max_pixels": 128 * 128},
           "video": {"batch_invariant": True}}
#: A step-engine replica of a model whose family has a measured step-caching threshold, as `describe()` says it.
DIFFUSION = {"model": "omniserve/tiny-shapes-sd", "details": {"capabilities": {
    "model": "omniserve/tiny-shapes-sd", "family": "UNetFamily", "size_multiple": 16, "min_steps": 1,
    "schedulers": ["euler"], "true_cfg": False, "per_sample": True, "cache_threshold": 0.2}}}


def generated() -> dict:
    from orchestration.api import build_api

    ingress = StubIngress()
    ingress.videos = StubVideos(ingress)
    return build_api(ingress).openapi()


def served(config: dict = BOTH_ON, diffusion: dict = DIFFUSION) -> dict:
    return served_schema(generated(), AppConfig.model_validate(config), diffusion, {"model": "tiny-llama"})


def integer_bounds(node, found: list) -> list:
    """Every integer schema's bounds in `node`, anywhere."""
    if isinstance(node, list):
        for item in node:
            integer_bounds(item, found)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            found += [(key, node[key]) for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                      if key in node]
        for value in node.values():
            integer_bounds(value, found)
    return found


def seed_schemas(document: dict) -> list[dict]:
    components = document["components"]["schemas"]
    forms = [document["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"],
             *document["paths"]["/v1/videos"]["post"]["requestBody"]["content"].values()]
    schemas = [components["ImageGenerationRequest"], components["ChatCompletionRequest"], *(f["schema"] for f in forms)]
    return [next(s for s in schema["properties"]["seed"].get("anyOf", [schema["properties"]["seed"]])
                 if s.get("type") == "integer") for schema in schemas]


def test_every_integer_bound_is_an_exact_integer_and_the_seeds_are_its_real_inclusive_range():
    document = served()
    bounds = integer_bounds(document, [])
    assert bounds and all(type(value) is int for _, value in bounds), [b for b in bounds if type(b[1]) is not int]
    for seed in seed_schemas(document):  # generations, chat, the edit form, both video bodies
        assert (seed["minimum"], seed["maximum"]) == (MIN_SEED, MAX_SEED) == (-(2**63), 2**64 - 1)


def test_chat_requires_a_seed_only_where_it_samples_under_llm_invariance():
    jsonschema = pytest.importorskip("jsonschema")
    chat = served()["components"]["schemas"]["ChatCompletionRequest"]
    assert "seed" not in chat.get("required", [])
    schema = {**chat, "$defs": {"ChatMessage": served()["components"]["schemas"]["ChatMessage"],
                                "StreamOptions": served()["components"]["schemas"]["StreamOptions"]}}
    schema = _local_refs(schema)
    valid = jsonschema.Draft202012Validator(schema).is_valid
    messages = [{"role": "user", "content": "hi"}]
    assert valid({"messages": messages, "temperature": 0})  # greedy: no seed needed (admit_chat)
    assert valid({"messages": messages, "temperature": 0.0})
    assert valid({"messages": messages, "seed": 3})
    assert not valid({"messages": messages})  # temperature left out is 1: sampled
    assert not valid({"messages": messages, "temperature": 0.5, "seed": None})
    off = served({**BOTH_ON, "llm": {"batch_invariant": False}})["components"]["schemas"]["ChatCompletionRequest"]
    assert not any("seed" in str(rule) for rule in off.get("allOf", []))


def _local_refs(node):
    """The document's component references as the schema's own `$defs`."""
    if isinstance(node, dict):
        return {k: (v.replace("#/components/schemas/", "#/$defs/") if k == "$ref" else _local_refs(v))
                for k, v in node.items()}
    return [_local_refs(item) for item in node] if isinstance(node, list) else node


def test_the_edit_image_states_the_sides_it_may_have_and_its_bytes():
    form = served()["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    image = form["properties"]["image"]
    assert image["x-image-size"] == {"multipleOf": 16, "minimum": 8, "maximum": 4096, "x-max-pixels": 128 * 128}
    assert image["x-max-bytes"] == MAX_IMAGE_BYTES == 16 * MiB and "multiples of 8 in [8, 4096]" in image["description"]


@pytest.mark.parametrize("measured,required", [(0.2, False), (None, True)])
def test_a_teacache_threshold_is_required_only_where_the_model_has_no_measured_one(measured, required):
    jsonschema = pytest.importorskip("jsonschema")
    capabilities = {**DIFFUSION["details"]["capabilities"], "cache_threshold": measured}
    cache = served(diffusion={**DIFFUSION, "details": {"capabilities": capabilities}})["components"]["schemas"]["StepCache"]
    valid = jsonschema.Draft202012Validator(cache).is_valid
    assert valid({"method": "teacache"}) is not required
    assert valid({"method": "teacache", "threshold": 0.3}) and not valid({"method": "off", "threshold": 0.3})


def test_a_405_allows_every_method_of_the_path_options_included():
    from fastapi.testclient import TestClient

    from orchestration.api import build_api

    ingress = StubIngress()
    ingress.videos = StubVideos(ingress)
    ingress.failure = REACHED
    with TestClient(build_api(ingress), raise_server_exceptions=False) as client:
        for method in ("OPTIONS", "POST", "PUT"):
            refused = client.request(method, "/v1/videos/video_123")
            assert refused.status_code == 405 and refused.headers["Allow"] == "DELETE, GET", method
        assert client.options("/v1/videos").headers["Allow"] == "POST"
        assert client.get("/v1/images/generations").headers["Allow"] == "POST"


#: The video stage as `describe()` says it: the tiny Wan's size multiple and frame step (its VAE: 4k + 1 frames).
VIDEO = {"model": "omniserve/tiny-wan-video", "details": {"capabilities": {"size_multiple": 16, "min_steps": 1,
                                                                       "frame_step": 4}}}


@pytest.mark.parametrize("content", ["application/json", "multipart/form-data"])
def test_a_video_body_states_the_frames_seconds_and_sizes_the_server_takes(content):
    jsonschema = pytest.importorskip("jsonschema")
    document = served_schema(generated(), AppConfig.model_validate(BOTH_ON), DIFFUSION, {}, VIDEO)
    schema = document["paths"]["/v1/videos"]["post"]["requestBody"]["content"][content]["schema"]
    valid = jsonschema.Draft202012Validator(schema).is_valid
    body = {"prompt": "a fox", "seed": 1}
    for good in ({}, {"seconds": "2"}, {"seconds": 4}, {"num_frames": 33}, {"seconds": 2, "num_frames": 17},
                 {"size": "64x64"}):
        assert valid({**body, **good}), good
    # Not 4k + 1; past max_frames (33: 4 s at 8 fps); seconds and frames disagreeing; an unserved model; no seed.
    for bad in ({"num_frames": 10}, {"num_frames": 37}, {"seconds": "5"}, {"seconds": 9},
                {"seconds": 2, "num_frames": 9}, {"model": "sora-2"}, {"seed": None}):
        assert not valid({**body, **bad}), bad
    size = next(s for s in schema["properties"]["size"]["anyOf"] if s.get("type") == "string")
    assert (size["format"], size["x-size-multiple"]) == ("image-size", 16)
    variant = document["paths"]["/v1/videos/{video_id}/content"]["get"]["parameters"][-1]
    assert variant["name"] == "variant" and variant["schema"]["enum"] == ["video"]  # the MP4, nothing else


def test_the_document_says_integer_fields_take_json_integers_only():
    assert served()["info"]["x-json-integers"] is True  # JSON Schema's `integer` takes 1.0; the server refuses it
