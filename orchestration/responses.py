"""HTTP response bodies built from the stages' typed results (contracts.results -> contracts.http)."""

from __future__ import annotations

import base64
import time
import uuid

from contracts.http import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ContentLogprob,
    ImageData,
    ImagesResponse,
    StageInvariance,
    TokenLogprob,
)
from contracts.results import Completion

from .pipeline import ImagePlan, ImageResult


def images_response(plan: ImagePlan, results: list[ImageResult], switches: dict[str, bool]) -> ImagesResponse:
    first = results[0]
    return ImagesResponse(
        created=int(time.time()),
        data=[
            ImageData(
                b64_json=base64.b64encode(r.image.png).decode("ascii"),
                revised_prompt=r.revised_prompt,
                seed=r.image.seed,
                sha256=r.image.sha256,
                replica=r.image.replica,
                batch_size=r.image.batch_size,
                steps_co_batched=r.image.steps_co_batched,
            )
            for r in results
        ],
        model=first.image.model,
        size=f"{first.image.width}x{first.image.height}",
        invariance={
            "llm": StageInvariance(
                batch_invariant=switches["llm"],
                kernel_backend=first.rewrite.kernel_backend if first.rewrite else None,
                used=plan.enhance,
            ),
            "diffusion": StageInvariance(batch_invariant=switches["diffusion"], kernel_backend=first.image.kernel_backend),
        },
    )


def _token(token_id: int) -> str:
    # Token text is not returned by the stage; ids in vLLM's "token_id:<id>" form stand in for it.
    return f"token_id:{token_id}"


def _logprobs(result: Completion) -> ChoiceLogprobs:
    tops = result.top_logprobs or [[] for _ in result.token_ids]
    return ChoiceLogprobs(content=[
        ContentLogprob(
            token=_token(token),
            logprob=logprob,
            top_logprobs=[TokenLogprob(token=_token(t), logprob=lp) for t, lp in top],
        )
        for token, logprob, top in zip(result.token_ids, result.logprobs, tops)
    ])


def chat_response(result: Completion, *, seed: int | None, with_logprobs: bool, batch_invariant: bool) -> ChatCompletionResponse:
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
        invariance={"llm": StageInvariance(batch_invariant=batch_invariant, kernel_backend=result.kernel_backend)},
    )
