"""Every environment variable omniserve reads, in one table: name, default, meaning, parser.

The one module of the package that touches `os.environ` (as `vllm/envs.py` is for vLLM). Besides reading,
it sets variables in two documented places only: `overriding` (the environment an engine's processes
inherit while the LLM stage spawns them) and `assign` (the CUDA kernels tell vLLM's own code paths that its
batch-invariant mode is on, and restore the value when they are removed).

`VLLM_BATCH_INVARIANT` is vLLM's own variable, parsed exactly as vLLM parses it (`bool(int(value))`): a
value vLLM would reject (`true`, an empty string) is rejected here too, with the variable named, instead of
meaning "on" here and failing inside vLLM's processes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_switch(name: str, value: str) -> bool:
    """omniserve's own switches: 1/true/yes/on or 0/false/no/off (stripped, any case)."""
    normalized = value.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a valid switch value; use one of 1/true/yes/on or 0/false/no/off")


def parse_vllm_bool(name: str, value: str) -> bool:
    """vLLM's own parsing of its boolean variables: `bool(int(value))`; anything int() refuses is an error."""
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not a value vLLM accepts: it reads {name} as an integer (0 off, 1 on)"
        ) from None


def _text(name: str, value: str) -> str:
    return value


def _path(name: str, value: str) -> Path | None:
    return Path(value) if value else None


def _flag(name: str, value: str) -> bool:
    return value == "1"


def _megabytes(name: str, value: str) -> int:
    try:
        megabytes = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number of MiB") from None
    if megabytes < 0:
        raise ValueError(f"{name}={value!r}: a size cannot be negative")
    return megabytes


def memory_bytes() -> int:
    """What this process may use: the machine's physical memory, or its cgroup's limit where that is lower (a
    container's `--memory`, a Kubernetes limit; cgroup v2, then v1)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit:
                value = limit.read().strip()
        except OSError:
            continue
        if value.isdigit():
            return min(physical, int(value))
    return physical


def _packed_megabytes(name: str, value: str) -> int:
    """ "auto": half of what this process may use (`memory_bytes`), so the packed copies of a model's weights, as large
    as the weights, are kept whole for any model that fits twice; a number: that many MiB."""
    return memory_bytes() // 2 >> 20 if value == "auto" else _megabytes(name, value)


def _not_zero(name: str, value: str) -> bool:
    return value != "0"


#: The CPU paths of the batch-invariant kernels, widest first (stages/kernels/native.py compiles one per path).
CPU_ISAS = ("avx512", "avx2", "generic")


def _cpu_isa(name: str, value: str) -> str | None:
    normalized = value.strip().lower()
    if normalized in ("", "auto"):
        return None
    if normalized not in CPU_ISAS:
        raise ValueError(f"{name}={value!r} is not a CPU path; use one of {', '.join(CPU_ISAS)} (or auto)")
    return normalized


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None  # None: unset means "not given"
    parse: Callable[[str, str], Any]
    meaning: str


#: The table. Nothing else in the package reads the environment.
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "OMNI_LLM_BATCH_INVARIANT",
            None,
            parse_switch,
            "the LLM stage's switch when its config says null; unset: follow VLLM_BATCH_INVARIANT",
        ),
        Variable(
            "OMNI_DIFFUSION_BATCH_INVARIANT",
            None,
            parse_switch,
            "the diffusion stage's switch when its config says null; unset: follow VLLM_BATCH_INVARIANT",
        ),
        Variable(
            "VLLM_BATCH_INVARIANT",
            None,
            parse_vllm_bool,
            "vLLM's global switch (an integer, as vLLM reads it); each stage follows it unless its own is set",
        ),
        Variable(
            "OMNISERVE_STRICT_SCOPE",
            "0",
            parse_switch,
            "a stage whose config says `strict: null` refuses to start with invariance on outside the verified "
            "scope (the audit records, contracts/scope.py) when this is on; default off: it reports unverified",
        ),
        Variable(
            "OMNISERVE_CACHE",
            None,
            _path,
            "where built models and compiled kernels live (default: $XDG_CACHE_HOME/omniserve)",
        ),
        Variable("XDG_CACHE_HOME", None, _path, "the user's cache directory (default: ~/.cache)"),
        Variable("CXX", "c++", _text, "the C++ compiler that builds the batch-invariant CPU kernels"),
        Variable(
            "OMNISERVE_CPU_ISA",
            None,
            _cpu_isa,
            "the CPU kernels' path: avx512, avx2 or generic (default: avx2 where the CPU has AVX2 and FMA, else "
            "generic); ATen's, oneDNN's and MKL's own dispatch are held to the same level (contracts/cpu.py)",
        ),
        Variable(
            "ATEN_CPU_CAPABILITY",
            None,
            _text,
            "ATen's own vector level (default, avx2, avx512); set from OMNISERVE_CPU_ISA, not for users",
        ),
        Variable(
            "ONEDNN_MAX_CPU_ISA",
            None,
            _text,
            "oneDNN's highest instruction set; set from OMNISERVE_CPU_ISA, not for users",
        ),
        Variable("MKL_CBWR", None, _text, "MKL's reproducible code path; set from OMNISERVE_CPU_ISA, not for users"),
        Variable(
            "TORCHINDUCTOR_VEC_ISA_OK",
            None,
            _text,
            "inductor's vector code: off on the generic path (contracts/cpu.py), not for users",
        ),
        Variable(
            "OMNISERVE_PACKED_WEIGHTS_MB",
            "auto",
            _packed_megabytes,
            "bound on the CPU kernels' packed copies of weights, per process, in MiB (auto: half the memory the "
            "process may use; 0: pack on every call)",
        ),
        Variable(
            "OMNISERVE_VLLM_CPU_INVARIANT",
            "0",
            _flag,
            "set by the LLM stage in its engine's processes: 1 turns the vLLM CPU plugin on",
        ),
        Variable(
            "OMNISERVE_URL",
            "http://127.0.0.1:8000",
            _text,
            "the server `omniserve generate`, `verify` and `health` talk to (their --url overrides it)",
        ),
        Variable(
            "OMNISERVE_TEST_FAULT",
            None,
            _text,
            "tests only: kernels-uninstalled leaves a diffusion or LLM replica on stock kernels while its switch says "
            "on, for its self-audit to catch",
        ),
        Variable(
            "VLLM_RPC_BASE_PATH",
            None,
            _path,
            "where vLLM names its IPC socket files (unset: the LLM stage sets a directory of each process's own, "
            "removed when the process exits; vLLM's own default, /tmp, keeps them after the engine stops)",
        ),
        Variable(
            "VLLM_CPU_ATTN_SPLIT_KV",
            "1",
            _not_zero,
            "vLLM's CPU attention may split a decode's KV range by the step's workload (0: never)",
        ),
    )
}


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not in omniserve's environment table (contracts/envs.py)") from None


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    return _variable(name).name in (os.environ if environ is None else environ)


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of `name` (its default when unset; None when it has no default)."""
    variable = _variable(name)
    raw = (os.environ if environ is None else environ).get(name, variable.default)
    return None if raw is None else variable.parse(name, raw)


