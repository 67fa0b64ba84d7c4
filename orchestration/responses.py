"""HTTP response bodies built from the stages' typed results (contracts.results -> contracts.http)."""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from contracts.http import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ContentLogprob,
    ImageCompletedEvent,
    ImageData,
    ImagePartialEvent,
    ImagesResponse,
    ImageTokensDetails,
    ImageUsage,
    StageInvariance,
    TokenLogprob,
)
from contracts.invariance import Switches
from contracts.results import Completion, CompletionDelta, PartialImage, Provenance
from contracts.sampling import reported_quality

from .pipeline import ImagePlan, ImageResult
from .result_cache import exact


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def image_data(r: ImageResult, url: str | None = None) -> ImageData:
    """An image of a response: inline (b64_json), or `url` where the request asked for a link."""
    return ImageData(
        b64_json=None if url else _b64(r.delivered.data),
        url=url,
        revised_prompt=r.revised_prompt,
        seed=r.image.seed,
        sha256=r.delivered.sha256,
        replica=r.image.replica,
        batch_size=r.image.batch_size,
        steps_co_batched=r.image.steps_co_batched,
        steps_computed=r.image.steps_computed,
        cache=r.cache,
    )


def delivery(plan: ImagePlan) -> dict[str, Any]:
    """What a response says of how its images were made: their quality in OpenAI's terms (None: there is none, the
    request gave its steps) and their format."""
    params = plan.diffusion_params[0]
    return {
        "quality": reported_quality(params.quality, params.num_inference_steps),
        "output_format": plan.output.format,
    }


def event_delivery(plan: ImagePlan) -> dict[str, Any]:
    """`delivery` for a streamed event, whose schema requires a quality: "auto" where there is no OpenAI term."""
    made = delivery(plan)
    return {**made, "quality": made["quality"] or "auto"}


def image_event(
    plan: ImagePlan, kind: str, index: int, item: PartialImage | ImageResult
) -> ImagePartialEvent | ImageCompletedEvent:
    """One server-sent event of a streamed request (`kind`: "image_generation" or "image_edit") for image `index`.
    Previews are PNGs whatever the request's format (`output_format` says so); each image is its delivered file."""
    if isinstance(item, PartialImage):
        return ImagePartialEvent(
            type=f"{kind}.partial_image",
            quality=event_delivery(plan)["quality"],
            b64_json=_b64(item.png),
            created_at=int(time.time()),
            size=f"{item.width}x{item.height}",
            image_index=index,
            partial_image_index=item.index,
        )
    text, out = (item.rewrite.prompt_tokens, len(item.rewrite.token_ids)) if item.rewrite else (0, 0)
    usage = ImageUsage(
        input_tokens=text,
        input_tokens_details=ImageTokensDetails(text_tokens=text),
        output_tokens=out,
        total_tokens=text + out,
    )
    return ImageCompletedEvent(
        type=f"{kind}.completed",
        created_at=int(time.time()),
        size=f"{item.image.width}x{item.image.height}",
        image_index=index,
        usage=usage,
        **event_delivery(plan),
        **image_data(item).model_dump(),
    )


def scope(results: list[Provenance]) -> dict:
    """A stage's `verified` in a response: every result it gave was verified; else each reason, once."""
    if not results:
        return {}
    reasons = [reason for result in results for reason in result.scope_differences]
    by = [result.verified_by for result in results if result.verified_by]
    return {
        "verified": all(result.verified for result in results),
        "verified_by": list(dict.fromkeys(by)),
        "scope_differences": list(dict.fromkeys(reasons)),
    }


def http_caching(results: list[ImageResult]) -> dict[str, str]:
    """Headers that let HTTP caches help: where every image is exact (`result_cache.exact`), an ETag naming the images
    (their sha256s) and a year's freshness, since the same request can only ever get these bytes; else no-store."""
    if not all(exact(r.image) and exact(r.rewrite) for r in results):
        return {"Cache-Control": "no-store"}
    tag = hashlib.sha256(" ".join(r.delivered.sha256 for r in results).encode()).hexdigest()
    return {"ETag": f'"{tag}"', "Cache-Control": "public, max-age=31536000, immutable"}


def images_response(
    plan: ImagePlan, results: list[ImageResult], switches: Switches, links: list[str] | None = None
) -> ImagesResponse:
    """The images whole: inline, or as `links` (one per image, in order) where the request asked for URLs."""
    first = results[0]
    return ImagesResponse(
        created=int(time.time()),
        data=[image_data(r, links[i] if links else None) for i, r in enumerate(results)],
        model=first.image.model,
        size=f"{first.image.width}x{first.image.height}",
        **delivery(plan),
        invariance={
            "llm": StageInvariance(
                batch_invariant=switches.llm,
                kernel_backend=first.rewrite.kernel_backend if first.rewrite else None,
                used=plan.enhance,
                **scope([r.rewrite for r in results if r.rewrite]),
            ),
            "diffusion": StageInvariance(
                batch_invariant=switches.diffusion,
                kernel_backend=first.image.kernel_backend,
                parallel=first.image.parallel,
                **scope([r.image for r in results]),
            ),
        },
    )


def _token(token_id: int) -> str:
    # Token text is not returned by the stage; ids in vLLM's "token_id:<id>" form stand in for it.
    return f"token_id:{token_id}"


def _logprobs(result: Completion | CompletionDelta) -> ChoiceLogprobs:
    tops = result.top_logprobs or [[] for _ in result.token_ids]
    return ChoiceLogprobs(
        content=[
            ContentLogprob(
                token=_token(token),
                logprob=logprob,
                top_logprobs=[TokenLogprob(token=_token(t), logprob=lp) for t, lp in top],
            )
            for token, logprob, top in zip(result.token_ids, result.logprobs, tops, strict=False)
        ]
    )


async def chat_chunks(
    items: AsyncIterator[CompletionDelta | Completion],
    *,
    model: str,
    seed: int | None,
    with_logprobs: bool,
    include_usage: bool,
    batch_invariant: bool,
) -> AsyncGenerator[ChatCompletionChunk, None]:
    """A streamed completion's chunks, as OpenAI streams chat: the assistant's role first, then each delta's text (and
    token ids, logprobs), the finish reason on the last; with `include_usage`, a last chunk with the usage."""
    same = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"omniserve-llm-bi{int(batch_invariant)}",
        "seed": seed,
    }
    yield ChatCompletionChunk(**same, choices=[ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))])
    async for item in items:
        if isinstance(item, Completion):
            if include_usage:
                yield ChatCompletionChunk(**same, choices=[], usage=item.usage)
            return
        choice = ChunkChoice(
            index=0,
            delta=ChunkDelta(content=item.text),
            finish_reason=item.finish_reason,
            logprobs=_logprobs(item) if with_logprobs else None,
        )
        yield ChatCompletionChunk(**same, choices=[choice], token_ids=item.token_ids)


def chat_response(
    result: Completion, *, seed: int | None, with_logprobs: bool, batch_invariant: bool, cache: str | None = None
) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=result.model,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=result.text),
                finish_reason=result.finish_reason or "stop",
                logprobs=_logprobs(result) if with_logprobs else None,
            )
        ],
        usage=result.usage,
        system_fingerprint=f"omniserve-llm-bi{int(batch_invariant)}",
        seed=seed,
        token_ids=result.token_ids,
        lora=result.lora,
        cache=cache,
        invariance={
            "llm": StageInvariance(
                batch_invariant=batch_invariant, kernel_backend=result.kernel_backend, **scope([result])
            )
        },
    )
