"""Requests that share one scheduling step: how the start-up self-check (stages/llm/self_check.py) and the audit
(evidence/llm.py) co-batch a target with its neighbours on a started `LLMEngine`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from contracts.results import Generation

from .engine import to_generation


async def generate_co_batched(
    engine, requests: Sequence[tuple[list[int], Any]], settle_s: float = 0.1
) -> list[Generation]:
    """Run (prompt ids, vLLM SamplingParams) requests on a started `LLMEngine` so that they enter one step.

    The scheduler is paused while all of them are queued, in order, then resumed: their
    prefills share one step and their decodes run together.
    """
    llm = engine.async_llm
    await llm.pause_generation(mode="keep", clear_cache=False)
    queued = []
    try:
        for prompt_ids, sampling in requests:
            # add_request returns once the request is on its way to the engine core, so
            # arrival order is batch order and the resume below comes after all of them.
            queued.append(await _submit(llm, prompt_ids, sampling))
        # Structured-output requests wait for their grammar (compiled in the engine core,
        # off the scheduler); the pause gives it time so no request misses the first step.
        await asyncio.sleep(settle_s)
    finally:
        await llm.resume_generation()
    return list(await asyncio.gather(*(_collect(llm, q) for q in queued)))


async def _submit(llm, prompt_ids: list[int], sampling):
    from vllm.inputs import TokensPrompt

    return await llm.add_request(uuid.uuid4().hex, TokensPrompt(prompt_token_ids=prompt_ids), sampling)


async def _collect(llm, queue) -> Generation:
    final = None
    try:
        while final is None or not final.finished:
            final = queue.get_nowait() or await queue.get()
    except asyncio.CancelledError:
        await llm.abort(queue.request_id, internal=True)
        raise
    finally:
        queue.close()
    return to_generation(final)
