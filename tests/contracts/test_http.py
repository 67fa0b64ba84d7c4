"""The HTTP schemas (contracts.http), without a server: what a client can send, and what it gets refused."""

import json

import httpx
import pytest
from pydantic import ValidationError

from contracts.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    invalid_request,
)
from contracts.http import (
    BODY_RULES,
    MAX_GENERATION_BODY_BYTES,
    ChatCompletionRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    decode_json,
    is_request_error,
    parse_size,
)
from contracts.provenance import ImageOutput
from contracts.sampling import (
    MAX_LATENT_VALUES,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_SEED,
    DiffusionSamplingParams,
    quality_steps,
)
from contracts.videos import VideoCreateRequest

OK = {"prompt": "a red fox in the snow"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def parse_body(model, raw):
    """A JSON body validated into `model` as the ingress does it (decoded strictly, then validated, errors naming
    the field): FastAPI's body validation on top of `decode_json`."""
    data = decode_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise invalid_request(err) from None


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
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "seed": 3.5}, "seed"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "seed": 1.0}, "seed"),  # integers mean integers
    ({"prompt": "x", "seed": MAX_SEED + 1}, "seed"),
    ({"prompt": "x", "seed": MIN_SEED - 1}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "n": 2.5}, "n"),
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
    ({"prompt": "x", "num_inference_steps": 4.5}, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": "7"}, "guidance_scale"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "x", "generator": 1}, "generator"),
    ({"prompt": "x", "response_format": "png"}, "response_format"),
    ({"prompt": "x", "response_format": "url", "stream": True}, "stream"),  # events carry their images
    ({"prompt": "x", "quality": "best"}, "quality"),
    ({"prompt": "x", "quality": "low", "num_inference_steps": 4}, "quality"),  # a quality stands for steps
    ({"prompt": "x", "style": "vivid"}, "style"),
    ({"prompt": "x", "background": "transparent"}, "background"),
    ({"prompt": "x", "moderation": "low"}, "moderation"),
    ({"prompt": "x", "size": "auto "}, "size"),
    ({"prompt": "x", "size": "64x60"}, "size"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "stream": True, "partial_images": 4}, "partial_images"),
    ({"prompt": "x", "stream": True, "partial_images": -1}, "partial_images"),
    ({"prompt": "x", "partial_images": 2}, "partial_images"),  # previews are streamed: stream=true needed
    ({"prompt": "x", "output_format": "gif"}, "output_format"),
    ({"prompt": "x", "output_compression": 50}, "output_compression"),  # png (the default) is lossless
    ({"prompt": "x", "output_format": "png", "output_compression": 50}, "output_compression"),
    ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"prompt": "x", "output_format": "webp", "output_compression": 50.5}, "output_compression"),
    ({"prompt": "x", "enhance_prompt": "no"}, "enhance_prompt"),
    ({"prompt": "x", "enhance_prompt": 0}, "enhance_prompt"),
    ({"prompt": "x", "sigmas": []}, "sigmas"),
    ({"prompt": "x", "latents": [[float("nan")]]}, "latents.0.0"),
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


#: Each request model, a valid body of it, and what makes any of its integer fields valid at its minimum.
INTEGER_REQUESTS = {
    "generations": (ImageGenerationRequest, OK, {"stream": True, "output_format": "jpeg"}),
    "edits": (ImageEditRequest, {**OK, "image": b"\x89PNG"}, {"stream": True, "output_format": "jpeg"}),
    "chat": (ChatCompletionRequest, CHAT, {"logprobs": True}),
    "videos": (VideoCreateRequest, OK, {}),
}


def integer_fields(model) -> dict[str, int]:
    """Every field of `model` that takes an integer -> the least integer it takes (its minimum, else 1)."""
    found = {}
    for name, schema in model.model_json_schema()["properties"].items():
        branch = next((s for s in schema.get("anyOf", [schema]) if s.get("type") == "integer"), None)
        if branch is not None:
            found[name] = branch.get("minimum", 1)
    return found


INTEGER_FIELDS = [(route, name) for route, (model, _, _) in INTEGER_REQUESTS.items() for name in integer_fields(model)]


def test_every_integer_field_of_every_request_is_found():
    assert {"seed", "n", "num_inference_steps", "partial_images", "output_compression"} <= set(integer_fields(ImageGenerationRequest))
    assert {"seed", "n", "max_tokens", "max_completion_tokens", "min_tokens", "top_k", "top_logprobs"} <= set(integer_fields(ChatCompletionRequest))
    assert {"seed", "num_inference_steps", "num_frames", "seconds"} <= set(integer_fields(VideoCreateRequest))


