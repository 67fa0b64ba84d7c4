"""The HTTP API through FastAPI's own machinery: typed bodies and responses, so `/openapi.json` documents them.

Every error, whatever raised it, leaves through `orchestration.errors.http_error` in OpenAI's shape; one
middleware adds the `X-Omni-Batch-Invariant-LLM` / `-Diffusion` headers to every response, errors included.
Each POST route's body is checked before FastAPI reads it (`BodyCheckedRoute`, rules in `contracts.http.BODY_RULES`):
its content type (415), its size (413, from Content-Length or while it arrives) and, for JSON, a strict decoding
(UTF-8, no duplicate keys: 400).

Streaming (`stream: true` on /v1/images/generations and /v1/images/edits, `partial_images` 0..3) answers with
server-sent events exactly as OpenAI's Images API does, once admission has passed (a bad request is still a JSON
4xx). Each event is `event: <type>` and `data: <one JSON object>` (`contracts.http`'s event models), then a blank
line; <kind> is `image_generation` (generations) or `image_edit` (edits):

    event: <kind>.partial_image       up to partial_images per image (fewer if it has too few steps), in order
    data: {"type": "<kind>.partial_image", "b64_json": "<PNG preview>", "created_at": 1767225600, "size": "64x64",
           "quality": "high", "background": "opaque", "output_format": "png", "partial_image_index": 0,
           "image_index": 0}
    event: <kind>.completed           one per image: the bytes a non-streamed request returns for it
    data: {"type": "<kind>.completed", "b64_json": "<PNG>", "created_at": ..., "size": "64x64", "quality": "high",
           "background": "opaque", "output_format": "png", "image_index": 0, "revised_prompt": "...", "seed": 7,
           "sha256": "<hex of the PNG>", "replica": "...", "batch_size": 1, "steps_co_batched": 0,
           "usage": {"input_tokens": 12, "input_tokens_details": {"image_tokens": 0, "text_tokens": 12},
                     "output_tokens": 9, "total_tokens": 21}}
    event: error                      a failure after the stream began (then it ends): the error body below
    data: {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

`image_index` and the fields after it in the completed event are extensions (the openai client keeps them as
extra attributes). OpenAI's events name no image, as OpenAI streams one; here n > 1 streams too, the images
rendered together and their events interleaved as they come, each telling its `image_index`. `usage` counts the
LLM stage's rewrite of the prompt (zeros without a rewrite). Partial images are the step engine's current
estimate of the image, decoded: deterministic, but outside the bit-for-bit promise; a pipeline without the step
engine sends the completed events only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from contracts.errors import InvalidRequestError, invalid_request
from contracts.http import (
    BODY_RULES,
    STREAM_EVENT_KINDS,
    BodyRule,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesResponse,
    LoraList,
    MiB,
    ModelCard,
    ModelList,
    decode_json,
)
from contracts.images import check_image_bytes
from contracts.provenance import MEDIA_TYPES
from contracts.videos import Video, VideoCreateRequest, VideoDeleted

from .drain import Drain, DrainGate
from .errors import HTTPError, client_error, http_error
from .health import HealthResponse
from .metrics import RequestMetrics
from .playground import mount as mount_playground
from .responses import http_caching, image_event, images_response

if TYPE_CHECKING:
    from .ingress import Ingress
    from .video_jobs import VideoFront

#: What every route documents besides its success: OpenAI-shaped errors.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "a field the client sent is wrong (named in `param`)"),
        (404, "an unknown model"),
        (413, "the body is over the route's size limit"),
        (415, "the body is not of the route's content type"),
        (503, "a stage is full or unavailable (see Retry-After)"),
        (504, "the request outlasted the server's time limit"),
    )
}


#: The image routes' other success: with `stream: true`, server-sent events (this module's docstring).
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the images; with `stream: true`, server-sent events: `<kind>.partial_image` events, then one "
        "`<kind>.completed` per image (kind `image_generation` or `image_edit`)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


IMAGE_FILE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the file, as the request that linked to it asked (its sha256 is the one that response gave)",
        "content": {media: {"schema": {"type": "string", "format": "binary"}} for media in MEDIA_TYPES.values()},
    }
}


CHAT_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the completion; with `stream: true`, server-sent events: `data: <chat.completion.chunk>` lines "
        "(ChatCompletionChunk), then `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def error_response(error: HTTPError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


#: How much of a refused body is still read (and thrown away) before its answer goes, and for how long. Serve's proxy
#: (uvicorn) closes the connection as soon as the answer is written when the request said `Connection: close` (urllib
#: always does), and a close with unread bytes is a reset, in which a client still sending loses the answer (measured:
#: a 20 MB body refused by its length, or after its first MiB, reached urllib as "connection reset by peer"). Read to
#: its end, the body leaves nothing unread and the client reads its 413; the connection stays open for the next
#: request. Past either bound (the largest limit is 17 MiB) the answer goes at once, with `Connection: close`, so that
#: uvicorn stops reading, which it would otherwise do, throwing it away, for as long as the client sends: the bounded
#: lingering close nginx makes too, after which a client still sending may see a reset.
DRAIN_BYTES = 64 * MiB
DRAIN_S = 10.0


class BodyReader:
    """A request's body, read from ASGI's receive: what has come and whether it has ended, so that the rest of a
    refused body can still be drained (`drain`)."""

    def __init__(self, request: Request):
        self.request = request
        self.size = 0
        self.ended = False

    async def chunk(self) -> bytes:
        message = await self.request.receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        body: bytes = message.get("body", b"")
        self.size += len(body)
        self.ended = not message.get("more_body", False)
        return body

    async def read(self, rule: BodyRule) -> bytes:
        """The whole body, refused by its headers before a byte is read, and again once more than allowed has come."""
        rule.check_headers(self.request.headers.get("content-type"), self.request.headers.get("content-length"))
        body = bytearray()
        while not self.ended:
            body += await self.chunk()
            rule.check_size(len(body))
        return bytes(body)

    async def drain(self) -> bool:
        """Read and throw away what is left of a refused body, within DRAIN_BYTES and DRAIN_S: whether it ended."""
        declared = self.request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > DRAIN_BYTES):
            return False  # not worth waiting for
        try:
            async with asyncio.timeout(DRAIN_S):
                while not self.ended and self.size <= DRAIN_BYTES:
                    await self.chunk()
        except (TimeoutError, ClientDisconnect):
            return False
        return self.ended


def replaying(request: Request, body: bytes) -> Request:
    """The request again, its body (already read) delivered whole to whoever reads it next."""
    delivered = False

    async def receive():
        nonlocal delivered
        if delivered:
            return await request.receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


def media_type(request: Request) -> str:
    """The request's content type without its parameters (a form's boundary), lower case."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


