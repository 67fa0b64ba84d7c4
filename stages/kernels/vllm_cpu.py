"""Batch-invariant vLLM on CPU, installed inside vLLM's own processes.

vLLM runs the model in worker processes it spawns itself, not in the Ray actor that owns the
engine, so kernels enabled in the actor never reach the model. vLLM loads every
`vllm.general_plugins` entry point in each process it starts; `register` below is ours
(pyproject: `omniserve-cpu-invariance`). It does nothing unless the LLM stage switched
invariance on for that engine, by putting `engine_environment(True)` into the environment
the engine processes inherit.

What it changes, and why:
- Linear layers. vLLM's CPU `LinearBase`/`ParallelLMHead` never call `aten::mm`:
  `dispatch_cpu_unquantized_gemm` binds each layer at load time to oneDNN (`onednn_mm`), to
  packed sgl GEMMs (AMX machines) or to zentorch, whose kernel choice follows the number of
  tokens in the step (measured: oneDNN computes one row differently from two or more when K
  is large), so a row's result depends on its neighbours. Under invariance each 2-D
  layer is bound to `F.linear` instead, which reaches `aten::mm`/`addmm`, where
  `stages.kernels` installs its fixed-order GEMM (enabled in the process that loads the model,
  on first use); it packs each weight once, as vLLM's oneDNN path does at load time. Other weights (MoE experts, quantized layers) keep vLLM's
  kernels and are not covered.
- vLLM's own CPU kernel library. vLLM picks `_C` (AVX-512 + bf16), `_C_AVX512` or `_C_AVX2` and its
  attention's instruction set from torch's CPU-feature probes, which read the hardware, not
  ATEN_CPU_CAPABILITY; so every vLLM process, switch on or off, sees those probes as the kernel path
  allows (`hold_vllm_to_path`), and an AVX-512 machine held to avx2 runs what an AVX2 machine runs
  (measured: without it, 0 of 8 of the LLM's golden outputs matched the avx2 column). vLLM has no
  library below AVX2, so on x86 the generic path runs `_C_AVX2` too.
- CPU attention split-KV. `VLLM_CPU_ATTN_SPLIT_KV` lets the attention scheduler cut a decode
  request's KV range into pieces sized from the whole step's workload, which changes the
  reduction order with the batch; it is turned off.
The engine arguments invariance needs (eager execution; whole prefills, which CPU engines
need anyway) are set by `stages.llm.settings`. Evidence for each: the ablations in docs/invariance/llm.md.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from contracts import envs
from contracts.cpu import cpu_isa

#: Set to "1" in the environment of an engine's processes to make them batch invariant.
SWITCH_ENV = "OMNISERVE_VLLM_CPU_INVARIANT"

_lock = threading.Lock()
_state: dict[str, Any] = {"patched": False, "rerouted": [], "kept": [], "kernels": None}


def engine_environment(batch_invariant: bool) -> dict[str, str]:
    """Environment variables an engine's processes need; the stage sets them while spawning."""
    if not batch_invariant:
        return {SWITCH_ENV: "0"}
    return {SWITCH_ENV: "1", "VLLM_CPU_ATTN_SPLIT_KV": "0"}


def switched_on(environ: Any = None) -> bool:
    return envs.read(SWITCH_ENV, environ)


def register() -> None:
    """The `vllm.general_plugins` entry point: runs in every vLLM process, at most once each."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # CUDA engines use vLLM's own VLLM_BATCH_INVARIANT mode (see stages.llm.settings)
    hold_vllm_to_path()
    mask_unadapted_lora_tokens()
    if not switched_on():
        return
    # The attention metadata builder reads this on every step; a value given explicitly
    # (the audit's split-kv ablation) is kept.
    envs.set_default("VLLM_CPU_ATTN_SPLIT_KV", "0")
    _patch_gemm_dispatch()


#: The ops of vLLM's CPU LoRA path (`vllm.lora.ops.torch_ops.lora_ops`) that pick each token's adapter weights by
#: slot index; `sgmv_*`, the prefill path the CPU runner always takes, calls these.
_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def mask_unadapted_lora_tokens() -> None:
    """Give tokens without an adapter no update. vLLM 0.32's CPU ops index the adapters' weights with each token's
    slot, and a token without an adapter has slot -1, which Python reads as the last slot: in a batch that mixes
    requests with and without adapters, one without was computed with the last slot's adapter (measured: its tokens
    and logprobs were exactly those of the same prompt with that adapter). Here those tokens' weights are zeros, so
    their update is exactly 0; an adapted token's weights are its own, times 1 (exact). Switch on or off."""
    import sys

    import torch
    import vllm.lora.ops.torch_ops.lora_ops as ops

    if getattr(ops, "_omniserve_masked", False):
        return

    def masked(op):
        def with_no_adapter_zeroed(inputs, weights, output, indices, *rest, **kwargs):
            chosen = weights[indices.clamp_min(0)]  # one weight per token, as the op itself would choose
            keep = (indices >= 0).to(chosen.dtype).view(-1, *([1] * (chosen.dim() - 1)))
            return op(
                inputs, chosen * keep, output, torch.arange(indices.numel(), device=indices.device), *rest, **kwargs
            )

        return with_no_adapter_zeroed

    for name in _LORA_OPS:
        setattr(ops, name, masked(getattr(ops, name)))
    ops._omniserve_masked = True
    bound = sys.modules.get("vllm.lora.punica_wrapper.punica_cpu")  # binds the names at its import
    for name in _LORA_OPS if bound is not None else ():
        setattr(bound, name, getattr(ops, name))