@pytest.mark.parametrize("route,name", INTEGER_FIELDS)
def test_an_integer_field_refuses_a_json_float_even_a_whole_one_naming_the_field(route, name):
    model, body, context = INTEGER_REQUESTS[route]
    least = integer_fields(model)[name]
    if route == "edits":  # a form (below); as a model, the same rule
        body = {k: v for k, v in body.items() if k != "image"}
        model = ImageGenerationRequest
    for spelled in (float(least), float(least) + 0.5, float(2**53)):
        error = refused(model, {**body, **context, name: spelled})
        assert error.param == name and name in error.message, error.message
    assert getattr(parse_body(model, json.dumps({**body, **context, name: least})), name) == least


@pytest.mark.parametrize("route,name", [(r, n) for r, n in INTEGER_FIELDS if r in ("edits", "videos")])
def test_a_forms_integer_field_takes_integer_text_and_refuses_a_float_spelling_naming_the_field(route, name):
    model, body, context = INTEGER_REQUESTS[route]
    least = integer_fields(model)[name]
    form = {k: v if isinstance(v, bytes) else str(v).lower() for k, v in {**body, **context}.items()}
    assert getattr(model.from_form({**form, name: str(least)}), name) in (least, str(least))  # OpenAI's `seconds`: text
    for text in (f"{least}.0", f"{least}e0", f"{least}.5"):
        with pytest.raises(InvalidRequestError) as caught:
            model.from_form({**form, name: text})
        assert caught.value.param == name and caught.value.status_code == 400, (text, caught.value.message)


def test_image_request_output_quality_and_auto_size():
    request = parse_body(ImageGenerationRequest, json.dumps({**OK, "output_format": "jpeg", "size": "auto"}))
    assert (request.output.format, request.output.compression) == ("jpeg", 100)  # OpenAI's default compression
    params = request.diffusion_params(7)
    assert (params.width, params.height) == (None, None)  # "auto": the model's default size
    request = parse_body(ImageGenerationRequest, json.dumps({**OK, "output_format": "webp", "output_compression": 0}))
    assert (request.output.format, request.output.compression) == ("webp", 0)
    assert parse_body(ImageGenerationRequest, json.dumps(OK)).output == ImageOutput()
    for quality in ("low", "medium", "high", "auto", "standard", "hd"):
        assert parse_body(ImageGenerationRequest, json.dumps({**OK, "quality": quality})).diffusion_params(7).quality == quality
    assert [quality_steps(q, 8) for q in ("low", "medium", "high", "auto")] == [2, 4, 8, 8]
    assert quality_steps("low", 2) == 1  # at least one step


def test_image_request_unknown_field_is_named_in_the_message():
    error = refused(ImageGenerationRequest, {"prompt": "x", "colour": "red"})
    assert error.message == "unknown field 'colour'" and error.code == "extra_forbidden"


