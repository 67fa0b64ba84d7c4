"""Batch-invariant kernels, installed process-wide and removed exactly.

- CPU: the project's own ops (`blocked.cpp`, `native.CPU_OPS`): a fixed-order GEMM whose bits do not
  depend on the CPU path (AVX-512, AVX2 + FMA or generic C++: `native.cpu_isa()`, OMNISERVE_CPU_ISA),
  oneDNN in one layout for convolution, group_norm in an order of our own, transcendental pointwise ops (SiLU, GELU,
  exp, ...) by the stock vector code on every element (ATen rounds a loop's odd elements otherwise),
  registered as aten kernels on the CPU dispatch key (`torch::Library`, see native.py).
- CUDA: vLLM's `init_batch_invariance()` (with `VLLM_BATCH_INVARIANT=1`), plus the
  project's cover for what vLLM leaves out (`CUDA_COVER_OPS`: convolution, group_norm).
- Anything else (ROCm, XPU, MPS): nothing is installed, and the report says why.

Usage:
    report = enable_batch_invariant_kernels()      # idempotent
    disable_batch_invariant_kernels()              # stock kernels again
    with batch_invariant_kernels(): ...            # on, then back to what it was
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass, field

import torch

from contracts import envs

from . import native, vllm_mode
from .native import CPU_OPS, CUDA_COVER_OPS, KernelBuildError


@dataclass(frozen=True)
class KernelReport:
    """What was installed. Never claims coverage it did not install."""

    installed: bool
    backend: str  # "cpu", "vllm-cuda" or "none"
    ops: list[str] = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_lock = threading.Lock()
_dispatch_key: str | None = None  # where our kernels are registered now ("CPU", "CUDA")
_report: KernelReport | None = None
_vllm_env_before: str | None = None


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _enable_cpu() -> KernelReport:
    global _dispatch_key
    try:
        ops = native.install("CPU", CPU_OPS)
    except KernelBuildError as err:  # e.g. no C++ compiler: say so, claim nothing
        return KernelReport(False, "none", [], f"the CPU kernels could not be built or installed: {err}")
    _dispatch_key = "CPU"
    return KernelReport(
        True,
        "cpu",
        ops,
        f"the project's CPU kernels, {native.loaded_isa()} path (a fixed-order "
        "packed GEMM, oneDNN convolution in one layout, our group_norm, transcendental pointwise ops by one code)",
    )


def _enable_cuda() -> KernelReport:
    global _vllm_env_before, _dispatch_key
    if torch.version.hip is not None:
        return KernelReport(False, "none", [], "ROCm: no batch-invariant kernels are verified here; nothing installed")

    missing = vllm_mode.available()
    if missing is not None:  # no vLLM with CUDA kernels in this environment
        return KernelReport(False, "none", [], f"vLLM's batch-invariant kernels are unavailable: {missing}")
    try:
        native.build()  # before touching vLLM's state: a failed build must leave nothing half-installed
    except KernelBuildError as err:
        return KernelReport(False, "none", [], f"the convolution/group_norm cover could not be built: {err}")
    # vLLM's own code paths read this variable; keep it for restore.
    _vllm_env_before = envs.assign("VLLM_BATCH_INVARIANT", "1")
    vllm_mode.enter()
    ops = native.install("CUDA", CUDA_COVER_OPS)
    _dispatch_key = "CUDA"
    return KernelReport(
        True,
        "vllm-cuda",
        ["vllm:init_batch_invariance", *ops],
        "vLLM's CUDA kernels plus the project's conv/group_norm cover",
    )


def enable_batch_invariant_kernels(device=None) -> KernelReport:
    """Install batch-invariant kernels for `device` (default: CUDA if present, else CPU)."""
    global _report
    with _lock:
        if _report is not None and _report.installed:
            return _report
        kind = _device_type(device)
        if kind == "cpu":
            _report = _enable_cpu()
        elif kind == "cuda":
            _report = _enable_cuda()
        else:
            _report = KernelReport(False, "none", [], f"no batch-invariant kernels for device type {kind!r}")
        return _report


def disable_batch_invariant_kernels() -> None:
    """Remove every override this module installed; stock kernels answer again."""
    global _dispatch_key, _report, _vllm_env_before
    with _lock:
        if _dispatch_key is not None:
            native.uninstall(_dispatch_key)
        if _report is not None and _report.backend == "vllm-cuda":
            vllm_mode.leave()
            envs.assign("VLLM_BATCH_INVARIANT", _vllm_env_before)
        _dispatch_key = None
        _report = None
        _vllm_env_before = None


def current_report() -> KernelReport:
    """The report of what is installed now."""
    return _report or KernelReport(False, "none", [], "batch-invariant kernels are not enabled")


@contextlib.contextmanager
def batch_invariant_kernels(device=None):
    """Kernels on inside the block; on exit, back to the state before it."""
    was_on = _report is not None and _report.installed
    report = enable_batch_invariant_kernels(device)
    try:
        yield report
    finally:
        if not was_on:
            disable_batch_invariant_kernels()


__all__ = [
    "KernelReport",
    "batch_invariant_kernels",
    "current_report",
    "disable_batch_invariant_kernels",
    "enable_batch_invariant_kernels",
]