class BodyCheckedRoute(APIRoute):
    """A route whose body passes its `BODY_RULES` entry before FastAPI reads or validates it."""

    def get_route_handler(self):
        handle = super().get_route_handler()
        rule = BODY_RULES.get(self.path)
        if rule is None:
            return handle

        async def checked(request: Request) -> Response:
            reader = BodyReader(request)
            try:
                body = await reader.read(rule)
                if media_type(request) == "application/json":
                    decode_json(body)  # FastAPI decodes it again, leniently; this is the decoding that refuses
            except Exception as exc:
                refused = error_response(http_error(exc))
                if not await reader.drain():  # the client reads its answer only once nothing it sent is left unread
                    refused.headers["Connection"] = "close"
                return refused
            return await handle(replaying(request, body))

        return checked


#: An edit's body as OpenAPI documents it: a multipart form (the route reads it itself, see `read_edit`).
EDIT_BODY = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": ImageEditRequest.form_schema()}}}
}


async def read_edit(request: Request) -> ImageEditRequest:
    """The edit in a multipart form, as OpenAI's client sends it: one file `image` (or `image[]`), the rest text.

    Its content type and size were checked by its route (`BodyCheckedRoute`)."""
    fields: dict[str, str | bytes] = {}
    async with request.form(max_files=4, max_fields=64) as form:
        value: UploadFile | str | bytes  # a file's field becomes its bytes
        for name, value in form.multi_items():
            name = "image" if name == "image[]" else name
            if name in fields:
                raise InvalidRequestError(
                    "send exactly one image" if name == "image" else f"{name} is given more than once", param=name
                )
            if name == "image":
                if not isinstance(value, UploadFile):
                    raise InvalidRequestError(
                        "image must be sent as a file (a multipart file field)", param="image", code="invalid_type"
                    )
                check_image_bytes(value.size or 0)
                value = await value.read()
            elif isinstance(value, UploadFile):
                value = b""  # any other file is refused by its name, unread
            fields[name] = value
    return ImageEditRequest.from_form(fields)


