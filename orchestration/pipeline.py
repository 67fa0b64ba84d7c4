"""The image pipeline: admission, then per image i the LLM stage, then the diffusion stage, each with seed s_i.

    admit_images(request, config) -> ImagePlan     no replica involved: every 4xx is decided here
    admit_edit(request, config) -> ImagePlan       the same, for an edit: its image admitted, its size the image's
    ImagePipeline.items(plan) -> (i, item)...      n images concurrently, so the diffusion stage co-batches: per
                                                   image a RenderJob (`contracts.jobs`) to the stage's one entry
                                                   point, its PartialImage previews (as many as the plan asks for:
                                                   none unless streamed) as they come, then its ImageResult; the
                                                   same for generations, edits and streams
    ImagePlan.results(items) -> [ImageResult]      the images alone, in order (a response written whole)
    RewriteCache                                   rewrites already made, by (prompt, seeded params): bounded LRU
    (orchestration.result_cache.ResultCache)       images already rendered, exact ones only: bounded LRU by bytes

Image i is a pure function of (prompt, parameters, s_i), with s_i = seed_for_image(seed, i): a request
with n=1 and seed=s_i reproduces it bit for bit, revised prompt included, streamed or not: each image's origin
(the client's prompt, the rewrite and its params) goes to the diffusion stage, which writes it into the PNG
(`contracts.provenance`). The stages admit what they are handed again, with the same functions (contracts.admission).
An image is sent again after an infrastructure failure only while none of its items has come: once a preview has
been sent, a failure ends the stream with an error event. An image whose replica stops under it (a scale-down, a
redeploy) is handed off (`RenderMoved`) and sent again from the step it had reached, previews included.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, cast

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from contracts.admission import admit_llm_params
from contracts.http import ChatCompletionRequest, ImageEditRequest, ImageGenerationRequest, requested_size
from contracts.images import admit_image, edit_size
from contracts.jobs import RenderJob, final
from contracts.provenance import ImageFile, ImageOrigin, ImageOutput, deliver
from contracts.results import Completion, CompletionDelta, PartialImage, RenderedImage, RenderMoved, RevisedPrompt
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams, seed_or_picked, seeds_for_request

from .config import AppConfig
from .result_cache import ResultCache, chat_key, image_key
from .result_cache import exact as is_exact
from .retries import Retrying


@dataclass(frozen=True)
class ImagePlan:
    """An admitted request: the prompt, whether to enhance it, each image's own params, what it streams."""

    prompt: str
    enhance: bool
    seed: int  # s_0: the request's seed, or the one the server picked (invariance off only)
    llm_params: list[LLMSamplingParams]  # per image (empty when enhance is off)
    diffusion_params: list[DiffusionSamplingParams]  # per image
    image: bytes | None = None  # an edit's image (None: a generation)
    partial_images: int = 0  # previews per image before it (a streamed request's; 0: the image alone)
    output: ImageOutput = ImageOutput()  # the file each image is delivered as (`contracts.provenance`)
    fresh: bool = False  # rendered whatever the result cache keeps (`Cache-Control: no-cache`), and kept anew

    @property
    def images(self) -> list[tuple[LLMSamplingParams | None, DiffusionSamplingParams]]:
        """Each image's (rewrite params, None when enhancement is off; diffusion params)."""
        llm = self.llm_params if self.enhance else [None] * len(self.diffusion_params)
        return list(zip(llm, self.diffusion_params, strict=True))

    async def results(self, items: AsyncIterator[tuple[int, PartialImage | ImageResult]]) -> list[ImageResult]:
        """This plan's images alone, in order: what a response written whole needs from `ImagePipeline.items`."""
        done: dict[int, ImageResult] = {}
        async for index, item in items:
            if isinstance(item, ImageResult):
                done[index] = item
        return [done[index] for index in range(len(self.diffusion_params))]


@dataclass(frozen=True)
class ImageResult:
    revised_prompt: str
    image: RenderedImage
    rewrite: RevisedPrompt | None  # None when enhancement was skipped
    cache: str | None = None  # the ingress's result cache: "hit", "miss"; None: no cache
    file: ImageFile | None = None  # the file delivered (`contracts.provenance`); None: the stage's PNG itself

    @property
    def delivered(self) -> ImageFile:
        return self.file or ImageFile("png", self.image.png, self.image.sha256)

    async def as_asked(self, output: ImageOutput) -> ImageResult:
        """This result with its file as `output` asks (transcoding off the event loop); the kept result stays the
        PNG, so one render serves every format."""
        if output.format == "png":
            return self
        return replace(self, file=await asyncio.to_thread(deliver, self.image.png, output))


