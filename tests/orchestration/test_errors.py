"""The one error mapping: every exception a request can raise -> status, OpenAI body, headers.

The HTTP-level tests at the end run `orchestration.api` (the real routes, body checks and handlers) in-process
over a stub ingress whose stage calls raise what a test says: fast, without Ray. The real app over real HTTP is
tests/orchestration/test_fuzz.py (slow).
"""

import logging
import pickle
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from contracts.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    QueueFullError,
    UnsupportedMediaTypeError,
)
from contracts.http import MAX_JSON_BODY_BYTES, ImagesResponse
from contracts.invariance import SeedContractError
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams
from orchestration.errors import http_error


def from_replica(exc: Exception) -> Exception:
    """What a caller sees when a replica raised `exc`: Ray's wrapper, a subclass of the original type."""
    exc = pickle.loads(pickle.dumps(exc))
    return RayTaskError("DiffusionStage.generate", "Traceback: ...", exc).as_instanceof_cause()


def validation_error() -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        DiffusionSamplingParams(seed=True)
    return caught.value


CLIENT_ERRORS = [
    (InvalidRequestError("height must be a multiple of 8", param="height"), 400, "height"),
    (ModelNotFoundError("no such model", param="model"), 404, "model"),
    (SeedContractError(["seed is required: pass an integer seed"], param="seed"), 400, "seed"),
    (InvalidRequestError("prompt is 2000 tokens", param="prompt"), 400, "prompt"),
    (validation_error(), 400, "seed"),
    (PayloadTooLargeError("image is 17 MiB", param="image"), 413, "image"),
    (UnsupportedMediaTypeError("send the body as application/json"), 415, None),
]


@pytest.mark.parametrize("wrapped", [False, True], ids=["local", "from-replica"])
@pytest.mark.parametrize("exc,status,param", CLIENT_ERRORS, ids=lambda v: type(v).__name__)
def test_client_errors_map_to_4xx_with_openai_body_here_and_across_ray(exc, status, param, wrapped):
    error = http_error(from_replica(exc) if wrapped else exc)
    assert (error.status, error.param) == (status, param)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert "Traceback" not in body["message"] and body["message"]


@pytest.mark.parametrize("wrapped", [False, True], ids=["local", "from-replica"])
def test_stage_queue_full_is_503_with_retry_after(wrapped):
    exc = QueueFullError("diffusion replica is full", retry_after_s=3)
    error = http_error(from_replica(exc) if wrapped else exc)
    assert error.status == 503 and error.headers == {"Retry-After": "3"} and error.code == "queue_full"


def test_serve_back_pressure_is_503_with_retry_after():
    error = http_error(BackPressureError(num_queued_requests=10, max_queued_requests=10))
    assert error.status == 503 and error.headers["Retry-After"] == "1" and "busy" in error.message


def test_routing_errors_keep_their_status_in_the_openai_shape():
    assert http_error(HTTPException(404, "Not Found")).status == 404
    refused = http_error(HTTPException(405, "Method Not Allowed", headers={"Allow": "POST"}))
    assert refused.status == 405 and refused.headers == {"Allow": "POST"}


def test_server_failures_are_5xx_without_details():
    error = http_error(from_replica(RuntimeError("CUDA out of memory at 0xdeadbeef")))
    assert error.status == 500 and "deadbeef" not in error.message and error.type == "server_error"


def test_seed_contract_error_keeps_its_code_across_ray():
    error = http_error(from_replica(SeedContractError(["seed is required: pass an integer seed"], param="seed")))
    assert (error.status, error.param, error.code) == (400, "seed", "seed_contract")


def test_request_timeout_is_504():
    assert http_error(TimeoutError()).status == 504


SERVER_FAILURES = [
    ValueError("invalid literal for int() with base 10: 'abc'"),
    TypeError("unsupported operand type(s) for +: 'int' and 'str'"),
    KeyError("height"),
]


@pytest.mark.parametrize("wrapped", [False, True], ids=["local", "from-replica"])
@pytest.mark.parametrize("exc", SERVER_FAILURES, ids=lambda v: type(v).__name__)
def test_a_bare_value_or_type_error_is_the_servers_failure_500_and_logged(exc, wrapped, caplog):
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        error = http_error(from_replica(exc) if wrapped else exc)
    assert (error.status, error.type, error.code) == (500, "server_error", "internal_error")
    assert str(exc.args[0]) not in error.message and "unexpected error" in caplog.text


def test_a_response_models_validation_error_is_the_servers_failure():
    with pytest.raises(ValidationError) as caught:
        ImagesResponse(created=0, data=[], model="m", size="64x64", invariance={"llm": 1})
    assert http_error(caught.value).status == 500


def test_a_sampling_params_validation_error_names_its_field():
    with pytest.raises(ValidationError) as caught:
        LLMSamplingParams(max_tokens=4, min_tokens=8)
    error = http_error(from_replica(caught.value))
    assert error.status == 400 and "min_tokens" in error.message