def no_cache(request: Request) -> bool:
    """Whether the client asks for a result made anew, not one kept (RFC 9111: `Cache-Control: no-cache`, or, without
    a Cache-Control, HTTP/1.0's `Pragma: no-cache`), as it would of any HTTP cache on the way."""
    asked = request.headers.get("cache-control")
    if asked is None:
        asked = request.headers.get("pragma", "")
    return "no-cache" in (directive.strip().split("=")[0].lower() for directive in asked.split(","))


def _frame(event: str, data: str) -> str:
    return f"event: {event}\ndata: {data}\n\n"


async def server_sent(events: AsyncGenerator[Any, None], timeout_s: float, *, chat: bool = False) -> AsyncIterator[str]:
    """Each event as one SSE frame, within `timeout_s` in all; a failure becomes a last `error` frame. `chat`: OpenAI's
    chat stream instead, data lines only (a failure as a `data: {"error": ...}` line), then `data: [DONE]`. A client
    gone cancels this generator, which closes `events` and so the stage call behind them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while True:
            try:  # wait_for, not asyncio.timeout: a timeout must not fire while the caller sends a frame
                event = await asyncio.wait_for(anext(events), deadline - loop.time())
            except StopAsyncIteration:
                break
            yield f"data: {event.model_dump_json()}\n\n" if chat else _frame(event.type, event.model_dump_json())
    except Exception as exc:
        body = json.dumps(http_error(exc).body())
        yield f"data: {body}\n\n" if chat else _frame("error", body)
    finally:
        await events.aclose()
    if chat:
        yield "data: [DONE]\n\n"


class Answers:
    """What each route answers, from the ingress's typed results: the HTTP bodies, headers and event streams, within
    the request time limit, every failure in OpenAI's error shape (`respond`, the only place that happens)."""

    def __init__(self, ingress: Ingress):
        self.ingress = ingress
        self.timeout_s = ingress.config.ingress.request_timeout_s

    async def respond(self, work: Awaitable[Any]) -> Any:
        """Run one route's work under the request time limit; its exception becomes the HTTP error."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await work
        except Exception as exc:
            return error_response(http_error(exc))

    def events(self, events: AsyncGenerator[Any, None], *, chat: bool = False) -> StreamingResponse:
        """A stream's events as server-sent events (`server_sent`)."""
        frames = server_sent(events, self.timeout_s, chat=chat)
        return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def images(self, request: ImageGenerationRequest, http: Request) -> JSONResponse | StreamingResponse:
        """Every image route's answer: the images whole (inline, or as links to the image store), or (`stream: true`)
        as server-sent events, from one admitted plan and its items (`Ingress.images`)."""
        ingress = self.ingress
        plan, items = await ingress.images(request, fresh=no_cache(http))
        if not request.stream:
            done = await plan.results(items)
            links = None
            if request.response_format == "url":
                kept = await ingress.links.keep([r.delivered for r in done])
                links = [f"{http.base_url}v1/images/{i}" for i in kept]
            whole = images_response(plan, done, ingress.config.switches, links)
            return JSONResponse(jsonable_encoder(whole), headers=http_caching(done))
        kind = STREAM_EVENT_KINDS["edit" if isinstance(request, ImageEditRequest) else "generation"]
        return self.events(image_event(plan, kind, index, item) async for index, item in items)

    async def edit(self, http: Request) -> JSONResponse | StreamingResponse:
        """OpenAI's image edits (image-to-image): the generation's answer, from the image of a multipart form."""
        return await self.images(await read_edit(http), http)

    async def stored_image(self, image_id: str) -> Response:
        """A file a request with `response_format: "url"` linked to, while the image store keeps it (cacheable as
        long)."""
        file, left_s = await self.ingress.links.get(image_id)
        headers = {"ETag": f'"{file.sha256}"', "Cache-Control": f"private, max-age={max(0, int(left_s))}"}
        return Response(file.data, media_type=file.media_type, headers=headers)

    async def chat(self, request: ChatCompletionRequest, http: Request) -> Any:
        """A chat completion whole, or (`stream: true`) as server-sent events once admission has passed."""
        answer = await self.ingress.chat(request, fresh=no_cache(http))
        if not request.stream:
            return answer
        return self.events(cast(AsyncGenerator[Any, None], answer), chat=True)  # a stream's answer: its chunks


