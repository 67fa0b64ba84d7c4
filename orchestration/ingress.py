"""The ingress deployment: admission, fan-out to the stages, responses. Holds no model.

    POST /v1/images/generations   admit -> per image (LLM enhance -> diffusion generate) -> b64 PNGs
                                  (`stream: true`: server-sent events, previews then each image; `orchestration.api`)
    POST /v1/images/edits         the same, from an image (multipart): admit it -> ... -> diffusion edit -> b64 PNGs
    POST /v1/chat/completions     the LLM stage alone
    GET  /v1/models               the served models, OpenAI's list format
    GET  /health                  each stage running/degraded/down and why, switches, kernels, replica counts

The HTTP side (typed routes, error handlers, the switch headers) is `orchestration.api`, built per
replica by `__serve_build_asgi_app__` so that it can carry this replica's configuration.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from contracts.errors import ModelNotFoundError
from contracts.http import ChatCompletionRequest, ChatCompletionResponse, ImageGenerationRequest, ImagesResponse, ModelCard, ModelList
from contracts.http import STREAM_EVENT_KINDS, ImageCompletedEvent, ImageEditRequest, ImagePartialEvent
from contracts.invariance import STAGES

from .config import AppConfig
from .health import HealthProbe, HealthResponse
from .pipeline import ImagePipeline, ImagePlan, RewriteCache, admit_chat, admit_edit, admit_images
from .responses import chat_response, image_event, images_response
from .retries import Retrying


@serve.deployment
@serve.ingress()
class Ingress:
    """Admission, fan-out to the stages, response assembly. `config` arrives with both switches resolved."""

    def __init__(self, llm, diffusion, config: AppConfig):
        self.config = config
        self.handles = {"llm": llm, "diffusion": diffusion}
        self.retrying = Retrying(config.ingress.retry_attempts, config.ingress.retry_backoff_s)
        self.pipeline = ImagePipeline(llm, diffusion, self.retrying, RewriteCache(config.rewrite_cache_entries))
        self.probe = HealthProbe(self.handles, config)
        self._served_models: dict[str, str] = {}

    def __serve_build_asgi_app__(self):
        from .api import build_api

        return build_api(self)

    async def images(self, request: ImageGenerationRequest) -> ImagesResponse:
        """Generations, and edits (an ImageEditRequest): the same checks, seeds and stages, the image added."""
        plan = await self.plan(request)
        results = await self.pipeline.run(plan)
        return images_response(plan, results, self.config.switches)

    async def image_events(self, request: ImageGenerationRequest) -> AsyncIterator[ImagePartialEvent | ImageCompletedEvent]:
        """A streamed generation or edit: admitted now (a bad request raises before anything is sent), then its events."""
        plan = await self.plan(request)
        kind = STREAM_EVENT_KINDS["edit" if isinstance(request, ImageEditRequest) else "generation"]
        return (image_event(kind, index, item) async for index, item in self.pipeline.stream(plan, request.partial_images or 0))

    async def plan(self, request: ImageGenerationRequest) -> ImagePlan:
        """The admitted plan of a generation or edit (every 4xx decided here)."""
        if request.model is not None:
            await self.check_model("diffusion", request.model)
        return admit_edit(request, self.config) if isinstance(request, ImageEditRequest) else admit_images(request, self.config)

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        if request.model is not None:
            await self.check_model("llm", request.model)
        params = admit_chat(request, self.config)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        result = await self.retrying.call("a chat completion", lambda: self.handles["llm"].chat.remote(messages, params))
        return chat_response(result, seed=params.seed, with_logprobs=bool(request.logprobs),
                             batch_invariant=self.config.switches["llm"])

    async def models(self) -> ModelList:
        created = int(time.time())
        return ModelList(data=[ModelCard(id=await self.served_model(stage), created=created, stage=stage) for stage in STAGES])

    async def health(self) -> HealthResponse:
        report = await self.probe.report()
        report.ingress["retried_calls"] = self.retrying.retried  # stage calls sent again after an infrastructure failure
        report.ingress["rewrite_cache"] = self.pipeline.rewrites.stats  # this replica's (each ingress replica keeps its own)
        return report

    async def served_model(self, stage: str) -> str:
        if stage not in self._served_models:
            self._served_models[stage] = (await self.probe.describe(stage)).model
        return self._served_models[stage]

    async def check_model(self, stage: str, model: str) -> None:
        served = await self.served_model(stage)
        aliases = [alias for alias in (getattr(self.config, stage).model, stage) if alias]
        if model != served and model not in aliases:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; the {stage} model is {served!r}", param="model", code="model_not_found"
            )

    @property
    def switch_headers(self) -> dict[str, Any]:
        return {f"X-Omni-Batch-Invariant-{label}": str(self.config.switches[stage]).lower()
                for stage, label in (("llm", "LLM"), ("diffusion", "Diffusion"))}
