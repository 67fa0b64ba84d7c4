"""The engine's lifecycle: one vLLM `AsyncLLM`, started from an `LLMStageConfig`, generating from token ids.

Usable without Serve (the audit uses it). vLLM spawns processes, so in scripts create it under
`if __name__ == "__main__":`.

The stage's two requests over a started engine (`LLMRequests`): `enhance` (prompt -> RevisedPrompt) and `chat`
(-> Completion). Input is admitted with `contracts.admission`, the same functions the ingress uses, so a stage called
without the ingress refuses bad input with the same message and code (an InvalidRequestError naming the field, or a
SeedContractError); what vLLM itself refuses (building SamplingParams, or its request validation) becomes an
InvalidRequestError naming the field where vLLM's error tells it (`refused_by_vllm`). How a prompt is enhanced
depends on the model: a real model rewrites it freely (`FreeRewrite`); the embedded one picks a style through a
grammar (`stages.embedded.llm.StyleEnhancement`).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from contracts import envs
from contracts.admission import admit_llm_params, admit_messages, admit_prompt
from contracts.config import LLMStageConfig
from contracts.cpu import cpu_isa, hold_process_to_path
from contracts.errors import InvalidRequestError
from contracts.invariance import resolve_batch_invariant
from contracts.results import Completion, CompletionDelta, Generation, RevisedPrompt, StageDescription, Usage
from contracts.sampling import LLMSamplingParams, LoraChoice
from stages.embedded import EMBEDDED_MODELS
from stages.embedded.llm import StyleEnhancement
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


#: vLLM names its client's and engine core's IPC socket files in VLLM_RPC_BASE_PATH (/tmp by default) and leaves them
#: there when an engine stops (one run of the test suite left 120 in /tmp). Unless the variable is set (by the user, or
#: inherited), a process's engines put them in a directory of the process's own, removed when it exits. One directory
#: for the process's life, not one per engine: vLLM may cache its variables once a process has run an engine core, and
#: a cached path must stay valid.
_sockets: tempfile.TemporaryDirectory | None = None


def keep_sockets_in_a_directory_of_this_process() -> None:
    global _sockets
    if _sockets is None and not envs.is_set("VLLM_RPC_BASE_PATH"):
        _sockets = tempfile.TemporaryDirectory(prefix="omniserve-vllm-", ignore_cleanup_errors=True)
        envs.assign("VLLM_RPC_BASE_PATH", _sockets.name)


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
        keep_sockets_in_a_directory_of_this_process()
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


# The stage's two requests over a started engine.

DEFAULT_SYSTEM_PROMPT = (
    "You rewrite image prompts. Keep the user's subject, add a visual style and lighting, "
    "and answer with the rewritten prompt only, on one line."
)


@contextmanager
def refused_by_vllm(field: str, *, kinds: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """vLLM's own refusal of a request (VLLMClientError, or one of `kinds`) -> InvalidRequestError naming the field.

    The field is vLLM's `parameter`, else the sampling field its message starts with ("stop cannot contain an
    empty string."), else `field` for a refusal of the prompt itself ("The decoder prompt (length 2000) is longer...").
    """
    from vllm.exceptions import VLLMClientError

    refusals: tuple[type[BaseException], ...] = (VLLMClientError, *kinds)
    try:
        yield
    except InvalidRequestError:
        raise
    except refusals as err:
        message = str(err.args[0]) if err.args else type(err).__name__  # without vLLM's echo of the value
        named = getattr(err, "parameter", None) or message.split(" ", 1)[0].strip(".,:`'")
        param = (
            named
            if named in LLMSamplingParams.model_fields
            else field
            if message.startswith("The decoder prompt")
            else None
        )
        raise InvalidRequestError(f"refused by vLLM: {message}", param=param, code="invalid_value") from None


class EnhancementPolicy(Protocol):
    structured_output: bool
    system_prompt: str  # the instruction when the config gives none

    def sampling(self, params: LLMSamplingParams) -> tuple[LLMSamplingParams, dict[str, Any]]:
        """The params an enhancement really runs with, and extra vLLM SamplingParams fields."""

    def compose(self, prompt: str, completion: str) -> str:
        """The revised prompt from the user's prompt and the model's (stripped) completion."""


class FreeRewrite:
    """A real model's enhancement: its own rewrite; the prompt itself when it wrote nothing."""

    structured_output = False
    system_prompt = DEFAULT_SYSTEM_PROMPT

    def sampling(self, params: LLMSamplingParams) -> tuple[LLMSamplingParams, dict[str, Any]]:
        return params, {}

    def compose(self, prompt: str, completion: str) -> str:
        return completion or prompt.strip()