# --- vLLM's own refusals, in the LLM stage ---------------------------------------------------------


@pytest.mark.parametrize("fields,param", [
    ({"stop": [""]}, "stop"),
    ({"top_k": -5}, "top_k"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 7.0}, "presence_penalty"),
    ({"n": 0}, None),  # not one of our fields: refused, no field named
    ({"temperature": "hot"}, None),  # a TypeError inside vLLM: refused, the field not told
])
def test_vllm_refusing_sampling_params_is_an_invalid_request_naming_the_field(fields, param):
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from stages.llm.requests import refused_by_vllm

    with pytest.raises(InvalidRequestError) as caught, refused_by_vllm("messages", kinds=(ValueError, TypeError)):
        SamplingParams(**fields)
    error = http_error(from_replica(caught.value))
    assert (error.status, error.param) == (400, param) and error.message.startswith("refused by vLLM")


def test_vllm_refusing_the_prompt_names_the_requests_prompt_field():
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError

    from stages.llm.requests import refused_by_vllm

    with pytest.raises(InvalidRequestError) as caught, refused_by_vllm("prompt"):
        raise VLLMValidationError("The decoder prompt (length 2000) is longer than the maximum model length of 1024.")
    assert caught.value.param == "prompt"


def test_a_server_failure_inside_vllm_is_not_made_the_clients():
    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineGenerateError

    from stages.llm.requests import refused_by_vllm

    for failure in (EngineGenerateError(), ValueError("a bug while generating")):
        with pytest.raises(type(failure)), refused_by_vllm("messages"):
            raise failure


# --- the HTTP layer (orchestration.api) over a stub ingress ------------------------------------------


class StubIngress:
    """What `build_api` needs of the Ingress; its stage work raises `self.failure` (or echoes the prompt, as it is)."""

    config = SimpleNamespace(ingress=SimpleNamespace(request_timeout_s=5))
    switch_headers = {"X-Omni-Batch-Invariant-LLM": "true", "X-Omni-Batch-Invariant-Diffusion": "true"}
    failure: BaseException | None = None

    async def images(self, request):
        raise self.failure or AssertionError("the stub renders nothing: image tests here set a failure")

    async def chat(self, request):
        from fastapi.responses import JSONResponse

        if self.failure:
            raise self.failure
        return JSONResponse({"echo": request.messages[0].content})


@pytest.fixture
def api():
    from fastapi.testclient import TestClient

    from orchestration.api import build_api

    ingress = StubIngress()
    with TestClient(build_api(ingress), raise_server_exceptions=False) as client:
        client.ingress = ingress
        yield client


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["X-Omni-Batch-Invariant-LLM"] == "true"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"}, {"Content-Type": ""}, {}],
                         ids=["text-plain", "empty", "none"])
def test_a_json_body_not_declared_as_json_is_415(api, headers):
    response = api.post("/v1/images/generations", content=b'{"prompt": "x", "seed": 1}', headers=headers)
    assert openai_error(response, 415)["code"] == "unsupported_media_type"


def test_a_json_edit_is_415_asking_for_multipart(api):
    error = openai_error(api.post("/v1/images/edits", json={"prompt": "x"}), 415)
    assert "multipart/form-data" in error["message"]


def test_a_body_over_the_limit_is_413_by_its_length_or_as_it_streams(api):
    big = b'{"prompt": "x", "user": "' + b"u" * MAX_JSON_BODY_BYTES + b'"}'
    declared = api.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
    assert openai_error(declared, 413)["code"] == "body_too_large"
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: chunked
    streamed = api.post("/v1/chat/completions", content=chunks, headers={"Content-Type": "application/json"})
    assert openai_error(streamed, 413)["code"] == "body_too_large"


def test_an_edit_image_over_16_mib_is_413_naming_the_image(api):
    image = ("in.png", b"\0" * (16 * 2**20 + 1), "image/png")
    response = api.post("/v1/images/edits", files={"image": image}, data={"prompt": "x"})
    assert openai_error(response, 413)["param"] == "image"


def test_duplicate_keys_and_non_utf8_are_400(api):
    for raw in (b'{"prompt": "x", "prompt": "y"}', b'{"prompt": "\xff"}'):
        response = api.post("/v1/images/generations", content=raw, headers={"Content-Type": "application/json"})
        assert openai_error(response, 400)["code"] in ("duplicate_key", "json_invalid")


def test_a_valid_body_reaches_the_ingress_whole(api):
    response = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "\u05e9 fox"}]})
    assert response.status_code == 200 and response.json() == {"echo": "\u05e9 fox"}


def test_a_servers_value_error_is_500_over_http(api):
    api.ingress.failure = ValueError("a bug in the server")
    error = openai_error(api.post("/v1/images/generations", json={"prompt": "x"}), 500)
    assert error["type"] == "server_error" and "bug" not in error["message"]