def _answer_every_request_alike(api: FastAPI, headers: dict[str, Any], drain: Drain) -> None:
    """The switch headers on every response, the request metrics, OpenAI's error shape for FastAPI's own errors, and
    the drain's refusals (`orchestration.drain`)."""

    api.add_middleware(DrainGate, drain=drain)  # innermost: a refusal still gets the headers and is counted

    @api.middleware("http")
    async def switch_headers(request: Request, call_next) -> Response:
        response = await call_next(request)
        response.headers.update(headers)
        return response

    api.add_middleware(RequestMetrics)  # outermost: counts and times every answer, errors and streams included

    @api.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(client_error(list(exc.errors()), root=("body",)))

    @api.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths, wrong methods, unreadable bodies: same body shape all the same.
        if exc.status_code == 405:
            exc.headers = {**(exc.headers or {}), "Allow": allowed_methods(api, request)}
        return error_response(http_error(exc))


def allowed_methods(api: FastAPI, request: Request) -> str:
    """What a 405's `Allow` says: every method of every route of the request's path (Starlette names the first
    route's only: `OPTIONS /v1/videos/{id}` was told GET, though DELETE is served there too)."""
    methods: set[str] = set()
    for route in api.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


#: FastAPI's own /openapi.json, /docs and /redoc off: `_serve_documents` serves the deployment's.
OWN_DOCUMENTS: dict[str, Any] = {"openapi_url": None, "docs_url": None, "redoc_url": None}


#: A video request's body as OpenAPI documents it: JSON, or the multipart form OpenAI's client sends (`read_video`).
VIDEO_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            kind: {"schema": VideoCreateRequest.form_schema()} for kind in ("application/json", "multipart/form-data")
        },
    }
}
VIDEO_FILE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the video as MP4 (H.264; its sha256 is the video's `sha256`, its provenance in its `comment` tag)",
        "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}},
    }
}


async def read_video(request: Request) -> VideoCreateRequest:
    """A video request from a JSON body or a multipart form (text fields; a file, OpenAI's `input_reference`, is
    refused by its name). Its content type and size were checked by its route (`BodyCheckedRoute`)."""
    if media_type(request) == "application/json":
        try:
            return VideoCreateRequest.model_validate(decode_json(await request.body()))
        except ValidationError as err:
            raise invalid_request(err) from None
    fields: dict[str, str | bytes] = {}
    async with request.form(max_files=2, max_fields=32) as form:
        for name, value in form.multi_items():
            if name in fields:
                raise InvalidRequestError(f"{name} is given more than once", param=name)
            fields[name] = b"unread" if isinstance(value, UploadFile) else value
    return VideoCreateRequest.from_form(fields)


