"""The AR-LLM stage: a vLLM v1 async engine that rewrites the user's prompt for the diffusion stage.

Read top to bottom:
1. `resolve_model`: a configured path or hub id, else the embedded tiny Llama (built locally).
2. `engine_settings`: the engine arguments and the environment of the engine's processes; this is
   where the batch-invariance switch turns into vLLM settings.
3. `LLMEngine`: owns one `AsyncLLM`; `enhance` (prompt -> revised prompt) and `chat` (the
   OpenAI-style subset). Usable without Serve (the audit uses it; create it under
   `if __name__ == "__main__":` in scripts, since vLLM spawns processes).
4. `LLMStage`: the Ray Serve deployment around it.

Requests arrive as plain data (`LLMSamplingParams` or a mapping of its fields); everything
returned is plain data: token ids, float logprobs, text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from ray import serve

from contracts import LLMSamplingParams, resolve_batch_invariant, validate_seed_contract
from contracts.errors import InvalidRequestError

EMBEDDED = "embedded"
DEFAULT_SYSTEM_PROMPT = (
    "You rewrite image prompts. Keep the user's subject, add a visual style and lighting, "
    "and answer with the rewritten prompt only, on one line."
)
ROLES = ("system", "user", "assistant")
DEFAULT_KV_CACHE_GIB = 0.25
# Spare tokens past the longest grammar completion: the end-of-sequence token.
_GRAMMAR_SLACK = 2
# The process-wide environment is shared by every engine started from one process.
_SPAWN_LOCK = threading.Lock()


class LLMRequestError(InvalidRequestError):
    """Client input the stage refuses (a 400); `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param=param)

    def __reduce__(self):
        # Survives pickling across the Ray boundary with its field intact.
        return (type(self), (self.message, self.param))


# --- 1. the model ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelChoice:
    path: str  # what vLLM loads: a local directory or a hub id
    name: str  # what results report
    embedded: bool


def resolve_model(model: str | None) -> ModelChoice:
    """None or "embedded" -> the tiny default; "embedded:<name>" -> another embedded spec; else as given."""
    if model is None or model == EMBEDDED or model.startswith(EMBEDDED + ":"):
        from stages.embedded.llm import TINY, ensure_tiny_llama

        spec = TINY.name if model in (None, EMBEDDED) else model.split(":", 1)[1]
        return ModelChoice(str(ensure_tiny_llama(spec)), f"{EMBEDDED}:{spec}", True)
    return ModelChoice(model, model, False)


# --- 2. engine settings ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSettings:
    args: dict[str, Any]  # AsyncEngineArgs keyword arguments
    environment: dict[str, str]  # set while the engine's processes are spawned
    invariance: dict[str, Any] = field(default_factory=dict)  # what the switch changed, for describe()


#: Engine arguments that CPU batch invariance fixes, with the reason (measured: docs/llm_invariance_notes.md).
#: Prefix caching stays on: cache hits measured bit-identical. On CUDA, vLLM's own mode handles compilation.
INVARIANT_CPU_ENGINE_ARGS: dict[str, tuple[Any, str]] = {
    "enforce_eager": (True, "vLLM's compiled CPU graph changes the target's logprobs under co-batching, kernels on"),
}


def engine_settings(
    choice: ModelChoice,
    *,
    batch_invariant: bool,
    device: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_gib: float | None,
    gpu_memory_utilization: float | None,
    torch_threads: int | None,
    overrides: Mapping[str, Any],
) -> EngineSettings:
    """The AsyncEngineArgs keyword arguments and spawn environment for one engine."""
    from stages.kernels import vllm_cpu

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if kv_cache_gib is not None and gpu_memory_utilization is not None:
        raise ValueError("give kv_cache_gib or gpu_memory_utilization, not both")
    args: dict[str, Any] = {
        "model": choice.path,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        # Every prompt that fits the model fits one step, so prefill never has to be split.
        "max_num_batched_tokens": max(max_model_len, 2048),
        "seed": 0,
        "disable_log_stats": True,
        # Eager: a tiny model starts in ~25 s on CPU; compiling would add minutes on 2 cores.
        "enforce_eager": True,
        # Lets the stage ask each worker what it installed (collective_rpc).
        "worker_extension_cls": f"{vllm_cpu.__name__}.InvarianceReportExtension",
    }
    if device == "cpu":
        # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when a seeded
        # request's prefill is chunked, so whole prefills only, switch on or off.
        args["enable_chunked_prefill"] = False
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        # On CPU this is the KV cache reservation; vLLM's default utilization (0.92) fails on small boxes.
        args["kv_cache_memory_bytes"] = int((kv_cache_gib or DEFAULT_KV_CACHE_GIB) * (1 << 30))
    environment: dict[str, str] = {}
    if torch_threads is not None:
        # vLLM's CPU worker sizes its OpenMP pool from OMP_NUM_THREADS when it imports torch,
        # unless its own core binding ("auto": all cores but one reserved) rewrites it first.
        environment["OMP_NUM_THREADS"] = str(torch_threads)
        if device == "cpu":
            environment["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    invariance: dict[str, Any] = {"batch_invariant": batch_invariant}
    if batch_invariant:
        if device == "cpu":
            for name, (value, _why) in INVARIANT_CPU_ENGINE_ARGS.items():
                if name in overrides and overrides[name] != value:
                    raise ValueError(f"{name}={overrides[name]!r} conflicts with batch invariance, which needs {value!r}")
                args[name] = value
            invariance["engine_args"] = {name: value for name, (value, _) in INVARIANT_CPU_ENGINE_ARGS.items()}
            # Our kernels inside vLLM's own processes (stages.kernels.vllm_cpu, a vLLM plugin).
            environment.update(vllm_cpu.engine_environment(True))
        else:
            # vLLM's own mode: its workers call init_batch_invariance(), and its attention
            # selector skips backends without batch-invariance support.
            environment["VLLM_BATCH_INVARIANT"] = "1"
    else:
        environment.update(vllm_cpu.engine_environment(False))
        if device == "cuda":
            environment["VLLM_BATCH_INVARIANT"] = "0"
    invariance["environment"] = dict(environment)
    args.update(overrides)
    return EngineSettings(args, environment, invariance)


@contextlib.contextmanager
def spawn_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in os.environ while an engine spawns its processes, then restore exactly."""
    with _SPAWN_LOCK:
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


# --- 3. the engine -----------------------------------------------------------------------


def _params(params: LLMSamplingParams | Mapping[str, Any] | None) -> LLMSamplingParams:
    try:
        return LLMSamplingParams.from_params(params)
    except ValidationError as err:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())) or None
        raise LLMRequestError(f"invalid sampling params: {err}", param=where) from None
    except TypeError as err:
        raise LLMRequestError(str(err), param="params") from None


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise LLMRequestError("messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise LLMRequestError(f"messages[{i}] must be an object with role and content", f"messages.{i}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise LLMRequestError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", f"messages.{i}.role")
        if not isinstance(content, str):
            raise LLMRequestError(f"messages[{i}].content must be a string", f"messages.{i}.content")
        clean.append({"role": role, "content": content})
    return clean


def _result(final) -> dict:
    """Plain data from vLLM's final RequestOutput: text, token ids, float logprobs."""
    completion = final.outputs[0]
    token_ids = list(completion.token_ids)
    positions = completion.logprobs or []
    return {
        "text": completion.text,
        "token_ids": token_ids,
        "logprobs": [float(step[token].logprob) for token, step in zip(token_ids, positions)],
        "top_logprobs": [
            [[int(t), float(lp.logprob)] for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)]
            for step in positions
        ],
        "finish_reason": completion.finish_reason,
        "cached_tokens": final.num_cached_tokens or 0,
        # When the engine first scheduled it (set with log stats on); equal values = same step.
        "scheduled_ts": getattr(final.metrics, "scheduled_ts", None),
    }


class LLMEngine:
    """One vLLM AsyncLLM engine, configured by the batch-invariance switch.

    `await engine.start()` before use: it starts vLLM (spawning its processes) and, when
    invariance is on, checks that every worker really installed the kernels.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        batch_invariant: bool | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int = 1024,
        max_num_seqs: int = 8,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        torch_threads: int | None = None,
        **engine_overrides: Any,
    ):
        # An explicit value (the app's config) wins; None follows OMNI_LLM_BATCH_INVARIANT.
        self.batch_invariant = resolve_batch_invariant("llm", override=batch_invariant)
        self.device = device
        self.system_prompt = system_prompt
        self.model = resolve_model(model)
        self.settings = engine_settings(
            self.model,
            batch_invariant=self.batch_invariant,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            torch_threads=torch_threads,
            overrides=engine_overrides,
        )
        self.max_model_len = max_model_len
        self._engine = None
        self._tokenizer = None
        self.worker_reports: list[dict] = []
        self.startup_s: float | None = None

    # -- lifecycle --

    async def start(self) -> LLMEngine:
        if self._engine is not None:
            return self
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if current_platform.device_type != self.device:
            raise ValueError(f"device={self.device!r} but vLLM runs on {current_platform.device_type!r} here")
        started = time.monotonic()
        with spawn_environment(self.settings.environment):
            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.settings.args))
        self._tokenizer = self._engine.get_tokenizer()
        self.worker_reports = list(await self._engine.collective_rpc("omniserve_invariance_report"))
        self.startup_s = round(time.monotonic() - started, 1)
        if self.batch_invariant:
            if self.device == "cpu":
                missing = [r for r in self.worker_reports if not (r["kernels"]["installed"] and r["gemm_dispatch_patched"])]
                hint = "is the omniserve package installed, so vLLM finds its plugin?"
            else:
                missing = [r for r in self.worker_reports if not r["vllm_batch_invariant_mode"]]
                hint = "vLLM's workers did not enter VLLM_BATCH_INVARIANT mode"
            if missing or not self.worker_reports:
                self.shutdown()
                raise RuntimeError(f"batch invariance is on but a vLLM worker did not install the kernels ({hint}): {missing}")
        if self.model.embedded:
            self._grammar_max_tokens = self._longest_grammar_completion() + _GRAMMAR_SLACK
        return self

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def check_health(self) -> None:
        if self._engine is None:
            raise RuntimeError("the LLM engine is not running")
        if self._engine.errored:
            raise RuntimeError(f"the LLM engine failed: {self._engine.dead_error}")

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def kernel_backend(self) -> str:
        if not self.batch_invariant:
            return "none"
        if self.device == "cuda":
            return "vllm-cuda"
        backends = {r["kernels"]["backend"] for r in self.worker_reports}
        return backends.pop() if len(backends) == 1 else "mixed"

    def describe(self) -> dict:
        import vllm

        return {
            "model": self.model.name,
            "model_path": self.model.path,
            "embedded": self.model.embedded,
            "batch_invariant": self.batch_invariant,
            "device": self.device,
            "kernel_backend": self.kernel_backend,
            "kernels": self.worker_reports,
            "invariance": self.settings.invariance,
            "engine_args": {k: v for k, v in self.settings.args.items() if k != "model"},
            "vllm_version": vllm.__version__,
            "startup_s": self.startup_s,
            "running": self._engine is not None and not self._engine.errored,
        }

    # -- requests --

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        template = getattr(self._tokenizer, "chat_template", None)
        if not template:
            raise LLMRequestError(f"model {self.model.name} has no chat template", "messages")
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_enhancement(self, prompt: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": prompt}]
        if getattr(self._tokenizer, "chat_template", None):
            return self.encode_chat(messages)
        return list(self._tokenizer.encode(f"{self.system_prompt}\n\n{prompt}\n"))

    def enhancement_params(self, params: LLMSamplingParams) -> tuple[LLMSamplingParams, dict[str, Any]]:
        """The params an enhancement really runs with, and vLLM extras (the style grammar)."""
        if not self.model.embedded:
            return params, {}
        from vllm.sampling_params import StructuredOutputsParams

        from stages.embedded.llm import STYLE_GRAMMAR

        # The grammar must be able to finish: enough tokens, no stop strings or forced length.
        params = LLMSamplingParams.from_params(
            params, max_tokens=max(params.max_tokens, self._grammar_max_tokens), min_tokens=0, stop=[]
        )
        return params, {"structured_outputs": StructuredOutputsParams(grammar=STYLE_GRAMMAR)}

    def vllm_params(self, params: LLMSamplingParams, prompt_len: int, *, field: str, **extra: Any):
        if prompt_len + params.max_tokens > self.max_model_len:
            raise LLMRequestError(
                f"{field} is {prompt_len} tokens; with max_tokens={params.max_tokens} that exceeds "
                f"the model's context of {self.max_model_len} tokens",
                field,
            )
        # The sampled token's logprob is always returned: it is part of the provenance.
        logprobs = params.logprobs if params.logprobs is not None else 0
        return LLMSamplingParams.from_params(params, logprobs=logprobs).to_vllm(**extra)

    def admit(self, params: Any) -> LLMSamplingParams:
        if self._engine is None:
            raise RuntimeError("the LLM engine is not started; await start() first")
        params = _params(params)
        validate_seed_contract(params, batch_invariant=self.batch_invariant)
        return params

    async def enhance(self, prompt: str, params: LLMSamplingParams | Mapping[str, Any] | None = None) -> dict:
        """Rewrite `prompt` for the diffusion stage; with provenance (token ids, logprobs)."""
        params = self.admit(params)
        if not isinstance(prompt, str) or not prompt.strip():
            raise LLMRequestError("prompt must be a non-empty string", "prompt")
        prompt_ids = self.encode_enhancement(prompt)
        run_params, extra = self.enhancement_params(params)
        result = await self._generate(prompt_ids, self.vllm_params(run_params, len(prompt_ids), field="prompt", **extra))
        completion = result["text"].strip()
        if self.model.embedded:
            # The grammar yields "<style>, <lighting>[, <mood>]"; the user's subject leads.
            revised = f"{prompt.strip().rstrip(',.;')}, {completion}"
        else:
            revised = completion or prompt.strip()
        return {
            "revised_prompt": revised,
            "prompt": prompt,
            "completion": result["text"],
            "token_ids": result["token_ids"],
            "logprobs": result["logprobs"],
            "top_logprobs": result["top_logprobs"] if params.logprobs else None,
            "finish_reason": result["finish_reason"],
            "prompt_tokens": len(prompt_ids),
            "seed": params.seed,
            "params": run_params.model_dump(),
            "structured_output": self.model.embedded,
            "batch_invariant": self.batch_invariant,
            "kernel_backend": self.kernel_backend,
            "model": self.model.name,
        }

    async def chat(self, messages: Any, params: LLMSamplingParams | Mapping[str, Any] | None = None) -> dict:
        """One chat completion (messages in, assistant text out) through the model's chat template."""
        params = self.admit(params)
        prompt_ids = self.encode_chat(_messages(messages))
        result = await self._generate(prompt_ids, self.vllm_params(params, len(prompt_ids), field="messages"))
        completion_tokens = len(result["token_ids"])
        return {
            **{k: v for k, v in result.items() if k not in ("cached_tokens", "scheduled_ts")},
            "top_logprobs": result["top_logprobs"] if params.logprobs else None,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "seed": params.seed,
            "batch_invariant": self.batch_invariant,
            "kernel_backend": self.kernel_backend,
            "model": self.model.name,
        }

    async def generate_co_batched(self, requests: Sequence[tuple[list[int], Any]], settle_s: float = 0.1) -> list[dict]:
        """Run (prompt ids, vLLM SamplingParams) requests so that they enter the same scheduling step.

        The scheduler is paused while all of them are queued, in order, then resumed: their
        prefills share one step and their decodes run together. For the audit and tests.
        """
        engine = self._engine
        await engine.pause_generation(mode="keep", clear_cache=False)
        queued = []
        try:
            for prompt_ids, sampling in requests:
                # add_request returns once the request is on its way to the engine core, so
                # arrival order is batch order and the resume below comes after all of them.
                queued.append(await self._submit(prompt_ids, sampling))
            # Structured-output requests wait for their grammar (compiled in the engine core,
            # off the scheduler); the pause gives it time so no request misses the first step.
            await asyncio.sleep(settle_s)
        finally:
            await engine.resume_generation()
        return list(await asyncio.gather(*(self._collect(q) for q in queued)))

    async def _submit(self, prompt_ids: list[int], sampling):
        from vllm.inputs import TokensPrompt

        return await self._engine.add_request(uuid.uuid4().hex, TokensPrompt(prompt_token_ids=prompt_ids), sampling)

    async def _collect(self, queue) -> dict:
        final = None
        try:
            while final is None or not final.finished:
                final = queue.get_nowait() or await queue.get()
        except asyncio.CancelledError:
            await self._engine.abort(queue.request_id, internal=True)
            raise
        finally:
            queue.close()
        return _result(final)

    async def _generate(self, prompt_ids: list[int], sampling) -> dict:
        from vllm.inputs import TokensPrompt

        final = None
        request_id = uuid.uuid4().hex
        async for output in self._engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id):
            final = output
        return _result(final)

    def _longest_grammar_completion(self) -> int:
        from itertools import product

        from stages.embedded.llm import LIGHTING, MOODS, STYLES

        # In bytes: the grammar accepts any tokenization of its strings, down to one byte per token.
        tails = ("", *(f", {mood}" for mood in MOODS))
        return max(len(f"{s}, {l}{t}".encode()) for s, l, t in product(STYLES, LIGHTING, tails))


# --- 4. the Serve deployment ---------------------------------------------------------------


@serve.deployment(max_ongoing_requests=32, health_check_period_s=10, health_check_timeout_s=30)
class LLMStage:
    """The LLM stage replica: one vLLM engine, its switch decided once at start-up."""

    # Async so start-up can check, before serving, that vLLM's workers installed the kernels.
    async def __init__(  # type: ignore[misc]
        self,
        model: str | None = None,
        *,
        batch_invariant: bool | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int = 1024,
        max_num_seqs: int = 8,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        torch_threads: int | None = None,
        **engine_overrides: Any,
    ):
        self.engine = LLMEngine(
            model,
            batch_invariant=batch_invariant,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            system_prompt=system_prompt,
            torch_threads=torch_threads,
            **engine_overrides,
        )
        await self.engine.start()

    async def enhance(self, prompt: str, params: LLMSamplingParams | dict | None = None) -> dict:
        return await self.engine.enhance(prompt, params)

    async def chat(self, messages: list[dict], params: LLMSamplingParams | dict | None = None) -> dict:
        return await self.engine.chat(messages, params)

    async def describe(self) -> dict:
        return self.engine.describe()

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