def admit_images(request: ImageGenerationRequest, config: AppConfig) -> ImagePlan:
    """Apply the serving limits and the seed contract (as sent: a missing seed is refused under invariance)."""
    asked = request.diffusion_params(request.seed)
    seed = config.diffusion.admit(asked, batch_invariant=config.switches.diffusion)
    config.diffusion.check_request_work(request.count, asked)
    seeds = seeds_for_request(seed, request.count)
    return ImagePlan(
        prompt=request.prompt,
        enhance=request.enhance_prompt,
        seed=seed,
        llm_params=[config.llm.enhance_params(s) for s in seeds] if request.enhance_prompt else [],
        diffusion_params=[request.diffusion_params(s) for s in seeds],
        partial_images=(request.partial_images or 0) if request.stream else 0,
        output=request.output,
    )


def admit_edit(request: ImageEditRequest, config: AppConfig) -> ImagePlan:
    """An edit's plan: its image admitted, rendered at the image's size (a requested size must be it), then as above."""
    picture = admit_image(request.image)
    width, height = edit_size(picture, *requested_size(request.size))
    plan = admit_images(request.model_copy(update={"size": f"{width}x{height}"}), config)
    return replace(plan, image=request.image)


def admit_chat(request: ChatCompletionRequest, config: AppConfig) -> LLMSamplingParams:
    """The chat request's sampling params; a seedless sampled request is refused under LLM invariance."""
    params = admit_llm_params(request.llm_params(request.seed), batch_invariant=config.switches.llm)
    if params.seed is None and params.temperature != 0:  # greedy needs none
        params = LLMSamplingParams.from_params(params, seed=seed_or_picked(params.seed))
    return params


