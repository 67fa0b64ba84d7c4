"""The HTTP API through FastAPI's own machinery: typed bodies and responses, so `/openapi.json` documents them.

Every error, whatever raised it, leaves through `orchestration.errors.http_error` in OpenAI's shape; one
middleware adds the `X-Omni-Batch-Invariant-LLM` / `-Diffusion` headers to every response, errors included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.http import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
    ImageGenerationRequest,
    ImagesResponse,
    ModelList,
)

from .errors import HTTPError, client_error, http_error
from .health import HealthResponse

if TYPE_CHECKING:
    from .ingress import Ingress

#: What every route documents besides its success: OpenAI-shaped errors.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "a field the client sent is wrong (named in `param`)"),
        (404, "an unknown model"),
        (503, "a stage is full or unavailable (see Retry-After)"),
        (504, "the request outlasted the server's time limit"),
    )
}


def error_response(error: HTTPError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _not_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return not (kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")))


def build_api(ingress: Ingress) -> FastAPI:
    api = FastAPI(
        title="omniserve",
        description="Reproducible two-stage (LLM -> diffusion) generation; OpenAI-compatible Images and Chat routes.",
    )
    headers = ingress.switch_headers
    timeout_s = ingress.config.ingress.request_timeout_s

    async def respond(work: Awaitable[Any]) -> Any:
        """Run one route's work under the request time limit; the only place a route's exception becomes HTTP."""
        try:
            async with asyncio.timeout(timeout_s):
                return await work
        except Exception as exc:
            return error_response(http_error(exc))

    @api.middleware("http")
    async def switch_headers(request: Request, call_next) -> Response:
        response = await call_next(request)
        response.headers.update(headers)
        return response

    @api.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.method == "POST" and _not_json(request):
            # A body that is not declared JSON is refused (a browser can send text/plain cross-site unasked).
            return error_response(HTTPError(400, "invalid_request_error",
                                            "send the body as JSON with Content-Type: application/json", code="invalid_content_type"))
        return error_response(client_error(list(exc.errors()), root=("body",)))

    @api.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths, wrong methods, unreadable bodies: same body shape all the same.
        return error_response(http_error(exc))

    @api.post("/v1/images/generations", response_model=ImagesResponse, responses=ERRORS)
    async def images_generations(body: ImageGenerationRequest):
        return await respond(ingress.images(body))

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest):
        return await respond(ingress.chat(body))

    @api.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        return await respond(ingress.models())

    @api.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health():
        report = await respond(ingress.health())  # health must answer even when something is broken
        if isinstance(report, Response):
            return report
        return JSONResponse(report.model_dump(exclude_none=True), status_code=200 if report.status == "ok" else 503)

    return api
