"""The Ray Serve deployment: one engine per replica, its switch decided once at start-up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, TypeVar

from ray import serve

from contracts.config import LLMStageConfig
from contracts.results import Completion, CompletionDelta, RevisedPrompt, StageDescription
from contracts.sampling import ChatMessage, LLMSamplingParams
from stages import replica_id
from stages.metrics import record, record_switch_state, timed_stage_call
from stages.scope import llm_configuration, llm_scope

from .engine import LLMEngine, LLMRequests
from .self_audit import leave_kernels_out_under_test_fault, llm_self_audit
from .self_check import llm_self_check

ResultT = TypeVar("ResultT", RevisedPrompt, Completion)


def tokens_counted(method: str, result: ResultT) -> ResultT:
    """`result`, its generated tokens added to `omniserve_llm_tokens_total`."""
    record("omniserve_llm_tokens_total", len(result.token_ids), method=method)
    return result


# Serve's options (replicas, health checks, ongoing requests) come from the config: `config.deployment_options()`.
@serve.deployment
class LLMStage:
    """The LLM stage replica: what the ingress calls (`enhance`, `chat`, `describe`)."""

    # Async so start-up can check, before serving, that vLLM's workers installed the kernels.
    async def __init__(self, config: LLMStageConfig | Mapping[str, Any] | None = None):  # type: ignore[misc]
        self.engine = LLMEngine(config)
        await self.engine.start()
        try:
            # With invariance on, the replica checks itself against the golden table first (no column: runs nothing).
            configuration = llm_configuration(self.engine)  # after start(): its workers report their threads
            self_check = await llm_self_check(self.engine, configuration) if self.engine.batch_invariant else None
            await leave_kernels_out_under_test_fault(self.engine)
            # Before traffic (Serve routes to a replica once its constructor returns): prove this configuration here.
            audit = await llm_self_audit(self.engine, configuration, replica=replica_id())
            # Strict and outside the verified scope: refuses to start.
            self.engine.scope = llm_scope(
                self.engine, self_check=self_check, configuration=configuration, self_audit=audit
            )
        except Exception:
            self.engine.shutdown()
            raise
        self.requests = LLMRequests(self.engine)
        self.in_flight = 0  # calls being served now (describe(): operators, and fault tests that kill a busy replica)
        record_switch_state("llm", self.engine.batch_invariant, self.engine.kernel_backend)

    async def enhance(self, prompt: str, params: LLMSamplingParams | Mapping[str, Any] | None = None) -> RevisedPrompt:
        with self._serving(), timed_stage_call("llm", "enhance"):
            return tokens_counted("enhance", await self.requests.enhance(prompt, params))

    async def chat(
        self, messages: list[ChatMessage], params: LLMSamplingParams | Mapping[str, Any] | None = None
    ) -> AsyncIterator[CompletionDelta | Completion]:
        """The stage's one chat call, streamed (`handle.options(stream=True)`): the completion's pieces, then the whole
        of it, for a streamed response and a whole one alike. A caller gone closes this generator, which aborts the
        request in vLLM."""
        with self._serving(), timed_stage_call("llm", "chat"):
            async for item in self.requests.chat(messages, params):
                yield tokens_counted("chat", item) if isinstance(item, Completion) else item

    @contextmanager
    def _serving(self):
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def describe(self) -> StageDescription:
        described = self.engine.describe()
        assert self.engine.scope is not None  # set in __init__, before the replica serves
        details = {
            **described.details,
            "rewrites": asdict(self.requests.stats),
            "in_flight": self.in_flight,  # calls being answered here
            "requests_in_engine": self.engine.async_llm.get_num_unfinished_requests(),  # vLLM's own count
            "context_tokens": self.engine.max_model_len,
            "rewrite_prompt_tokens": self.requests.prompt_budget(self.engine.config.enhance_params(0)),
            "self_audit": self.engine.scope.self_audit.model_dump() if self.engine.scope.self_audit else None,
        }
        return described.model_copy(
            update={"replica": replica_id(), "details": details, **self.engine.scope.provenance()}
        )

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`: a dead engine core fails it, and Serve replaces the replica."""
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
