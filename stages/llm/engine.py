"""The engine's lifecycle: one vLLM `AsyncLLM`, started from an `LLMStageConfig`, generating from token ids.

Usable without Serve (the audit uses it). vLLM spawns processes, so in scripts create it under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from contracts import envs
from contracts.config import LLMStageConfig
from contracts.cpu import cpu_isa, hold_process_to_path
from contracts.invariance import resolve_batch_invariant
from contracts.results import Generation, StageDescription
from stages.kernels.vllm_cpu import VLLM_LIBRARY

from .lora import LlmAdapter, ServedAdapters, adapters_in, load_into
from .settings import engine_settings, resolve_model

if TYPE_CHECKING:
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

    from stages.scope import ReplicaScope

_NOT_STARTED = "the LLM engine is not started; await start() first"


async def finished(outputs: AsyncIterator[Generation]) -> Generation:
    """A request's last output (`LLMEngine.stream` to its end): the whole of it."""
    final = None
    async for output in outputs:
        final = output
    assert final is not None  # vLLM answers every request at least once
    return final


def to_generation(final) -> Generation:
    """Plain data from vLLM's final RequestOutput: text, token ids, float logprobs."""
    completion = final.outputs[0]
    token_ids = list(completion.token_ids)
    positions = completion.logprobs or []
    return Generation(
        text=completion.text,
        token_ids=token_ids,
        logprobs=[float(step[token].logprob) for token, step in zip(token_ids, positions, strict=False)],
        top_logprobs=[
            [(int(t), float(lp.logprob)) for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)]
            for step in positions
        ],
        finish_reason=completion.finish_reason,
        cached_tokens=final.num_cached_tokens or 0,
        scheduled_ts=getattr(final.metrics, "scheduled_ts", None),
    )


def _path_libraries() -> set[str | None]:
    """The vLLM kernel libraries a worker on this process's kernel path may have loaded (None: not x86)."""
    import platform

    return {VLLM_LIBRARY[cpu_isa()]} if platform.machine() in ("x86_64", "AMD64") else {None, "_C"}


def workers_without_kernels(reports: list[dict], device: str) -> tuple[list[dict], str]:
    """The worker reports that lack what invariance needs, and a hint at why."""
    if device == "cpu":
        missing = [
            r
            for r in reports
            if not (r["kernels"]["installed"] and r["gemm_dispatch_patched"] and r["vllm_library"] in _path_libraries())
        ]
        return missing, "is the omniserve package installed, so vLLM finds its plugin (and its kernel path)?"
    missing = [r for r in reports if not r["vllm_batch_invariant_mode"]]
    return missing, "vLLM's workers did not enter VLLM_BATCH_INVARIANT mode"


