"""Which model an LLM stage loads, and the vLLM settings its config and switch turn into.

`engine_settings(config, model)` is where the batch-invariance switch becomes engine arguments and the
environment of the engine's processes; everything else about the engine is read from the config whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contracts.config import LLMStageConfig
from stages.embedded import DEFAULT_MODELS, EMBEDDED_MODELS
from stages.embedded.llm import REWRITER_PATH, ensure_tiny_llama
from stages.kernels import vllm_cpu

from .lora import adapter_dirs

EMBEDDED = "embedded"
#: The KV cache reservation when the config gives neither kv_cache_gib nor gpu_memory_utilization.
DEFAULT_KV_CACHE_GIB = 0.25

#: Engine arguments that CPU batch invariance fixes, with the reason (measured: the ablations in docs/invariance/llm.md).
#: Prefix caching stays on: cache hits measured bit-identical. On CUDA, vLLM's own mode handles compilation.
INVARIANT_CPU_ENGINE_ARGS: dict[str, tuple[Any, str]] = {
    "enforce_eager": (True, "vLLM's compiled CPU graph changes the target's logprobs under co-batching, kernels on"),
}


@dataclass(frozen=True)
class ModelChoice:
    path: str  # what vLLM loads: a local directory or a hub id
    name: str  # what results report
    embedded: bool


def resolve_model(model: str | None) -> ModelChoice:
    """None or "embedded" -> the default embedded LLM; "embedded:<name>" -> that registry entry; else as given."""
    if model is None or model == EMBEDDED:
        model = DEFAULT_MODELS["llm"]
    if not model.startswith(EMBEDDED + ":"):
        return ModelChoice(model, model, False)
    entry = EMBEDDED_MODELS.get(model)
    if entry is None or entry.stage != "llm":
        served = [m.id for m in EMBEDDED_MODELS.values() if m.stage == "llm"]
        raise ValueError(f"unknown embedded LLM {model!r}; expected one of {served}")
    if entry.trained:  # committed with its training record, not built
        return ModelChoice(str(REWRITER_PATH), entry.id, True)
    return ModelChoice(str(ensure_tiny_llama(entry.recipe)), entry.id, True)


@dataclass(frozen=True)
class EngineSettings:
    args: dict[str, Any]  # AsyncEngineArgs keyword arguments
    environment: dict[str, str]  # set while the engine's processes are spawned
    invariance: dict[str, Any] = field(default_factory=dict)  # what the switch changed, for describe()


def engine_settings(config: LLMStageConfig, model: ModelChoice) -> EngineSettings:
    """The AsyncEngineArgs keyword arguments and spawn environment for one engine (switch already resolved)."""
    if config.batch_invariant is None:
        raise ValueError("resolve the LLM switch first: config.batch_invariant must be True or False here")
    args = _base_args(config, model)
    environment = _thread_environment(config)
    invariance: dict[str, Any] = {"batch_invariant": config.batch_invariant}
    if config.batch_invariant and config.device == "cpu":
        args.update(_invariant_cpu_args(config.engine_args))
        invariance["engine_args"] = {name: value for name, (value, _) in INVARIANT_CPU_ENGINE_ARGS.items()}
    environment.update(_switch_environment(config.device, config.batch_invariant))
    invariance["environment"] = dict(environment)
    args.update(_lora_args(config))
    args.update(config.engine_args)
    if config.device == "cpu" and args.get("distributed_executor_backend") == "uni":
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # see _base_args
    return EngineSettings(args, environment, invariance)


def _lora_args(config: LLMStageConfig) -> dict[str, Any]:
    """vLLM's LoRA path, where the config names an adapters directory: every adapter kept loaded on the CPU side (none
    dropped and silently read again)."""

    if config.lora_dir is None:
        return {}
    count = len(adapter_dirs(config.lora_dir))
    return {
        "enable_lora": True,
        "max_loras": config.max_loras,
        "max_lora_rank": config.max_lora_rank,
        "max_cpu_loras": max(config.max_loras, count),
    }


def _base_args(config: LLMStageConfig, model: ModelChoice) -> dict[str, Any]:

    args: dict[str, Any] = {
        "model": model.path,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        # Every prompt that fits the model fits one step, so prefill never has to be split.
        "max_num_batched_tokens": max(config.max_model_len, 2048),
        "seed": 0,
        "disable_log_stats": True,
        # Eager: a tiny model starts in ~25 s on CPU; compiling would add minutes on 2 cores.
        "enforce_eager": True,
        # Lets the stage ask each worker what it installed (collective_rpc).
        "worker_extension_cls": f"{vllm_cpu.__name__}.InvarianceReportExtension",
    }
    if config.device == "cpu":
        # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when a seeded
        # request's prefill is chunked, so whole prefills only, switch on or off.
        args["enable_chunked_prefill"] = False
        if not _parallel(config.engine_args):
            # One worker, inside the engine-core process: with a worker process of its own, the worker and the
            # engine core each busy-wait (sched_yield, 1 s after every message) on their shared-memory queues,
            # two spinning processes that on a small CPU box take the cores the model and the diffusion stage need.
            # vLLM's CPU platform turns "uni" back into "mp" unless V1 multiprocessing is off; AsyncLLM itself
            # still runs its engine core in a process of its own (the switch only reaches the executor choice).
            args["distributed_executor_backend"] = "uni"
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    else:
        # On CPU this is the KV cache reservation; vLLM's default utilization (0.92) fails on small boxes.
        args["kv_cache_memory_bytes"] = int((config.kv_cache_gib or DEFAULT_KV_CACHE_GIB) * (1 << 30))
    return args


def _parallel(engine_args: dict[str, Any]) -> bool:
    """Whether the engine arguments ask for more than one worker (which needs worker processes)."""
    return any(
        int(engine_args.get(name) or 1) > 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    )


def _thread_environment(config: LLMStageConfig) -> dict[str, str]:
    if config.torch_threads is None:
        return {}
    # vLLM's CPU worker sizes its OpenMP pool from OMP_NUM_THREADS when it imports torch,
    # unless its own core binding ("auto": all cores but one reserved) rewrites it first.
    environment = {"OMP_NUM_THREADS": str(config.torch_threads)}
    if config.device == "cpu":
        environment["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return environment


def _invariant_cpu_args(overrides: dict[str, Any]) -> dict[str, Any]:
    for name, (value, _why) in INVARIANT_CPU_ENGINE_ARGS.items():
        if name in overrides and overrides[name] != value:
            raise ValueError(f"{name}={overrides[name]!r} conflicts with batch invariance, which needs {value!r}")
    return {name: value for name, (value, _why) in INVARIANT_CPU_ENGINE_ARGS.items()}


def _switch_environment(device: str, batch_invariant: bool) -> dict[str, str]:

    if batch_invariant and device == "cuda":
        # vLLM's own mode: its workers call init_batch_invariance(), and its attention
        # selector skips backends without batch-invariance support.
        return {"VLLM_BATCH_INVARIANT": "1"}
    # CPU on: our kernels inside vLLM's own processes (stages.kernels.vllm_cpu, a vLLM plugin); off: not.
    environment = vllm_cpu.engine_environment(batch_invariant)
    # vLLM's own mode stays off otherwise, whatever the process inherited: on CPU it is CUDA's (Triton kernels), and a
    # global VLLM_BATCH_INVARIANT=1 (the documented switch for both stages) made the CPU engine core's first forward
    # fail (measured, vLLM 0.32: "TypeError: 'function' object is not subscriptable", the engine dead).
    environment["VLLM_BATCH_INVARIANT"] = "0"
    return environment
