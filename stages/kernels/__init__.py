"""Batch-invariant kernels, installed process-wide and removed exactly.

- CPU: the project's own fixed-shape-blocked ops (`stages.kernels.blocked.CPU_OPS`),
  registered through `torch.library` on the CPU dispatch key.
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
import os
import threading
import warnings
from dataclasses import asdict, dataclass, field

import torch

from .blocked import CPU_OPS, CUDA_COVER_OPS


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
_library: torch.library.Library | None = None
_report: KernelReport | None = None
_vllm_env_before: str | None = None


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _register(ops: dict, key: str) -> tuple[torch.library.Library, list[str]]:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # Replacing the stock kernel is the point; torch warns about exactly that.
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        for name, fn in ops.items():
            library.impl(name, fn, key)
    return library, [f"aten::{name}" for name in ops]


def _enable_cuda() -> tuple[torch.library.Library | None, list[str], str]:
    global _vllm_env_before
    if torch.version.hip is not None:
        return None, [], "ROCm: no batch-invariant kernels are verified here; nothing installed"
    try:
        from vllm.model_executor.determinism import batch_invariant as vllm_bi
    except ImportError as err:  # no vLLM with CUDA kernels in this environment
        return None, [], f"vLLM's batch-invariant kernels are unavailable: {err}"
    # vLLM's own code paths read this variable; keep it for restore.
    _vllm_env_before = os.environ.get("VLLM_BATCH_INVARIANT")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    vllm_bi.init_batch_invariance()
    library, ops = _register(CUDA_COVER_OPS, "CUDA")
    return library, ["vllm:init_batch_invariance", *ops], "vLLM's CUDA kernels plus the project's conv/group_norm cover"


def enable_batch_invariant_kernels(device=None) -> KernelReport:
    """Install batch-invariant kernels for `device` (default: CUDA if present, else CPU)."""
    global _library, _report
    with _lock:
        if _report is not None and _report.installed:
            return _report
        kind = _device_type(device)
        if kind == "cpu":
            _library, ops = _register(CPU_OPS, "CPU")
            _report = KernelReport(True, "cpu", ops, "the project's fixed-shape-blocked CPU kernels")
        elif kind == "cuda":
            _library, ops, reason = _enable_cuda()
            installed = _library is not None
            _report = KernelReport(installed, "vllm-cuda" if installed else "none", ops, reason)
        else:
            _report = KernelReport(False, "none", [], f"no batch-invariant kernels for device type {kind!r}")
        return _report


def disable_batch_invariant_kernels() -> None:
    """Remove every override this module installed; stock kernels answer again."""
    global _library, _report, _vllm_env_before
    with _lock:
        if _library is not None:
            _library._destroy()
        if _report is not None and _report.backend == "vllm-cuda":
            from vllm.model_executor.determinism import batch_invariant as vllm_bi

            if vllm_bi._batch_invariant_LIB is not None:
                vllm_bi._batch_invariant_LIB._destroy()
            vllm_bi._batch_invariant_LIB = None
            vllm_bi._batch_invariant_MODE = False
            if _vllm_env_before is None:
                os.environ.pop("VLLM_BATCH_INVARIANT", None)
            else:
                os.environ["VLLM_BATCH_INVARIANT"] = _vllm_env_before
        _library = None
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
