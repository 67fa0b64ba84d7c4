"""The one error mapping: every exception a request can raise -> status, OpenAI body, headers."""

import pickle

import pytest
from pydantic import ValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from contracts.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from contracts.invariance import SeedContractError
from contracts.sampling import DiffusionSamplingParams
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
    (ValueError("bad value"), 400, None),
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
    assert http_error(HTTPException(405, "Method Not Allowed")).status == 405


def test_server_failures_are_5xx_without_details():
    error = http_error(from_replica(RuntimeError("CUDA out of memory at 0xdeadbeef")))
    assert error.status == 500 and "deadbeef" not in error.message and error.type == "server_error"


def test_seed_contract_error_keeps_its_code_across_ray():
    error = http_error(from_replica(SeedContractError(["seed is required: pass an integer seed"], param="seed")))
    assert (error.status, error.param, error.code) == (400, "seed", "seed_contract")


def test_request_timeout_is_504():
    assert http_error(TimeoutError()).status == 504