def _serve_videos(api: FastAPI, videos: VideoFront | None, respond) -> None:
    """OpenAI's Videos API where the app serves videos: create a job, poll it, download its MP4, delete it
    (`orchestration.video_jobs`)."""
    if videos is None:
        return

    async def create(request: Request) -> Video:
        return await videos.create(await read_video(request))

    async def content(video_id: str, variant: str) -> Response:
        if variant != "video":
            raise InvalidRequestError(
                f"variant {variant!r} is not served: a video's content is its MP4 (variant 'video')", param="variant"
            )
        video, mp4 = await videos.content(video_id)
        headers = {"ETag": f'"{video.sha256}"', "Content-Disposition": f'inline; filename="{video_id}.mp4"'}
        return Response(mp4, media_type="video/mp4", headers=headers)

    @api.post("/v1/videos", response_model=Video, responses=ERRORS, openapi_extra=VIDEO_BODY)
    async def videos_create(request: Request):
        return await respond(create(request))

    @api.get("/v1/videos/{video_id}", response_model=Video, responses=ERRORS)
    async def videos_retrieve(video_id: str):
        return await respond(videos.get(video_id))

    @api.get("/v1/videos/{video_id}/content", responses={**ERRORS, **VIDEO_FILE})
    async def videos_content(video_id: str, variant: str = "video"):
        return await respond(content(video_id, variant))

    @api.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
    async def videos_delete(video_id: str):
        return await respond(videos.delete(video_id))


def _serve_documents(api: FastAPI, ingress: Ingress) -> None:
    """/openapi.json, narrowed to this deployment (`orchestration.openapi`), and /docs rendering it."""

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return JSONResponse(await ingress.openapi(api.openapi()))

    @api.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        return get_swagger_ui_html(openapi_url=f"{request.scope.get('root_path', '')}/openapi.json", title="omniserve")


DESCRIPTION = (
    "Reproducible two-stage (LLM -> diffusion) generation; OpenAI-compatible Images, Videos (where served) and Chat "
    "routes. An integer field takes a JSON integer only: `1.0` is refused as `1.5` is (JSON Schema's `integer` would "
    "take it; OpenAI's clients and this server do not)."
)


def build_api(ingress: Ingress) -> FastAPI:
    api = FastAPI(title="omniserve", description=DESCRIPTION, **OWN_DOCUMENTS)
    api.router.route_class = BodyCheckedRoute
    answers = Answers(ingress)
    respond = answers.respond

    _answer_every_request_alike(api, ingress.switch_headers, ingress.drain)

    @api.post("/v1/images/generations", response_model=ImagesResponse, responses={**ERRORS, **STREAMED})
    async def images_generations(body: ImageGenerationRequest, request: Request):
        return await respond(answers.images(body, request))

    # "img_" in the path, so the POST routes' paths (/v1/images/generations) stay theirs: a GET there is a 405.
    @api.get("/v1/images/img_{token}", responses={**ERRORS, **IMAGE_FILE})
    async def image_file(token: str):
        return await respond(answers.stored_image(f"img_{token}"))

    @api.post(
        "/v1/images/edits", response_model=ImagesResponse, responses={**ERRORS, **STREAMED}, openapi_extra=EDIT_BODY
    )
    async def images_edits(request: Request):
        return await respond(answers.edit(request))

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**ERRORS, **CHAT_STREAMED})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(answers.chat(body, request))

    @api.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        return await respond(ingress.models())

    @api.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model: str):
        return await respond(ingress.model(model))

    @api.get("/v1/loras", response_model=LoraList, responses=ERRORS)
    async def loras():
        return await respond(ingress.loras())

    @api.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health():
        report = await respond(ingress.health())  # health must answer even when something is broken
        if isinstance(report, Response):
            return report
        return JSONResponse(report.model_dump(exclude_none=True), status_code=report.http_status)

    _serve_videos(api, ingress.videos, respond)
    _serve_documents(api, ingress)
    mount_playground(api, ingress.videos is not None)  # GET /: the playground page and its assets
    return api