class LLMEngine:
    """One vLLM AsyncLLM engine, configured by an `LLMStageConfig` and the batch-invariance switch.

    `await engine.start()` before use: it starts vLLM (spawning its processes) and, when
    invariance is on, checks that every worker really installed the kernels.
    """

    def __init__(self, config: LLMStageConfig | Mapping[str, Any] | None = None):
        config = LLMStageConfig.model_validate(config or {})
        # An explicit value (the app's config) wins; None follows OMNI_LLM_BATCH_INVARIANT / VLLM_BATCH_INVARIANT.
        self.batch_invariant = resolve_batch_invariant("llm", override=config.batch_invariant)
        self.config = config.model_copy(update={"batch_invariant": self.batch_invariant})
        self.model = resolve_model(config.model)
        self.settings = engine_settings(self.config, self.model)
        self._engine: AsyncLLM | None = None
        self._tokenizer: TokenizerLike | None = None
        self.worker_reports: list[dict] = []
        self.adapters = ServedAdapters()  # the LoRA adapters it serves, once started (stages.llm.lora)
        self.startup_s: float | None = None
        self.scope: ReplicaScope | None = (
            None  # the stage's ReplicaScope (stages.scope), set once started; the audit's engines have none
        )

    @property
    def device(self) -> str:
        return self.config.device

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- lifecycle --

    async def start(self) -> LLMEngine:
        if self._engine is not None:
            return self
        if self.device == "cpu":
            hold_process_to_path()  # the engine's processes inherit the kernel path's limits for ATen, oneDNN, MKL
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if current_platform.device_type != self.device:
            raise ValueError(f"device={self.device!r} but vLLM runs on {current_platform.device_type!r} here")
        started = time.monotonic()
        with envs.overriding(self.settings.environment):
            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.settings.args))
        self._tokenizer = self._engine.get_tokenizer()
        self.worker_reports = list(await self._engine.collective_rpc("omniserve_invariance_report"))
        self.adapters = await load_into(self._engine, adapters_in(self.config.lora_dir))
        self.startup_s = round(time.monotonic() - started, 1)
        if self.batch_invariant:
            self._check_workers_installed_kernels()
        return self

    def _check_workers_installed_kernels(self) -> None:
        missing, hint = workers_without_kernels(self.worker_reports, self.device)
        if missing or not self.worker_reports:
            self.shutdown()
            raise RuntimeError(
                f"batch invariance is on but a vLLM worker did not install the kernels ({hint}): {missing}"
            )

    @property
    def kernels_installed(self) -> bool:
        """Every worker installed the kernels invariance needs (False with the switch off: none were asked for)."""
        return (
            self.batch_invariant
            and bool(self.worker_reports)
            and not workers_without_kernels(self.worker_reports, self.device)[0]
        )

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def check_health(self) -> None:
        """Raises when the engine cannot serve: not started, shut down, or its engine core died."""
        if self._engine is None:
            raise RuntimeError("the LLM engine is not running")
        if self._engine.errored:
            raise RuntimeError(f"the LLM engine failed: {self._engine.dead_error!r}")

    @property
    def async_llm(self):
        """The running vLLM AsyncLLM."""
        if self._engine is None:
            raise RuntimeError(_NOT_STARTED)
        return self._engine

    @property
    def tokenizer(self):
        if self._engine is None:
            raise RuntimeError(_NOT_STARTED)
        return self._tokenizer

    @property
    def running(self) -> bool:
        return self._engine is not None and not self._engine.errored

    @property
    def kernel_backend(self) -> str:
        if not self.batch_invariant:
            return "none"
        if self.device == "cuda":
            return "vllm-cuda"
        backends = {r["kernels"]["backend"] for r in self.worker_reports}
        return backends.pop() if len(backends) == 1 else "mixed" if backends else "none"

    def describe(self) -> StageDescription:
        import vllm

        return StageDescription(
            stage="llm",
            model=self.model.name,
            batch_invariant=self.batch_invariant,
            kernel_backend=self.kernel_backend,
            kernels=self.worker_reports,
            kernels_installed=self.kernels_installed,
            running=self.running,
            # Paths and engine arguments are for operators (describe() through a handle); /health leaves them out.
            details={
                "pid": os.getpid(),
                "model_path": self.model.path,
                "embedded": self.model.embedded,
                "device": self.device,
                "invariance": self.settings.invariance,
                "engine_args": {k: v for k, v in self.settings.args.items() if k != "model"},
                "vllm_version": vllm.__version__,
                "startup_s": self.startup_s,
                "loras": self.adapters.names(),  # what a chat request's `lora` may name
            },
        )

    async def stream(
        self, prompt_ids: list[int], sampling, adapter: LlmAdapter | None = None
    ) -> AsyncIterator[Generation]:
        """One request's (prompt token ids, vLLM SamplingParams, its LoRA adapter or None) output so far, each time vLLM
        has more (cumulative: every token until now; `finished` for the last). Closing the iterator early (a client
        gone) aborts the request in vLLM (its `generate` does on GeneratorExit)."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        lora = adapter.request() if adapter else None
        async for output in self.async_llm.generate(prompt, sampling, uuid.uuid4().hex, lora_request=lora):
            yield to_generation(output)