#: torch's CPU-feature probes vLLM reads to choose its kernel library and attention ISA, and the paths on which
#: each may answer from the hardware. AMX is no path's: an AMX machine must compute what its path's machines do.
_PROBES_ALLOWED_ON = {
    "_is_avx512_supported": {"avx512"},
    "_is_avx512_bf16_supported": {"avx512"},
    "_is_amx_tile_supported": set(),
    "_is_amx_fp16_supported": set(),
}
#: The library vLLM loads on each path (x86); vllm.platforms.cpu's import_kernels chooses by the probes above.
VLLM_LIBRARY = {"avx512": "_C", "avx2": "_C_AVX2", "generic": "_C_AVX2"}


def hold_vllm_to_path() -> None:
    """Make the probes above say False where this process's kernel path does not allow them; before vLLM
    imports its kernels (plugins load first in the engine core and in workers)."""
    import torch

    isa = cpu_isa()
    for probe, paths in _PROBES_ALLOWED_ON.items():
        if isa not in paths and hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, _false)


def _false() -> bool:
    return False


def vllm_library() -> str | None:
    """The vLLM kernel library this process mapped (`_C`, `_C_AVX512`, `_C_AVX2`), None before it loads one."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return None
    names = {line.rsplit("/", 1)[-1].split(".", 1)[0] for line in maps.splitlines() if "/vllm/_C" in line}
    return next(iter(names)) if len(names) == 1 else ",".join(sorted(names)) or None


def _patch_gemm_dispatch() -> None:
    from vllm.model_executor.layers import utils as layer_utils

    with _lock:
        if _state["patched"]:
            return
        stock = layer_utils.dispatch_cpu_unquantized_gemm

        def dispatch_batch_invariant(layer, remove_weight: bool) -> None:
            if not _reroutable(layer):
                _state["kept"].append(type(layer).__name__)
                return stock(layer, remove_weight)
            _ensure_kernels()
            _versioned_weight(layer)
            # The weight stays: F.linear reaches the kernels, which pack it once and keep the copy.
            layer.cpu_linear = _linear
            _state["rerouted"].append(tuple(layer.weight.shape))

        dispatch_batch_invariant.__wrapped__ = stock  # type: ignore[attr-defined]
        # linear.py and vocab_parallel_embedding.py import this name at call time, so
        # replacing the module attribute reaches every layer loaded after this point.
        layer_utils.dispatch_cpu_unquantized_gemm = dispatch_batch_invariant
        _state["patched"] = True


def _reroutable(layer) -> bool:
    import torch

    weight = layer.weight
    return not weight.is_meta and weight.ndim == 2 and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _versioned_weight(layer) -> None:
    """Make the weight an ordinary tensor if it is an inference tensor: the kernels keep a packed copy
    of a weight only while its version counter says it is unchanged, and inference tensors have none
    (they would be packed again on every call)."""
    import torch

    if layer.weight.is_inference():
        with torch.inference_mode(False):
            layer.weight = torch.nn.Parameter(layer.weight.clone(), requires_grad=False)


def _linear(x, weight, bias):
    import torch.nn.functional as F

    # 2-D input and weight: aten::linear decomposes to aten::mm / aten::addmm, the ops
    # stages.kernels overrides on the CPU dispatch key.
    return F.linear(x, weight, bias)


def _ensure_kernels() -> None:
    if _state["kernels"] is not None:
        return
    from stages.kernels import enable_batch_invariant_kernels

    report = enable_batch_invariant_kernels("cpu")
    if not report.installed:
        raise RuntimeError(f"batch invariance was requested but no CPU kernels installed: {report.reason}")
    _state["kernels"] = report


def process_report() -> dict:
    """What this process installed: the kernel report and which layers were rerouted."""
    import torch

    from stages.kernels import current_report

    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "switch": switched_on(),
        "attention_split_kv": envs.read("VLLM_CPU_ATTN_SPLIT_KV"),
        "vllm_library": vllm_library(),
        "gemm_dispatch_patched": _state["patched"],
        "rerouted_linear_layers": len(_state["rerouted"]),
        "stock_gemm_layers": len(_state["kept"]),
        "kernels": current_report().to_dict(),
        "packed_weights": _packed_weights(),
        # On CUDA, vLLM's own mode (VLLM_BATCH_INVARIANT=1 -> init_batch_invariance()).
        "vllm_batch_invariant_mode": _vllm_mode(),
    }


def _packed_weights() -> dict | None:
    from stages.kernels import native

    return native.packed_weights() if _state["kernels"] is not None else None


def _vllm_mode() -> bool:
    from stages.kernels import vllm_mode

    return vllm_mode.active()


class InvarianceReportExtension:
    """A vLLM worker extension (`worker_extension_cls`): lets the engine owner ask each worker
    what it installed, through `collective_rpc("omniserve_invariance_report")`."""

    def omniserve_invariance_report(self) -> dict:
        return process_report()

    def omniserve_self_audit_kernels(self, kernels: bool) -> dict:
        """The LLM self-audit's switch (stages/llm/self_audit.py): our kernels in or out in this worker; its report
        after."""
        return audit_kernels(kernels)


def audit_kernels(kernels: bool) -> dict:
    """Out: the rerouted layers' F.linear reaches ATen's stock GEMM (the self-audit's control). In: the kernels this
    process installed at load time, again (only where it had: a worker whose kernels never went in stays without)."""
    from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels

    if not kernels or envs.read("OMNISERVE_TEST_FAULT") == "kernels-uninstalled":  # the fault keeps them out
        disable_batch_invariant_kernels()
    elif _state["kernels"] is not None:
        enable_batch_invariant_kernels("cpu")
    return process_report()