class RewriteCache:
    """The LLM stage's rewrites by (prompt, seeded sampling params), the least recently used dropped past `max_entries`.

    Exact when the LLM stage is batch-invariant: a rewrite is then a pure function of (model, system prompt,
    prompt, params), and the first two are fixed for the life of this ingress replica (a new config starts new
    replicas, with empty caches). It lives in the ingress, not the stage: a hit then costs no Ray call at all
    (on a CPU box the call itself costs a few ms of the ingress's and the replica's CPU), and its only cost is
    that each ingress replica keeps its own. A failed rewrite is never kept; two identical rewrites in flight at
    once both run (the second one is kept, the same bytes).
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], RevisedPrompt] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(prompt: str, params: LLMSamplingParams) -> tuple[str, str]:
        return prompt, params.model_dump_json()

    def get(self, prompt: str, params: LLMSamplingParams) -> RevisedPrompt | None:
        if not self.max_entries:
            return None
        key = self.key(prompt, params)
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        return found

    def put(self, prompt: str, params: LLMSamplingParams, rewrite: RevisedPrompt) -> None:
        if not self.max_entries:
            return
        self._entries[self.key(prompt, params)] = rewrite
        self._entries.move_to_end(self.key(prompt, params))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    @property
    def stats(self) -> dict[str, int]:
        return {
            "max_entries": self.max_entries,
            "entries": len(self._entries),
            "hits": self.hits,
            "misses": self.misses,
        }


class ImagePipeline:
    """Calls the stages through their DeploymentHandles; only contracts types cross."""

    def __init__(
        self,
        llm: DeploymentHandle,
        diffusion: DeploymentHandle,
        retrying: Retrying,
        rewrites: RewriteCache | None = None,
        images: ResultCache[ImageResult] | None = None,
    ):
        self.llm = llm
        self.diffusion = diffusion
        self.retrying = retrying
        self.rewrites = rewrites or RewriteCache(0)
        self.kept = images or ResultCache("image", 0)
        self.moved_mid_render = 0  # images a stopping replica handed off with their state (not before a step)

    async def rewrite(self, prompt: str, llm_params: LLMSamplingParams) -> RevisedPrompt:
        """The prompt's rewrite: kept from before, else from the LLM stage (and then kept)."""
        rewrite = self.rewrites.get(prompt, llm_params)
        if rewrite is None:
            rewrite = cast(
                RevisedPrompt,
                await self.retrying.call(
                    "the LLM stage's rewrite", lambda: self.llm.enhance.remote(prompt, llm_params)
                ),
            )
            self.rewrites.put(prompt, llm_params, rewrite)
        return rewrite

    async def origin(
        self, prompt: str, llm_params: LLMSamplingParams | None
    ) -> tuple[RevisedPrompt | None, ImageOrigin]:
        """The rewrite of one image's prompt (None when enhancement is off) and the origin its PNG records."""
        rewrite = None if llm_params is None else await self.rewrite(prompt, llm_params)
        return rewrite, ImageOrigin.of(prompt, rewrite)

    async def image(
        self, plan: ImagePlan, llm_params: LLMSamplingParams | None, params: DiffusionSamplingParams
    ) -> AsyncIterator[PartialImage | ImageResult]:
        """One image: its rewrite, then its RenderJob's previews from the diffusion stage, then its ImageResult; or, kept
        by the result cache from an earlier request, its ImageResult at once."""
        key = image_key(plan.prompt, llm_params, params, plan.image)
        if kept := self.kept.get(key, fresh=plan.fresh):
            yield await replace(kept, cache="hit").as_asked(plan.output)
            return
        cache = "miss" if self.kept.max_bytes else None
        rewrite, origin = await self.origin(plan.prompt, llm_params)
        prompt = rewrite.revised_prompt if rewrite else plan.prompt
        job = RenderJob(
            prompt=prompt, params=params, origin=origin, image=plan.image, partial_images=plan.partial_images
        )
        what = "a render" if plan.image is None else "an edit"

        def send() -> DeploymentResponseGenerator:  # a handle with stream=True answers with a generator
            return cast(DeploymentResponseGenerator, self.diffusion.options(stream=True).render.remote(job))

        async for item in self.retrying.stream(
            what,
            send,
            last=lambda item: isinstance(item, RenderedImage),
            moved=lambda item: isinstance(item, RenderMoved),
        ):
            if isinstance(item, RenderMoved):  # its replica stopped: sent again from where it was
                job = job.model_copy(update={"resume": item.checkpoint or job.resume})
                self.moved_mid_render += item.checkpoint is not None
            elif isinstance(item, PartialImage):
                yield item
            else:
                result = ImageResult(revised_prompt=prompt, image=item, rewrite=rewrite, cache=cache)
                exact = is_exact(item) and is_exact(rewrite)
                self.kept.put(key, result, made_by=item, size=len(item.png), exact=exact)
                yield await result.as_asked(plan.output)

    async def items(self, plan: ImagePlan) -> AsyncIterator[tuple[int, PartialImage | ImageResult]]:
        """(image index, preview or result) as they come, the n images rendered concurrently; the first failure
        ends the stream (raised after what came before it)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def one(index: int, llm_params: LLMSamplingParams | None, params: DiffusionSamplingParams) -> None:
            async for item in self.image(plan, llm_params, params):
                queue.put_nowait((index, item))

        work = asyncio.ensure_future(gather_or_cancel([one(i, *pair) for i, pair in enumerate(plan.images)]))
        work.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            work.result()
        finally:
            work.cancel()


async def gather_or_cancel(coroutines: list) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise that failure itself."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


class ChatPipeline:
    """A chat completion from the LLM stage's one chat call (a stream of pieces, then the completion), streamed or
    whole, and the ingress's result cache of whole ones."""

    def __init__(self, llm: DeploymentHandle, retrying: Retrying, completions: ResultCache[Completion] | None = None):
        self.llm = llm.options(stream=True)
        self.retrying = retrying
        self.kept = completions or ResultCache("chat", 0)

    def items(
        self, messages: Any, params: LLMSamplingParams, *, restart: bool = False
    ) -> AsyncIterator[CompletionDelta | Completion]:
        """The stage's items, sent again after an infrastructure failure while none has come (`restart`: whatever has
        come, for a caller that keeps only the completion)."""
        return self.retrying.stream(
            "a chat completion",
            lambda: cast(DeploymentResponseGenerator, self.llm.chat.remote(messages, params)),
            restart=restart,
            last=lambda item: isinstance(item, Completion),
        )

    async def completion(self, messages: Any, params: LLMSamplingParams, *, fresh: bool) -> tuple[Completion, str]:
        """The whole completion and where it came from: "hit" (kept; `fresh`: never) or "miss" (made, then kept)."""
        key = chat_key(messages, params)
        kept = self.kept.get(key, fresh=fresh)
        if kept is not None:
            return kept, "hit"
        made = await final(self.items(messages, params, restart=True), Completion)
        size = len(made.text.encode()) + 16 * len(made.token_ids)  # text, ids and logprobs
        self.kept.put(key, made, made_by=made, size=size, exact=is_exact(made))
        return made, "miss"