class TrainedRewrite(FreeRewrite):
    """The embedded rewriter's enhancement (`training.rewriter`): trained to answer a prompt sent alone
    with its rewrite, so no instruction is sent (it was never trained on one) and no grammar holds it."""

    system_prompt = ""


@dataclass
class EnhanceStats:
    """Counters of this replica's rewrites, for describe(): where the pipeline's LLM time goes."""

    rewrites: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Seconds rewrites spent in the engine (queued + computed), summed: over a wall-clock window, the mean
    # number of rewrites in the engine at once (at most max_num_seqs of them run in one step).
    engine_s: float = 0.0

    def add(self, prompt_tokens: int, completion_tokens: int, engine_s: float) -> None:
        self.rewrites += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.engine_s += engine_s


class LLMRequests:
    """Encodes, admits and samples the stage's requests on one engine."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # How the model enhances a prompt: the trained embedded rewriter's rule, the embedded style grammar, or a free
        # rewrite (any other model).
        entry = EMBEDDED_MODELS.get(engine.model.name)
        embedded = StyleEnhancement(engine.tokenizer) if engine.model.embedded else FreeRewrite()
        self.policy: EnhancementPolicy = TrainedRewrite() if entry is not None and entry.trained else embedded
        self.system_prompt = engine.config.system_prompt or self.policy.system_prompt
        self.stats = EnhanceStats()

    # -- encoding --

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {self.engine.model.name} has no chat template", param="messages")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def encode_enhancement(self, prompt: str) -> list[int]:
        instruction = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = [*instruction, {"role": "user", "content": prompt}]
        if getattr(self.engine.tokenizer, "chat_template", None):
            return self.encode_chat(messages)
        return list(self.engine.tokenizer.encode(f"{self.system_prompt}\n\n{prompt}\n"))

    # -- sampling --

    def sampling(self, params: LLMSamplingParams, prompt_len: int, *, field: str, **extra: Any):
        """vLLM's SamplingParams for a prompt of `prompt_len` tokens; refused when it cannot fit the context."""
        if prompt_len + params.max_tokens > self.engine.max_model_len:
            raise InvalidRequestError(
                f"{field} is {prompt_len} tokens; with max_tokens={params.max_tokens} that exceeds "
                f"the model's context of {self.engine.max_model_len} tokens",
                param=field,
            )
        # The sampled token's logprob is always returned: it is part of the provenance.
        logprobs = params.logprobs if params.logprobs is not None else 0
        with refused_by_vllm(field, kinds=(ValueError, TypeError)):
            return LLMSamplingParams.from_params(params, logprobs=logprobs).to_vllm(**extra)

    async def generate(self, prompt_ids: list[int], sampling, *, field: str, adapter: LlmAdapter | None = None):
        with refused_by_vllm(field):  # its request validation; a failure while generating stays the server's
            return await finished(self.engine.stream(prompt_ids, sampling, adapter))

    def enhancement(self, prompt: str, params: LLMSamplingParams) -> tuple[list[int], LLMSamplingParams, Any]:
        """(prompt ids, the params it really runs with, vLLM SamplingParams) of one enhancement."""
        prompt_ids = self.encode_enhancement(prompt)
        run_params, extra = self.policy.sampling(params)
        return prompt_ids, run_params, self.sampling(run_params, len(prompt_ids), field="prompt", **extra)

    def admit(self, params: Any) -> LLMSamplingParams:
        return admit_llm_params(params, batch_invariant=self.engine.batch_invariant)

    def prompt_budget(self, params: LLMSamplingParams) -> int:
        """Tokens a client's prompt may take in a rewrite run with `params`: the context less the rewrite's own template
        and its completion (what `sampling` refuses past), for the ingress's OpenAPI document."""
        run_params, _ = self.policy.sampling(params)
        return self.engine.max_model_len - len(self.encode_enhancement("")) - run_params.max_tokens

    # -- the requests --

    async def enhance(self, prompt: str, params: LLMSamplingParams | Mapping[str, Any] | None = None) -> RevisedPrompt:
        """Rewrite `prompt` for the diffusion stage; with provenance (token ids, logprobs)."""
        params = self.admit(params)
        prompt = admit_prompt(prompt)
        prompt_ids, run_params, sampling = self.enhancement(prompt, params)
        started = time.perf_counter()
        adapter = self.engine.adapters.of(run_params)  # unknown: 404 before any work
        result = await self.generate(prompt_ids, sampling, field="prompt", adapter=adapter)
        self.stats.add(len(prompt_ids), len(result.token_ids), time.perf_counter() - started)
        return RevisedPrompt(
            revised_prompt=self.policy.compose(prompt, result.text.strip()),
            prompt=prompt,
            completion=result.text,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            top_logprobs=result.top_logprobs if params.logprobs else None,
            finish_reason=result.finish_reason,
            prompt_tokens=len(prompt_ids),
            seed=params.seed,
            params=run_params,
            structured_output=self.policy.structured_output,
            **self.provenance(),
        )

    async def chat(
        self, messages: Any, params: LLMSamplingParams | Mapping[str, Any] | None = None
    ) -> AsyncIterator[CompletionDelta | Completion]:
        """One chat completion (messages in, assistant text out, through the model's chat template) as it is made:
        each new piece (tokens, text, logprobs) as vLLM has it, then the whole Completion (`contracts.jobs.final`
        takes it alone). Its pieces concatenated are the whole one's; closing the stream early aborts it in vLLM."""
        params, prompt_ids, sampling, adapter = self.chat_request(messages, params)
        result, shown = None, Generation(text="", token_ids=[], logprobs=[], top_logprobs=[], finish_reason=None)
        with refused_by_vllm("messages"):  # its request validation (see `generate`)
            async for result in self.engine.stream(prompt_ids, sampling, adapter):
                done = len(shown.token_ids)
                yield CompletionDelta(
                    text=result.text[len(shown.text) :],
                    token_ids=result.token_ids[done:],
                    logprobs=result.logprobs[done:],
                    top_logprobs=result.top_logprobs[done:] if params.logprobs else None,
                    finish_reason=result.finish_reason,
                )
                shown = result
        assert result is not None  # vLLM answers every request at least once
        yield self.completion(result, params, prompt_ids, adapter)

    def chat_request(self, messages: Any, params: Any) -> tuple[LLMSamplingParams, list[int], Any, LlmAdapter | None]:
        """(admitted params, prompt ids through the chat template, vLLM SamplingParams, the adapter or None)."""
        params = self.admit(params)
        admitted = admit_messages(messages)
        # Role and content only: what the chat template has always been given.
        prompt_ids = self.encode_chat([{"role": m.role, "content": m.content} for m in admitted])
        adapter = self.engine.adapters.of(params)  # unknown: 404 before any work
        return params, prompt_ids, self.sampling(params, len(prompt_ids), field="messages"), adapter

    def completion(
        self, result: Generation, params: LLMSamplingParams, prompt_ids: list[int], adapter: LlmAdapter | None
    ) -> Completion:
        completion_tokens = len(result.token_ids)
        return Completion(
            text=result.text,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            top_logprobs=result.top_logprobs if params.logprobs else None,
            finish_reason=result.finish_reason,
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt_ids) + completion_tokens,
            ),
            seed=params.seed,
            lora=LoraChoice(name=adapter.name, sha256=adapter.sha256) if adapter else None,
            **self.provenance(),
        )

    def provenance(self) -> dict[str, Any]:
        engine = self.engine
        scope = engine.scope.provenance() if engine.scope is not None else {}  # the stage decides it at start-up
        return {
            "model": engine.model.name,
            "batch_invariant": engine.batch_invariant,
            "kernel_backend": engine.kernel_backend,
            **scope,
        }