#: What each kernel path limits ATen's, oneDNN's and MKL's own dispatch to, so a machine with wider vectors
#: computes what a machine of that path computes (each library reads its variable once, at first use). MKL is held
#: to its COMPATIBLE code on every path: held to a level (MKL_CBWR=AVX2) it still picks its kernels by CPU model
#: (measured: an AMD EPYC and an Intel Xeon, both at AVX2, computed different float32 images, through the
#: attention's and bmm's MKL GEMMs), while COMPATIBLE computes alike on every x86-64 CPU (measured: the generic
#: path, held so, gave both machines the same images). Cost: docs/performance/cpu-paths.md.
_ISA_LIMITS = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_CBWR": "COMPATIBLE"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
    # Inductor (vLLM compiles a few sampling ops) emits vector code that fails to compile under ATen's default level
    # in torch 2.13 (`at::vec` undeclared: the engine core dies); without vector code it compiles.
    "generic": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_CBWR": "COMPATIBLE",
        "TORCHINDUCTOR_VEC_ISA_OK": "0",
    },
}


def cpu_isa_limits(isa: str) -> dict[str, str]:
    """The variables (ATen, oneDNN, MKL) that hold a process to kernel path `isa`; set before their first use."""
    return dict(_ISA_LIMITS[isa])


def cache_root() -> Path:
    """Where built models live: $OMNISERVE_CACHE, else $XDG_CACHE_HOME/omniserve, else ~/.cache/omniserve."""
    explicit = read("OMNISERVE_CACHE")
    if explicit:
        return explicit
    base = read("XDG_CACHE_HOME") or Path(os.path.expanduser("~")) / ".cache"
    return base / "omniserve"


# --- writes: the environment of processes this one starts ----------------------------------------

# The process-wide environment is shared by every engine started from one process.
_SPAWN_LOCK = threading.Lock()


@contextlib.contextmanager
def overriding(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` while a child's processes are spawned (they inherit them), then restore exactly."""
    with _SPAWN_LOCK:
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in before.items():
                assign(name, value)


def assign(name: str, value: str | None) -> str | None:
    """Set (or, with None, remove) one variable; returns the value it had, for an exact restore."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    return before


def set_default(name: str, value: str) -> None:
    os.environ.setdefault(name, value)


def environment_without(names: set[str]) -> dict[str, str]:
    """This process's environment less `names`: a child's, where those must not reach it."""
    return {name: value for name, value in os.environ.items() if name not in names}
