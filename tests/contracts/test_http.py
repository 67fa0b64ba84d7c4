"""The HTTP schemas (contracts.http), without a server: what a client can send, and what it gets refused."""

import json

import httpx
import pytest

from contracts.errors import InvalidRequestError, ModelNotFoundError
from contracts.http import ChatCompletionRequest, ImageGenerationRequest, parse_body, parse_size
from contracts.seeds import MAX_SEED, MIN_SEED

OK = {"prompt": "a red fox in the snow"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refused(model, body) -> InvalidRequestError:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(model, raw)
    assert caught.value.status_code == 400 and caught.value.message
    return caught.value


# --- images: every client mistake of the API is a 400 naming its field -----------------------------

BAD_IMAGE_REQUESTS = [
    ({"prompt": "x", "seed": True}, "seed"),
    ({"prompt": "x", "seed": False}, "seed"),
    ({"prompt": "x", "seed": 1.0}, "seed"),
    ({"prompt": "x", "seed": 3.5}, "seed"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "seed": MAX_SEED + 1}, "seed"),
    ({"prompt": "x", "seed": MIN_SEED - 1}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "n": 2.0}, "n"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "size": "64"}, "size"),
    ({"prompt": "x", "size": "64x"}, "size"),
    ({"prompt": "x", "size": "64x64\n"}, "size"),
    ({"prompt": "x", "size": "-64x64"}, "size"),
    ({"prompt": "x", "size": "64x63"}, "size"),
    ({"prompt": "x", "size": "0x64"}, "size"),
    ({"prompt": "x", "size": "8192x8192"}, "size"),
    ({"prompt": "x", "size": 64}, "size"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 501}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 4.0}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": "7"}, "guidance_scale"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "generator": 1}, "generator"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "response_format": "png"}, "response_format"),
    ({"prompt": "x", "quality": "hd"}, "quality"),
    ({"prompt": "x", "style": "vivid"}, "style"),
    ({"prompt": "x", "stream": True}, "stream"),
    ({"prompt": "x", "output_format": "jpeg"}, "output_format"),
    ({"prompt": "x", "enhance_prompt": "no"}, "enhance_prompt"),
    ({"prompt": "x", "enhance_prompt": 0}, "enhance_prompt"),
    ({"prompt": "x", "sigmas": []}, "sigmas"),
    ({"prompt": "x", "latents": [[float("nan")]]}, "latents.0"),
]


@pytest.mark.parametrize("body,param", BAD_IMAGE_REQUESTS, ids=lambda v: str(v)[:40])
def test_image_request_bad_inputs_are_400_naming_the_field(body, param):
    error = refused(ImageGenerationRequest, body)
    assert error.param == param
    if param:
        assert param in error.message or error.code == "extra_forbidden" or "prompt" in error.message


@pytest.mark.parametrize("raw", ["", "{", "{bad json}", "[]", "null", '"prompt"', "42", '{"prompt": "x",}'])
def test_image_request_malformed_json_or_non_object_body_is_400(raw):
    error = refused(ImageGenerationRequest, raw)
    assert error.param is None and ("JSON" in error.message or "object" in error.message)


def test_image_request_url_format_is_refused_with_the_reason():
    error = refused(ImageGenerationRequest, {"prompt": "x", "response_format": "url"})
    assert "b64_json" in error.message and "url" in error.message


def test_image_request_unknown_field_is_named_in_the_message():
    error = refused(ImageGenerationRequest, {"prompt": "x", "colour": "red"})
    assert error.message == "unknown field 'colour'" and error.code == "extra_forbidden"


@pytest.mark.parametrize("seed", [MIN_SEED, -1, 0, 2**53, 2**63, MAX_SEED])
def test_image_request_accepts_every_seed_in_range_exactly(seed):
    request = parse_body(ImageGenerationRequest, json.dumps({**OK, "seed": seed}))
    assert request.seed == seed and request.diffusion_params(seed).seed == seed


def test_image_request_defaults_and_size_parsing():
    request = parse_body(ImageGenerationRequest, json.dumps({**OK, "size": "128x64", "n": None}))
    assert request.count == 1 and request.enhance_prompt is True
    params = request.diffusion_params(7)
    assert (params.width, params.height, params.num_inference_steps) == (128, 64, None)
    assert parse_size("64x64") == (64, 64)


def test_image_request_null_openai_fields_are_accepted():
    request = parse_body(ImageGenerationRequest, json.dumps({**OK, "quality": None, "style": None, "user": "u1"}))
    assert request.prompt == OK["prompt"]


def test_image_request_schema_accepts_exactly_what_the_openai_client_sends():
    openai = pytest.importorskip("openai")
    sent = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"created": 0, "data": [{"b64_json": "", "seed": 5}]})

    client = openai.OpenAI(base_url="http://test/v1", api_key="unused", http_client=httpx.Client(transport=httpx.MockTransport(capture)))
    result = client.images.generate(
        prompt="a red fox", model="omniserve/tiny-sd-unet", n=2, size="64x64", response_format="b64_json", user="u1",
        extra_body={"seed": 42, "num_inference_steps": 4, "guidance_scale": 5.0, "negative_prompt": "blur", "enhance_prompt": False},
    )
    path, body = sent[0]
    assert path == "/v1/images/generations"
    request = parse_body(ImageGenerationRequest, json.dumps(body))
    assert (request.seed, request.count, request.enhance_prompt, request.num_inference_steps) == (42, 2, False, 4)
    assert result.data[0].model_extra["seed"] == 5  # extension fields reach the client's objects


def test_chat_request_schema_accepts_exactly_what_the_openai_client_sends():
    openai = pytest.importorskip("openai")
    sent = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []})

    client = openai.OpenAI(base_url="http://test/v1", api_key="unused", http_client=httpx.Client(transport=httpx.MockTransport(capture)))
    client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], seed=3, max_tokens=8,
        temperature=0.5, top_p=0.9, stop=["\n"], logprobs=True, top_logprobs=2, extra_body={"top_k": 5},
    )
    request = parse_body(ChatCompletionRequest, json.dumps(sent[0]))
    params = request.llm_params(request.seed)
    assert (params.seed, params.max_tokens, params.temperature, params.top_k, params.logprobs, params.stop) == (3, 8, 0.5, 5, 2, ["\n"])


BAD_CHAT_REQUESTS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": ["part"]}]}, "messages.0.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({**CHAT, "seed": True}, "seed"),
    ({**CHAT, "seed": 1.5}, "seed"),
    ({**CHAT, "seed": MAX_SEED + 1}, "seed"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stream": True}, "stream"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "colour": 1}, "colour"),
    ({"prompt": "x"}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT_REQUESTS, ids=lambda v: str(v)[:40])
def test_chat_request_bad_inputs_are_400_naming_the_field(body, param):
    assert refused(ChatCompletionRequest, body).param == param


def test_chat_request_llm_params_refuse_inconsistent_token_bounds():
    request = parse_body(ChatCompletionRequest, json.dumps({**CHAT, "max_tokens": 4, "min_tokens": 8}))
    with pytest.raises(ValueError, match="min_tokens"):
        request.llm_params(1)


def test_model_not_found_is_a_404_invalid_request():
    assert ModelNotFoundError("x", param="model").status_code == 404
    assert issubclass(ModelNotFoundError, InvalidRequestError)
