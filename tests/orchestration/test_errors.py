"""The one error mapping: every exception a request can raise -> status, OpenAI body, headers.

The HTTP-level tests at the end run `orchestration.api` (the real routes, body checks and handlers) in-process
over a stub ingress whose stage calls raise what a test says: fast, without Ray. The real app over real HTTP is
tests/orchestration/test_fuzz.py (slow), and, for refused bodies too large to answer before they are read, the last
tests here (slow: the package's shared app, through Serve's proxy).
"""

import functools
import json
import logging
import pickle
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
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
from contracts.http import BODY_RULES, MAX_JSON_BODY_BYTES, ImagesResponse
from contracts.invariance import SeedContractError
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams
from orchestration.drain import Drain
from orchestration.errors import http_error


def from_replica(exc: Exception) -> Exception:
    """What a caller sees when a replica raised `exc`: Ray's wrapper, a subclass of the original type."""
    exc = pickle.loads(pickle.dumps(exc))
    return RayTaskError("DiffusionStage.render", "Traceback: ...", exc).as_instanceof_cause()


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

    from stages.llm.engine import refused_by_vllm

    with pytest.raises(InvalidRequestError) as caught, refused_by_vllm("messages", kinds=(ValueError, TypeError)):
        SamplingParams(**fields)
    error = http_error(from_replica(caught.value))
    assert (error.status, error.param) == (400, param) and error.message.startswith("refused by vLLM")


def test_vllm_refusing_the_prompt_names_the_requests_prompt_field():
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError

    from stages.llm.engine import refused_by_vllm

    with pytest.raises(InvalidRequestError) as caught, refused_by_vllm("prompt"):
        raise VLLMValidationError("The decoder prompt (length 2000) is longer than the maximum model length of 1024.")
    assert caught.value.param == "prompt"


def test_a_server_failure_inside_vllm_is_not_made_the_clients():
    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineGenerateError

    from stages.llm.engine import refused_by_vllm

    for failure in (EngineGenerateError(), ValueError("a bug while generating")):
        with pytest.raises(type(failure)), refused_by_vllm("messages"):
            raise failure


# --- the HTTP layer (orchestration.api) over a stub ingress ------------------------------------------


class StubIngress:
    """What `build_api` needs of the Ingress; its stage work raises `self.failure` (or echoes the prompt, as it is)."""

    config = SimpleNamespace(ingress=SimpleNamespace(request_timeout_s=5))
    switch_headers = {"X-Omni-Batch-Invariant-LLM": "true", "X-Omni-Batch-Invariant-Diffusion": "true"}
    drain = Drain("stub")  # never told to drain: every request admitted
    videos = None  # serves no videos: no video routes
    failure: BaseException | None = None

    async def images(self, request, fresh: bool = False):
        raise self.failure or AssertionError("the stub renders nothing: image tests here set a failure")

    async def chat(self, request, fresh: bool = False):
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


class StubVideos:
    """What `build_api`'s video routes need of a VideoFront: a job's creation, which raises the ingress's failure."""

    def __init__(self, ingress: StubIngress):
        self.ingress = ingress

    async def create(self, request):
        raise self.ingress.failure or AssertionError("the stub renders nothing")


@pytest.fixture
def video_api():
    from fastapi.testclient import TestClient

    from orchestration.api import build_api

    ingress = StubIngress()
    ingress.videos = StubVideos(ingress)
    with TestClient(build_api(ingress), raise_server_exceptions=False) as client:
        client.ingress = ingress
        yield client


#: Past validation, the stub's stage work refuses with this: a 400 naming "reached" says the body was accepted.
REACHED = InvalidRequestError("the body passed validation", param="reached")
PNG = ("in.png", b"\x89PNG\r\n\x1a\n", "image/png")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/images/generations", {"prompt": "x", "seed": 1.0}, "seed"),
    ("/v1/images/generations", {"prompt": "x", "seed": 1, "n": 2.0}, "n"),
    ("/v1/images/generations", {"prompt": "x", "seed": 1, "num_inference_steps": 4.0}, "num_inference_steps"),
    ("/v1/images/generations", {"prompt": "x", "seed": 1, "stream": True, "partial_images": 1.0}, "partial_images"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 7.0}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4.0}, "max_tokens"),
    ("/v1/videos", {"prompt": "x", "seed": 1.0}, "seed"),
    ("/v1/videos", {"prompt": "x", "seed": 1, "num_frames": 5.0}, "num_frames"),
    ("/v1/videos", {"prompt": "x", "seed": 1, "seconds": 1.0}, "seconds"),
])
def test_a_json_float_for_an_integer_field_is_a_400_naming_it_on_every_route(video_api, route, body, param):
    video_api.ingress.failure = REACHED
    error = openai_error(video_api.post(route, json=body), 400)
    assert error["param"] == param and param in error["message"]
    whole = {k: int(v) if k == param else v for k, v in body.items()}
    assert openai_error(video_api.post(route, json=whole), 400)["param"] in ("reached", None)  # the integer passes


