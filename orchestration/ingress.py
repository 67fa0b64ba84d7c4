"""The HTTP ingress: FastAPI inside Serve, OpenAI-compatible routes, one error mapping.

    POST /v1/images/generations   admit -> per image (LLM enhance -> diffusion generate) -> b64 PNGs
    POST /v1/chat/completions     the LLM stage alone
    GET  /v1/models               the served models, OpenAI's list format
    GET  /health                  stage states, invariance switches, kernel reports, replica counts

Every route's response, errors included, carries the switches as `X-Omni-Batch-Invariant-LLM` /
`-Diffusion` headers; image and chat bodies carry them too. Bodies are parsed here (not by FastAPI) so every client mistake takes the
same path: contracts.http -> InvalidRequestError -> orchestration.errors -> a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.http import (
    ChatCompletionRequest,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    ModelNotFoundError,
    StageInvariance,
    parse_body,
)

from .config import ServingSettings
from .errors import HTTPError, http_error
from .pipeline import ImagePipeline, admit_chat, admit_images

STAGES = ("llm", "diffusion")
SWITCH_HEADERS = {"llm": "X-Omni-Batch-Invariant-LLM", "diffusion": "X-Omni-Batch-Invariant-Diffusion"}

api = FastAPI(
    title="omniserve",
    description="Reproducible two-stage (LLM -> diffusion) generation; OpenAI-compatible Images and Chat routes.",
)


def error_response(error: HTTPError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={**(headers or {}), **error.headers})


@api.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and wrong methods never reach an endpoint; same body shape all the same.
    return error_response(http_error(exc))


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(api)
class Ingress:
    """Admission, fan-out to the stages, response assembly. Holds no model."""

    def __init__(self, llm, diffusion, settings: dict):
        self.settings = ServingSettings.model_validate(settings)
        self.llm, self.diffusion = llm, diffusion
        self.pipeline = ImagePipeline(llm, diffusion)
        self.headers = {SWITCH_HEADERS[stage]: str(self.settings.batch_invariant[stage]).lower() for stage in STAGES}
        self._served_models: dict[str, str] = {}

    # -- routes ---------------------------------------------------------------------------------

    @api.post("/v1/images/generations")
    async def images_generations(self, request: Request) -> JSONResponse:
        return await self._respond(self._images, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        return await self._respond(self._chat, request)

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        return await self._respond(self._models, request)

    @api.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        try:
            body = await self._health()
        except Exception as exc:  # health must answer even when something is broken
            return error_response(http_error(exc), self.headers)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503, headers=self.headers)

    async def _respond(self, handler, request: Request) -> JSONResponse:
        """Run one route; the only place a route's exception becomes an HTTP response."""
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                body = await handler(request)
        except Exception as exc:
            return error_response(http_error(exc), self.headers)
        return JSONResponse(body, headers=self.headers)

    # -- images ---------------------------------------------------------------------------------

    async def _images(self, request: Request) -> dict:
        req = parse_body(ImageGenerationRequest, await request.body())
        if req.model is not None:
            await self._check_model("diffusion", req.model)
        plan = admit_images(req, self.settings)
        results = await self.pipeline.run(plan)
        first = results[0].diffusion
        llm = results[0].llm or {}
        response = ImagesResponse(
            created=int(time.time()),
            data=[
                ImageData(
                    b64_json=base64.b64encode(r.diffusion["png"]).decode("ascii"),
                    revised_prompt=r.revised_prompt,
                    seed=r.diffusion["seed"],
                    sha256=r.diffusion["sha256"],
                    replica=r.diffusion.get("replica"),
                    batch_size=r.diffusion.get("batch_size"),
                )
                for r in results
            ],
            model=first.get("model", ""),
            size=f"{first['width']}x{first['height']}",
            invariance={
                "llm": StageInvariance(
                    batch_invariant=self.settings.batch_invariant["llm"],
                    kernel_backend=llm.get("kernel_backend"),
                    used=plan.enhance,
                ),
                "diffusion": StageInvariance(
                    batch_invariant=self.settings.batch_invariant["diffusion"],
                    kernel_backend=first.get("kernel_backend"),
                ),
            },
        )
        return response.model_dump()

    # -- chat -----------------------------------------------------------------------------------

    async def _chat(self, request: Request) -> dict:
        req = parse_body(ChatCompletionRequest, await request.body())
        if req.model is not None:
            await self._check_model("llm", req.model)
        params = admit_chat(req, self.settings)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        result = await self.llm.chat.remote(messages, params)
        logprobs = None
        if req.logprobs:
            # Token text is not returned by the stage; ids in vLLM's "token_id:<id>" form stand in for it.
            tops = result.get("top_logprobs") or [[] for _ in result["token_ids"]]
            logprobs = {
                "content": [
                    {
                        "token": f"token_id:{token}",
                        "logprob": logprob,
                        "bytes": None,
                        "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None} for t, lp in top],
                    }
                    for token, logprob, top in zip(result["token_ids"], result["logprobs"], tops)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": result.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result["text"]},
                    "finish_reason": result.get("finish_reason") or "stop",
                    "logprobs": logprobs,
                }
            ],
            "usage": result["usage"],
            "system_fingerprint": f"omniserve-llm-bi{int(self.settings.batch_invariant['llm'])}",
            # Extensions: the seed that reproduces this completion, and the stage's invariance state.
            "seed": params.seed,
            "token_ids": result["token_ids"],
            "invariance": {
                "llm": StageInvariance(
                    batch_invariant=self.settings.batch_invariant["llm"], kernel_backend=result.get("kernel_backend")
                ).model_dump()
            },
        }

    # -- models ---------------------------------------------------------------------------------

    async def _served_model(self, stage: str) -> str:
        if stage not in self._served_models:
            handle = self.llm if stage == "llm" else self.diffusion
            described = await asyncio.wait_for(handle.describe.remote(), self.settings.health_timeout_s)
            self._served_models[stage] = described["model"]
        return self._served_models[stage]

    async def _check_model(self, stage: str, model: str) -> None:
        served = await self._served_model(stage)
        if model != served and model not in self.settings.model_aliases[stage]:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; the {stage} model is {served!r}", param="model", code="model_not_found"
            )

    async def _models(self, request: Request) -> dict:
        created = int(time.time())
        data = []
        for stage in STAGES:
            data.append({"id": await self._served_model(stage), "object": "model", "created": created,
                         "owned_by": "omniserve", "stage": stage})
        return {"object": "list", "data": data}

    # -- health ---------------------------------------------------------------------------------

    async def _health(self) -> dict[str, Any]:
        described = await asyncio.gather(
            *(asyncio.wait_for(self._describe(stage), self.settings.health_timeout_s) for stage in STAGES),
            return_exceptions=True,
        )
        replicas = await asyncio.to_thread(self._replica_counts)
        stages: dict[str, Any] = {}
        for stage, info in zip(STAGES, described):
            switch = self.settings.batch_invariant[stage]
            if isinstance(info, BaseException):
                stages[stage] = {"state": "unavailable", "error": http_error(info).message, "batch_invariant": switch}
            else:
                # The replica's own view must match what the app passed it; a mismatch is a failure.
                agrees = info.get("batch_invariant") == switch
                kernels = info.get("kernels")  # the LLM reports one entry per vLLM worker, diffusion one report
                backend = info.get("kernel_backend") or (kernels.get("backend") if isinstance(kernels, dict) else None)
                stages[stage] = {
                    "state": "running" if agrees else "switch_mismatch",
                    "model": info.get("model"),
                    "batch_invariant": switch,
                    "kernel_backend": backend,
                    "kernels": kernels,
                    "describe": info,
                }
            stages[stage]["replicas"] = replicas.get(stage)
        ok = all(s["state"] == "running" for s in stages.values())
        return {
            "status": "ok" if ok else "degraded",
            "batch_invariant": dict(self.settings.batch_invariant),
            "stages": stages,
            "ingress": {"replicas": replicas.get("ingress")},
        }

    async def _describe(self, stage: str) -> dict:
        handle = self.llm if stage == "llm" else self.diffusion
        return await handle.describe.remote()

    def _replica_counts(self) -> dict[str, dict]:
        """Configured and running replicas per deployment, from Serve's status (config alone if unavailable)."""
        counts = {stage: {"configured": n} for stage, n in self.settings.configured_replicas.items()}
        try:
            app = serve.status().applications[serve.get_replica_context().app_name]
            for stage, name in self.settings.deployment_names.items():
                deployment = app.deployments.get(name)
                if deployment is not None:
                    states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                    status = str(getattr(deployment.status, "value", deployment.status))
                    counts[stage].update(running=states.get("RUNNING", 0), states=states, status=status)
        except Exception as exc:  # status is informative; health still answers from the config
            for stage in counts:
                counts[stage]["status_error"] = repr(exc)
        return counts
