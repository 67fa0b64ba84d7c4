"""vLLM's own batch-invariant mode (CUDA), the one place that touches it: entering it, leaving it, asking for it.

vLLM has a public way in (`init_batch_invariance()`) but none out and none to ask; leaving and asking read and
reset its module state, `_batch_invariant_LIB` and `_batch_invariant_MODE`, which are private. Those names are
checked against the vLLM versions this adapter was written for; another version is refused by name (a clear error
instead of a silent half-reset) until it is checked here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: vLLM releases whose private batch-invariance state this adapter knows (`vllm.model_executor.determinism`).
KNOWN_VERSIONS = ("0.32.",)
_PRIVATE = ("_batch_invariant_LIB", "_batch_invariant_MODE")


class UnknownVLLMError(RuntimeError):
    """This vLLM's batch-invariance state is not the one the adapter was written for."""


def _module() -> ModuleType | None:
    try:
        from vllm.model_executor.determinism import batch_invariant
    except ImportError:
        return None
    return batch_invariant


def _checked(module: ModuleType) -> ModuleType:
    import vllm

    if not vllm.__version__.startswith(KNOWN_VERSIONS) or not all(hasattr(module, name) for name in _PRIVATE):
        raise UnknownVLLMError(
            f"vLLM {vllm.__version__}: its batch-invariance state is not the one stages/kernels/vllm_mode.py knows "
            f"({', '.join(KNOWN_VERSIONS)}x with {', '.join(_PRIVATE)}); check it there"
        )
    return module


def enter() -> None:
    """vLLM's public switch into its batch-invariant kernels."""
    module = _module()
    if module is None:
        raise ImportError("vLLM's batch-invariant kernels are not in this environment")
    module.init_batch_invariance()


def leave() -> None:
    """Undo `enter`: vLLM's overrides removed and its mode off."""
    module = _module()
    if module is None:
        return
    state: Any = _checked(module)  # vLLM's private names: set here, declared nowhere a type checker sees
    if state._batch_invariant_LIB is not None:
        state._batch_invariant_LIB._destroy()
    state._batch_invariant_LIB = None
    state._batch_invariant_MODE = False


def active() -> bool:
    """Whether vLLM's batch-invariant mode is on in this process (False without vLLM's module)."""
    module = _module()  # read only: tolerant of a version that lacks the name (then: not on)
    return False if module is None else bool(getattr(module, "_batch_invariant_MODE", False))


def available() -> str | None:
    """None when vLLM's batch-invariant kernels can be entered here; else why not."""
    try:
        from vllm.model_executor.determinism import batch_invariant  # noqa: F401
    except ImportError as err:
        return str(err)
    return None
