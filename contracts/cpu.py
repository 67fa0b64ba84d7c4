"""The CPU paths of the batch-invariant kernels, and the one level a process is held to (no torch here).

A path is what the kernels are compiled for and what ATen, oneDNN and MKL are limited to (`envs.cpu_isa_limits`),
so that two machines on one path compute the same bits even where their CPUs differ (an AVX-512 machine held to
the avx2 path computes what an AVX2 machine does). The default is avx2 wherever the CPU has AVX2 and FMA, the
widest level most x86-64 servers and laptops share, and generic elsewhere (aarch64 included); avx512 is opt-in
(OMNISERVE_CPU_ISA=avx512): faster on such machines, with golden bits of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import envs

#: The CPU flags each path needs (Linux /proc/cpuinfo names).
ISA_CPU_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma"}),
    "avx2": frozenset({"avx2", "fma"}),
    "generic": frozenset(),
}
DEFAULT_ORDER = ("avx2", "generic")  # what a process runs unless OMNISERVE_CPU_ISA says otherwise


class CpuPathError(ValueError):
    """OMNISERVE_CPU_ISA names a path this CPU cannot run."""


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def supported_isas() -> list[str]:
    """The paths this CPU can run, widest first."""
    flags = cpu_flags()
    return [isa for isa in envs.CPU_ISAS if ISA_CPU_FLAGS[isa] <= flags]


def cpu_isa() -> str:
    """This process's path: OMNISERVE_CPU_ISA if set (refused if this CPU cannot run it), else avx2 or generic."""
    forced, supported = envs.read("OMNISERVE_CPU_ISA"), supported_isas()
    if forced is None:
        return next(isa for isa in DEFAULT_ORDER if isa in supported)
    if forced not in supported:
        raise CpuPathError(
            f"OMNISERVE_CPU_ISA={forced}: this CPU lacks {sorted(ISA_CPU_FLAGS[forced] - cpu_flags())} "
            f"(it runs {', '.join(supported)})"
        )
    return forced


def hold_process_to_path() -> dict[str, str]:
    """Limit ATen, oneDNN and MKL in this process (and those it starts) to this process's path, where the
    variables are not set already; call it before their first use (a stage's start, a test session's, the CLI's)."""
    limits = envs.cpu_isa_limits(cpu_isa())
    for name, value in limits.items():
        envs.set_default(name, value)
    return limits


def _held_names() -> set[str]:
    """Every variable that holds ATen, oneDNN or MKL to some path."""
    return {name for path in ISA_CPU_FLAGS for name in envs.cpu_isa_limits(path)}


def unheld_environment() -> dict[str, str]:
    """This process's environment for a child held to no kernel path: ATen, oneDNN and MKL at the machine's widest,
    as stock libraries run here (a benchmark's stock baseline)."""
    return envs.environment_without(_held_names() | {"OMNISERVE_CPU_ISA"})


def path_environment(isa: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process held to path `isa`: OMNISERVE_CPU_ISA and that path's ATen/oneDNN/MKL levels,
    none of another path's left over (tests and benchmarks run one machine's paths side by side)."""
    others = _held_names()
    return {k: v for k, v in environ.items() if k not in others} | {
        "OMNISERVE_CPU_ISA": isa,
        **envs.cpu_isa_limits(isa),
    }
