"""The ingress deployment: admission, fan-out to the stages, responses. Holds no model.

    POST /v1/images/generations   admit -> per image (LLM enhance -> diffusion render of a RenderJob) -> b64 PNGs
                                  (`stream: true`: server-sent events, previews then each image; `orchestration.api`)
    POST /v1/images/edits         the same, from an image (multipart): admit it -> ... the job carries the image
    POST /v1/chat/completions     the LLM stage alone
    GET  /v1/images/{id}          a file a request with `response_format: "url"` linked to (the ImageStore's)
    POST /v1/videos               (an app with `video`) admit -> a video job (VideoJobs): LLM enhance -> video stage
    GET  /v1/videos/{id}[/content], DELETE /v1/videos/{id}    the job, its MP4, its end
    GET  /v1/models               the served models, OpenAI's list format
    GET  /v1/loras                the LoRA adapters a request's `lora` may name (an extension)
    GET  /health                  each stage running/degraded/down and why, switches, kernels, replica counts

The HTTP side (typed routes, error handlers, the switch headers) is `orchestration.api`, built per
replica by `__serve_build_asgi_app__` so that it can carry this replica's configuration.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle

from contracts.errors import ModelNotFoundError
from contracts.http import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ImageEditRequest,
    ImageGenerationRequest,
    LoraCard,
    LoraList,
    ModelCard,
    ModelList,
)
from contracts.invariance import STAGES, Stage
from stages import replica_id

from .api import build_api
from .config import AppConfig
from .drain import Drain
from .health import HealthProbe, HealthResponse
from .image_store import ImageLinks
from .openapi import ServedDocument
from .pipeline import ChatPipeline, ImagePipeline, ImagePlan, RewriteCache, admit_chat, admit_edit, admit_images
from .responses import chat_chunks, chat_response
from .result_cache import ResultCache
from .retries import Retrying
from .video_jobs import VideoFront

#: An image request's items as they come: (image index, PartialImage or ImageResult).
ImageItems = AsyncIterator[tuple[int, Any]]


@serve.deployment
@serve.ingress()
class Ingress:
    """Admission, fan-out to the stages, response assembly. `config` arrives with both switches resolved."""

    def __init__(
        self,
        llm: DeploymentHandle,
        diffusion: DeploymentHandle,
        config: AppConfig,
        files: DeploymentHandle,
        videos: DeploymentHandle | None = None,
    ):
        self.config = config
        # The Videos API's side here (orchestration.video_jobs); None: the app serves no videos.
        self.videos = VideoFront(videos, config) if videos is not None else None
        # A model card's `created` (OpenAI: when the model was made, which a served directory does not say): when this
        # replica started, so a card is the same on every call (a per-call time once differed between list and get).
        self.started = int(time.time())
        self.links = ImageLinks(files, config.ingress.image_url_ttl_s)
        self.handles: dict[Stage, DeploymentHandle] = {"llm": llm, "diffusion": diffusion}
        self.retrying = Retrying(config.ingress.retry_window_s, config.ingress.retry_backoff_s)
        self.pipeline = ImagePipeline(
            llm,
            diffusion,
            self.retrying,
            RewriteCache(config.rewrite_cache_entries),
            ResultCache("image", config.ingress.result_cache_mib << 20),
        )
        self.chats = ChatPipeline(llm, self.retrying, ResultCache("chat", config.ingress.result_cache_mib << 20))
        described = {**cast(dict[str, DeploymentHandle], self.handles), **({"video": videos} if videos else {})}
        self.probe = HealthProbe(described, config)
        self._served_models: dict[str, str] = {}
        self.document = ServedDocument(config)
        self.drain = Drain(replica_id())
        self.drain.start()

    def __serve_build_asgi_app__(self):

        return build_api(self)

    async def images(self, request: ImageGenerationRequest, *, fresh: bool = False) -> tuple[ImagePlan, ImageItems]:
        """Generations, edits (an ImageEditRequest) and streams alike: the admitted plan (a bad request raises here,
        before anything is sent) and its items as they come, each image's previews (streamed requests only) then its
        ImageResult (`fresh`: rendered, kept or not). The response writer (`orchestration.api`) sends them."""
        plan = replace(await self.plan(request), fresh=fresh)
        return plan, self.pipeline.items(plan)

    async def plan(self, request: ImageGenerationRequest) -> ImagePlan:
        """The admitted plan of a generation or edit (every 4xx decided here)."""
        if request.model is not None:
            await self.check_model("diffusion", request.model)
        return (
            admit_edit(request, self.config)
            if isinstance(request, ImageEditRequest)
            else admit_images(request, self.config)
        )

    async def chat(
        self, request: ChatCompletionRequest, *, fresh: bool = False
    ) -> ChatCompletionResponse | AsyncGenerator[ChatCompletionChunk, None]:
        """A chat completion, admitted first (a bad request raises here, before anything is sent), from the LLM
        stage's one chat call (a stream of pieces, then the completion): streamed (`stream: true`) as chunks, sent
        again after an infrastructure failure only while nothing has come (`Retrying.stream`), never from the result
        cache (a stream shows a completion being made); else the completion whole, from the result cache when it
        keeps it, sent again after a failure whatever had come (nothing of it had reached the client)."""
        if request.model is not None:
            await self.check_model("llm", request.model)
        params = admit_chat(request, self.config)
        if request.stream:
            return chat_chunks(
                self.chats.items(request.messages, params),
                model=await self.served_model("llm"),
                seed=params.seed,
                with_logprobs=bool(request.logprobs),
                include_usage=bool(request.stream_options and request.stream_options.include_usage),
                batch_invariant=self.config.switches.llm,
            )
        completion, cache = await self.chats.completion(request.messages, params, fresh=fresh)
        return chat_response(
            completion,
            seed=params.seed,
            with_logprobs=bool(request.logprobs),
            batch_invariant=self.config.switches.llm,
            cache=cache if self.chats.kept.max_bytes else None,
        )

    async def models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=await self.served_model(stage), created=self.started, stage=stage) for stage in STAGES]
        )

    async def model(self, model: str) -> ModelCard:
        """One served model by its id (`GET /v1/models/{id}`, OpenAI's retrieve); another: 404 naming `model`."""
        for card in (await self.models()).data:
            if card.id == model:
                return card
        raise ModelNotFoundError(f"model {model!r} is not served here", param="model", code="model_not_found")

    async def loras(self) -> LoraList:
        """The LoRA adapters a diffusion replica can load (replicas of one deployment share its adapters directory)."""
        names = (await self.probe.describe("diffusion")).details.get("loras", [])
        return LoraList(data=[LoraCard(id=name) for name in names])

    async def health(self) -> HealthResponse:
        report = await self.probe.report()
        report.ingress["retried_calls"] = self.retrying.retried  # calls sent again after an infrastructure failure
        report.ingress["handed_off"] = {"calls": self.retrying.moved, "from_a_step": self.pipeline.moved_mid_render}
        if self.videos is not None:  # the jobs: how many, rendering, their bytes, renders started again
            report.ingress["video_jobs"] = await self.videos.jobs.stats.remote()
        # This replica's caches (each ingress replica keeps its own).
        report.ingress["rewrite_cache"] = self.pipeline.rewrites.stats
        report.ingress["result_cache"] = {"image": self.pipeline.kept.stats, "chat": self.chats.kept.stats}
        return report

    async def openapi(self, generated: dict[str, Any]) -> dict[str, Any]:
        return await self.document.served(generated, self.probe)

    async def served_model(self, stage: Stage) -> str:
        if stage not in self._served_models:
            self._served_models[stage] = (await self.probe.describe(stage)).model
        return self._served_models[stage]

    async def check_model(self, stage: Stage, model: str) -> None:
        served = await self.served_model(stage)
        aliases = [alias for alias in (getattr(self.config, stage).model, stage) if alias]
        if model != served and model not in aliases:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; the {stage} model is {served!r}",
                param="model",
                code="model_not_found",
            )

    @property
    def switch_headers(self) -> dict[str, Any]:
        labels: tuple[tuple[Stage, str], ...] = (("llm", "LLM"), ("diffusion", "Diffusion"))
        return {
            f"X-Omni-Batch-Invariant-{label}": str(self.config.switches.of(stage)).lower() for stage, label in labels
        }
