"""The Ray Serve deployment: one engine per replica, its switch decided once at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ray import serve

from contracts.config import LLMStageConfig
from contracts.results import Completion, RevisedPrompt, StageDescription
from contracts.sampling import LLMSamplingParams
from stages import replica_id

from .engine import LLMEngine
from .requests import LLMRequests


# Serve's options (replicas, health checks, ongoing requests) come from the config: `config.deployment_options()`.
@serve.deployment
class LLMStage:
    """The LLM stage replica: what the ingress calls (`enhance`, `chat`, `describe`)."""

    # Async so start-up can check, before serving, that vLLM's workers installed the kernels.
    async def __init__(self, config: LLMStageConfig | Mapping[str, Any] | None = None):  # type: ignore[misc]
        self.engine = LLMEngine(config)
        await self.engine.start()
        self.requests = LLMRequests(self.engine)

    async def enhance(self, prompt: str, params: LLMSamplingParams | Mapping[str, Any] | None = None) -> RevisedPrompt:
        return await self.requests.enhance(prompt, params)

    async def chat(self, messages: list[Any], params: LLMSamplingParams | Mapping[str, Any] | None = None) -> Completion:
        return await self.requests.chat(messages, params)

    async def describe(self) -> StageDescription:
        described = self.engine.describe()
        details = {**described.details, "rewrites": asdict(self.requests.stats)}
        return described.model_copy(update={"replica": replica_id(), "details": details})

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`: a dead engine core fails it, and Serve replaces the replica."""
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
