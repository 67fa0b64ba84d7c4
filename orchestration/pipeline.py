"""The image pipeline: admission, then per image i the LLM stage, then the diffusion stage, each with seed s_i.

    admit_images(request, settings) -> ImagePlan      no replica involved: every 4xx is decided here
    ImagePipeline.run(plan) -> [ImageResult]          n images concurrently, so the diffusion stage co-batches

Image i is a pure function of (prompt, parameters, s_i), with s_i = seed_for_image(seed, i): a request
with n=1 and seed=s_i reproduces it bit for bit, revised prompt included.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from contracts.errors import InvalidRequestError
from contracts.http import ChatCompletionRequest, ImageGenerationRequest
from contracts.invariance import validate_seed_contract
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams
from contracts.seeds import pick_seed, seeds_for_request

from .config import ServingSettings


@dataclass(frozen=True)
class ImagePlan:
    """An admitted request: the prompt, whether to enhance it, and each image's own params."""

    prompt: str
    enhance: bool
    seed: int  # s_0: the request's seed, or the one the server picked (invariance off only)
    seed_picked_by_server: bool
    llm_params: list[LLMSamplingParams]  # per image (empty when enhance is off)
    diffusion_params: list[DiffusionSamplingParams]  # per image


@dataclass(frozen=True)
class ImageResult:
    revised_prompt: str
    diffusion: dict  # the diffusion stage's result (png, sha256, seed, replica, batch_size, ...)
    llm: dict | None  # the LLM stage's result, None when enhancement was skipped


def admit_images(request: ImageGenerationRequest, settings: ServingSettings) -> ImagePlan:
    """Apply the serving limits and the seed contract before any replica is called."""
    steps = request.num_inference_steps
    if steps is not None and steps > settings.max_inference_steps:
        raise InvalidRequestError(
            f"num_inference_steps must be <= {settings.max_inference_steps} on this server, got {steps}",
            param="num_inference_steps", code="out_of_range",
        )
    size = request.dimensions
    if size is not None and size[0] * size[1] > settings.max_pixels:
        raise InvalidRequestError(
            f"size {request.size} exceeds this server's limit of {settings.max_pixels} pixels",
            param="size", code="out_of_range",
        )
    # The contract is checked on the request as sent: a missing seed is refused under invariance.
    validate_seed_contract(request.diffusion_params(request.seed), batch_invariant=settings.batch_invariant["diffusion"])
    seed = request.seed if request.seed is not None else pick_seed()
    seeds = seeds_for_request(seed, request.count)
    llm_params = (
        [LLMSamplingParams.model_validate({**settings.enhance, "seed": s}) for s in seeds] if request.enhance_prompt else []
    )
    return ImagePlan(
        prompt=request.prompt,
        enhance=request.enhance_prompt,
        seed=seed,
        seed_picked_by_server=request.seed is None,
        llm_params=llm_params,
        diffusion_params=[request.diffusion_params(s) for s in seeds],
    )


def admit_chat(request: ChatCompletionRequest, settings: ServingSettings) -> LLMSamplingParams:
    """The chat request's sampling params; a seedless sampled request is refused under LLM invariance."""
    params = request.llm_params(request.seed)
    validate_seed_contract(params, batch_invariant=settings.batch_invariant["llm"])
    if params.seed is None and params.temperature != 0:
        # Invariance off: pick one and report it, so the completion can be reproduced.
        params = LLMSamplingParams.from_params(params, seed=pick_seed())
    return params


class ImagePipeline:
    """Calls the stages through their DeploymentHandles; only contracts types and plain data cross."""

    def __init__(self, llm, diffusion):
        self.llm = llm
        self.diffusion = diffusion

    async def image(self, prompt: str, llm_params: LLMSamplingParams | None, params: DiffusionSamplingParams) -> ImageResult:
        enhanced = None
        if llm_params is not None:
            enhanced = await self.llm.enhance.remote(prompt, llm_params)
            prompt = enhanced["revised_prompt"]
        rendered = await self.diffusion.generate.remote(prompt, params)
        return ImageResult(revised_prompt=prompt, diffusion=rendered, llm=enhanced)

    async def run(self, plan: ImagePlan) -> list[ImageResult]:
        llm = plan.llm_params if plan.enhance else [None] * len(plan.diffusion_params)
        return await gather_or_cancel(
            [self.image(plan.prompt, llm_params, params) for llm_params, params in zip(llm, plan.diffusion_params)]
        )


async def gather_or_cancel(coroutines: list) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise that failure itself."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