@pytest.mark.parametrize("route,fields,files", [
    ("/v1/images/edits", {"prompt": "x", "n": "1"}, {"image": PNG}),
    ("/v1/videos", {"prompt": "x", "num_frames": "5"}, {}),
])
@pytest.mark.parametrize("name", ["seed", "num_inference_steps"])
def test_a_forms_integer_field_takes_1_and_refuses_1_0_naming_it(video_api, route, fields, files, name):
    video_api.ingress.failure = REACHED
    for text, param in (("1", "reached"), ("1.0", name), ("1e0", name)):
        form = {field: (None, value) for field, value in {**fields, "seed": "1", name: text}.items()}  # text parts
        response = video_api.post(route, files={**form, **files})
        assert openai_error(response, 400)["param"] == param, (text, response.text)


def test_a_servers_value_error_is_500_over_http(api):
    api.ingress.failure = ValueError("a bug in the server")
    error = openai_error(api.post("/v1/images/generations", json={"prompt": "x"}), 500)
    assert error["type"] == "server_error" and "bug" not in error["message"]


# --- a refused body's answer reaches the client: the real app, through Serve's proxy ----------------------

#: Where a sender pauses, and for how long: past every JSON route's limit, so the server has refused the body and
#: answered by then, and the client is still sending, as over any real network (on the loopback a 20 MB body can
#: arrive whole before the answer is written, and a server that closes on unread bytes gets away with it).
PAUSE_AT, PAUSE_S = 10 * 2**20, 0.3


def twenty_mb() -> bytes:
    """A 20 MB JSON body: 20 times chat's limit, 2.5 times a generation's."""
    return json.dumps({"prompt": "x", "user": "u" * 20_000_000}).encode()


def paced(raw: bytes) -> Iterator[bytes]:
    for start in range(0, len(raw), 2**16):
        if start == PAUSE_AT:
            time.sleep(PAUSE_S)
        yield raw[start : start + 2**16]


def length(raw: bytes, chunked: bool) -> dict[str, str]:
    return {} if chunked else {"Content-Length": str(len(raw))}  # an iterator body without it goes chunked


def by_urllib(url: str, raw: bytes, media: str, chunked: bool = False) -> tuple[int, dict]:
    """urllib sends `Connection: close` and reads nothing until it has sent the whole body: a server that answers
    early and closes on unread bytes resets the connection, and the answer is lost with it."""
    headers = {"Content-Type": media} | length(raw, chunked)
    request = urllib.request.Request(url, data=paced(raw), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def by_httpx(url: str, raw: bytes, media: str, chunked: bool = False, close: bool = False) -> tuple[int, dict]:
    headers = {"Content-Type": media} | length(raw, chunked) | ({"Connection": "close"} if close else {})
    with httpx.Client(timeout=60) as client:
        response = client.post(url, content=paced(raw), headers=headers)
    return response.status_code, response.json()


SENDERS: dict[str, Callable[[str, bytes, str], tuple[int, dict]]] = {
    "urllib": by_urllib,
    "urllib-chunked": functools.partial(by_urllib, chunked=True),
    "httpx": by_httpx,
    "httpx-chunked": functools.partial(by_httpx, chunked=True),
    "httpx-close": functools.partial(by_httpx, close=True),
    "httpx-chunked-close": functools.partial(by_httpx, chunked=True, close=True),
}
CHAT_ROUTE, IMAGES_ROUTE = "/v1/chat/completions", "/v1/images/generations"


@pytest.mark.slow
@pytest.mark.parametrize(
    "sender,route",
    [(sender, CHAT_ROUTE) for sender in SENDERS] + [("urllib", IMAGES_ROUTE), ("httpx-chunked", IMAGES_ROUTE)],
)
def test_a_20_mb_body_gets_its_413_not_a_connection_reset(server, sender, route):
    status, body = SENDERS[sender](server + route, twenty_mb(), "application/json")
    assert status == 413, body
    assert body["error"]["code"] == "body_too_large"
    assert f"limit of {BODY_RULES[route].max_bytes} bytes" in body["error"]["message"]


@pytest.mark.slow
def test_a_20_mb_body_of_the_wrong_type_gets_its_415_not_a_connection_reset(server):
    status, body = by_urllib(server + CHAT_ROUTE, twenty_mb(), "text/plain")
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"


@pytest.mark.slow
def test_a_body_declared_past_the_drain_bound_is_answered_at_once_and_the_connection_closed(server):
    """A client that declares 1 GB is not waited for: its 413 comes before it sends a byte, then the server closes
    (a client that goes on sending may then see a reset: the price of not reading its gigabyte)."""
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            f"POST {CHAT_ROUTE} HTTP/1.1\r\nHost: omniserve\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10**9}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := conn.recv(2**16):  # ends at the server's close (a timeout fails the test)
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower(), head
    assert json.loads(body)["error"]["code"] == "body_too_large"