@pytest.mark.parametrize("model,body,param", [
    (ImageGenerationRequest, {**OK, "none": 1}, "none"),
    (ImageGenerationRequest, {**OK, "int": 1}, "int"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "str": 1}]}, "messages.0.str"),
])
def test_an_unknown_field_named_like_a_type_is_named_too(model, body, param):
    error = refused(model, body)  # such names are also pydantic's union tags, which a location otherwise drops
    assert error.param == param and error.message == f"unknown field {param!r}"


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
    ({**CHAT, "seed": 1.0}, "seed"),
    ({**CHAT, "max_tokens": 4.0}, "max_tokens"),
    ({**CHAT, "seed": MAX_SEED + 1}, "seed"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # streams only
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
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


# --- every client field is bounded ----------------------------------------------------------------

LONG_NAME = "n" * (MAX_NAME_CHARS + 1)
# Prompts that render as nothing: zero-width space and joiners, BOM, direction marks, word joiner, fillers.
INVISIBLE_PROMPTS = ["\u200b", "\u200b\u200c\u200d", "\ufeff \u2060", "\u200e\u200f\u202e", "\u3164", "\u2800\u00a0\u3000", "\t\n\u2028"]
# "64x64" in Arabic-Indic, Devanagari, fullwidth and Eastern Arabic digits: `int()` reads them all, the API does not.
FOREIGN_DIGIT_SIZES = ["\u0666\u0664x\u0666\u0664", "\u096c\u096ax64", "\uff16\uff14x\uff16\uff14", "64x\u06f6\u06f4"]
DEEP_LATENTS = [[[[[0.0]]]]]


@pytest.mark.parametrize("body,param", [
    *[({"prompt": prompt}, "prompt") for prompt in INVISIBLE_PROMPTS],
    *[({"prompt": "x", "size": size}, "size") for size in FOREIGN_DIGIT_SIZES],
    ({"prompt": "x", "user": "u" * (MAX_NAME_CHARS + 1)}, "user"),
    ({"prompt": "x", "model": LONG_NAME}, "model"),
    ({"prompt": "x", "size": "6" * 300 + "x64"}, "size"),
    ({"prompt": "x", "generator_device": LONG_NAME}, "generator_device"),
    ({"prompt": "x", "negative_prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "negative_prompt"),
    ({"prompt": "x", "response_format": LONG_NAME}, "response_format"),
    ({"prompt": "x", "latents": DEEP_LATENTS}, "latents"),
    ({"prompt": "x", "latents": [0.0] * (MAX_LATENT_VALUES + 1)}, "latents"),
    ({"prompt": "x", "latents": [[]] * (MAX_LATENT_VALUES + 1)}, "latents"),
    ({"prompt": "x", "sigmas": [1.0] * 502}, "sigmas"),
], ids=lambda v: ascii(v)[:40])
def test_every_image_field_is_bounded_and_refused_past_its_bound_by_name(body, param):
    assert refused(ImageGenerationRequest, body).param == param


def test_a_prompt_needs_visible_text_in_any_script_and_keeps_what_it_has():
    for prompt in ["\U0001f98a", "\u05e9\u05d5\u05e2\u05dc", "\u200bfox\u200b", "\u0661", "\u200f\u0634"]:
        assert parse_body(ImageGenerationRequest, json.dumps({"prompt": prompt})).prompt == prompt
    error = refused(ImageGenerationRequest, {"prompt": "\u200b"})
    assert error.code == "empty_prompt" and "visible" in error.message


def test_size_takes_ascii_digits_only():
    for size in FOREIGN_DIGIT_SIZES:
        with pytest.raises(ValueError, match="size"):
            parse_size(size)
    assert parse_size("64x128") == (64, 128)


def test_latents_at_their_bounds_are_accepted():
    channels, side = 16, int((MAX_LATENT_VALUES // 16) ** 0.5)
    latents = [[[0.5] * side for _ in range(side)] for _ in range(channels)]
    assert DiffusionSamplingParams(latents=latents).latents == latents
    assert refused(ImageGenerationRequest, {"prompt": "x", "latents": DEEP_LATENTS}).message == "latents may nest lists at most 4 deep"


@pytest.mark.parametrize("body,param", [
    ({**CHAT, "stop": ""}, "stop"),
    ({**CHAT, "stop": [""]}, "stop.0"),
    ({**CHAT, "stop": ["\n", ""]}, "stop.1"),
    ({**CHAT, "stop": [5]}, "stop.0"),
    ({**CHAT, "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
    ({**CHAT, "stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop.0"),
    ({**CHAT, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({**CHAT, "top_k": 18446744073709551616}, "top_k"),
    ({**CHAT, "top_k": MAX_TOP_K + 1}, "top_k"),
    ({**CHAT, "top_k": 0}, "top_k"),
    ({**CHAT, "min_tokens": MAX_TOKENS + 1}, "min_tokens"),
    ({**CHAT, "max_tokens": 10**30}, "max_tokens"),
    ({**CHAT, "model": LONG_NAME}, "model"),
    ({**CHAT, "user": "u" * 20 * 2**20}, "user"),
    ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_MESSAGE_CHARS + 1)}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "name": LONG_NAME}]}, "messages.0.name"),
], ids=lambda v: ascii(v)[:40])
def test_every_chat_field_is_bounded_and_refused_past_its_bound_by_name(body, param):
    error = refused(ChatCompletionRequest, body)
    assert error.param == param and param.split(".")[0] in error.message


def test_chat_fields_at_their_bounds_are_accepted():
    body = {
        "messages": [{"role": "user", "content": "x" * MAX_MESSAGE_CHARS, "name": "n" * MAX_NAME_CHARS}] * MAX_MESSAGES,
        "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, "top_k": MAX_TOP_K, "min_tokens": MAX_TOKENS,
        "max_tokens": MAX_TOKENS, "user": "u" * MAX_NAME_CHARS, "model": "m" * MAX_NAME_CHARS,
    }
    params = parse_body(ChatCompletionRequest, json.dumps(body)).llm_params(1)
    assert (params.top_k, len(params.stop), params.min_tokens) == (MAX_TOP_K, MAX_STOP_STRINGS, MAX_TOKENS)
    assert parse_body(ChatCompletionRequest, json.dumps({**CHAT, "stop": "END"})).llm_params(1).stop == ["END"]


# --- request bodies: strict JSON, content types and size limits ----------------------------------


@pytest.mark.parametrize("raw,words", [
    ('{"prompt": "x", "prompt": "y"}', "'prompt' is given more than once"),
    ('{"prompt": "x", "seed": 1, "seed": 1}', "'seed' is given more than once"),
    ('{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "'role' is given more than once"),
    (b'\xef\xbb\xbf{"prompt": "x"}', "BOM"),
    (b'{"prompt": "\xff"}', "not UTF-8"),
    ("[" * 100_000, "nested too deeply"),
    ('{"seed": ' + "1" * 5000 + "}", "digits"),
])
def test_a_body_that_two_parsers_could_read_two_ways_or_not_at_all_is_400(raw, words):
    with pytest.raises(InvalidRequestError) as caught:
        decode_json(raw.encode() if isinstance(raw, str) else raw)
    assert caught.value.status_code == 400 and words in caught.value.message and caught.value.param is None


def test_decoded_json_keeps_every_value():
    assert decode_json(b'{"a": [1, 2.5, "\\u200b", {"b": null}], "c": true}') == {"a": [1, 2.5, "\u200b", {"b": None}], "c": True}


@pytest.mark.parametrize("route,content_type", [
    ("/v1/images/generations", "text/plain"),
    ("/v1/images/generations", None),
    ("/v1/images/generations", ""),
    ("/v1/images/generations", "application/x-www-form-urlencoded"),
    ("/v1/images/generations", "multipart/form-data; boundary=x"),
    ("/v1/images/generations", "application/merge-patch+json"),
    ("/v1/chat/completions", "text/plain;charset=UTF-8"),
    ("/v1/images/edits", "application/json"),
    ("/v1/images/edits", None),
])
def test_a_body_of_another_content_type_is_415_naming_it(route, content_type):
    with pytest.raises(UnsupportedMediaTypeError) as caught:
        BODY_RULES[route].check_headers(content_type, "10")
    error = caught.value
    assert error.status_code == 415 and BODY_RULES[route].media_type in error.message
    assert (content_type or "no Content-Type") in error.message


def test_the_routes_content_types_are_accepted_with_parameters_and_any_case():
    BODY_RULES["/v1/images/generations"].check_headers("Application/JSON; charset=utf-8", "10")
    BODY_RULES["/v1/images/edits"].check_headers("multipart/form-data; boundary=abc", "10")


@pytest.mark.parametrize("route", sorted(BODY_RULES))
def test_a_body_over_its_routes_limit_is_413_from_its_declared_length_or_its_bytes(route):
    rule = BODY_RULES[route]
    rule.check_headers(rule.media_type, str(rule.max_bytes))
    rule.check_headers(rule.media_type, "not a number")  # the HTTP server refuses those itself
    for refuse in (lambda: rule.check_headers(rule.media_type, str(rule.max_bytes + 1)), lambda: rule.check_size(rule.max_bytes + 1),
                   lambda: rule.check_headers(rule.media_type, "9" * 5000)):  # more digits than int() converts
        with pytest.raises(PayloadTooLargeError) as caught:
            refuse()
        assert caught.value.status_code == 413 and str(rule.max_bytes) in caught.value.message


def test_the_generation_limit_holds_the_largest_latents_in_their_longest_writing():
    side = int((MAX_LATENT_VALUES // 16) ** 0.5)
    longest = -1.2345678901234567e-100  # a float64's longest repr: sign, 17 digits, a 3-digit exponent
    latents = [[[longest] * side for _ in range(side)] for _ in range(16)]
    body = json.dumps({"prompt": "x" * MAX_PROMPT_CHARS, "negative_prompt": "\u00fc" * MAX_PROMPT_CHARS, "latents": latents})
    assert len(body.encode()) <= MAX_GENERATION_BODY_BYTES
    assert parse_body(ImageGenerationRequest, body).latents == latents


def test_only_a_requests_own_validation_error_is_the_clients():
    with pytest.raises(ValidationError) as request:
        DiffusionSamplingParams(seed=True)
    with pytest.raises(ValidationError) as response:
        ImagesResponse(created=0, data=[], model="m", size="64x64", invariance={"llm": 1})
    assert is_request_error(request.value) and not is_request_error(response.value)


def test_chat_bodies_say_what_openais_published_schema_requires():
    # Found by scripts/check_openai_document.py against OpenAI's OpenAPI document 2.3.0: a message's `refusal` is
    # required (nullable), and a chunk's delta `role` is a string where present (no null): later chunks leave it out.
    from contracts.http import AssistantMessage, ChunkDelta

    assert json.loads(AssistantMessage(content="hi").model_dump_json()) == {
        "role": "assistant", "content": "hi", "refusal": None}
    assert json.loads(ChunkDelta(content="x").model_dump_json()) == {"content": "x"}
    assert json.loads(ChunkDelta(role="assistant", content="").model_dump_json()) == {"role": "assistant", "content": ""}
