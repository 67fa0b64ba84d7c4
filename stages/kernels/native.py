"""Build and load the C++ kernels (`blocked.cpp`), and install them on a dispatch key.

The shared library is compiled on first use with the system's C++ compiler against the
installed torch (about 10 s on 2 cores), cached under `envs.cache_root()/kernels` with a name that
hashes the source, the torch build and the command, and loaded with ctypes. It is a plain
shared library, not a Python extension: it only registers aten kernels, through the
`torch::Library` objects it owns, so removing them restores the stock kernels exactly.
`make` builds it during set-up, so servers and tests
find it ready; concurrent first builds (several replicas) each write their own temporary
file and rename it into place. A cached library is loaded only if this user owns it (and its
directory), nobody else can write to them, and its sha256 is the one its build recorded
beside it; else it is rebuilt, or refused when it is not this user's to replace.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import threading
from pathlib import Path

import torch

from contracts import cpu, envs
from stages.trust import distrust, ours_to_replace

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blocked.cpp")
#: Every op blocked.cpp can replace, and the subset vLLM's CUDA mode leaves out.
#: Transcendental elementwise ops, each computed by its stock vector code on every element (blocked.cpp, "pointwise").
POINTWISE_OPS = (
    "silu",
    "silu_",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "exp",
    "exp_",
    "gelu",
    "gelu_",
    "log",
    "sin",
    "cos",
    "erf",
)
CPU_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "group_norm", "upsample_nearest2d", *POINTWISE_OPS)
CUDA_COVER_OPS = ("convolution", "group_norm")


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded here (no compiler, no torch headers, ...)."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


#: How blocked.cpp is compiled for each CPU path (contracts/cpu.py). Every path computes the fixed-order GEMM in
#: the same order (its bits do not depend on the path); AVX-512 with bf16 dot products is the widest, AVX2 + FMA
#: the common x86-64 server and laptop, generic plain C++ (any CPU, aarch64 included).
_ISA_COMPILER_FLAGS = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
        "-mfma",
        "-DOMNISERVE_ISA_AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-DOMNISERVE_ISA_AVX2"],
    "generic": ["-DOMNISERVE_ISA_GENERIC"],
}


def cpu_isa() -> str:
    """This process's kernel path; a forced one this CPU cannot run is a KernelBuildError."""
    try:
        return cpu.cpu_isa()
    except cpu.CpuPathError as err:
        raise KernelBuildError(str(err)) from None


def torch_includes() -> tuple[Path, Path]:
    """torch's C++ headers, in torch's own layout (what torch.utils.cpp_extension uses, without importing it: it
    imports setuptools, which patches distutils in every server process that enables the kernels)."""
    root = Path(torch.__file__).parent
    return root / "include", root / "include" / "torch" / "csrc" / "api" / "include"


def _command(
    source: Path,
    output: Path,
    *,
    isa: str | None = None,
    cxx: str | None = None,
    torch_lib: Path | None = None,
) -> list[str]:
    """The compiler command for `isa` (default: this process's path); `torch_lib`: link against another machine's
    torch libraries of the same version (a cross compiler's build, tests/stages/test_aarch64.py: the headers are the
    same, the libraries here are this machine's)."""
    torch_lib = torch_lib or Path(torch.__file__).parent / "lib"
    libraries = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
    return [
        # -ffp-contract=off: a multiply and an add are never fused behind our back, so a loop gives the same
        # bits vectorized or not (group_norm relies on it; the GEMM's fmas are explicit intrinsics or std::fma).
        cxx or envs.read("CXX"),
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-ffp-contract=off",
        "-w",
        *_ISA_COMPILER_FLAGS[isa or cpu_isa()],
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in torch_includes()),
        str(source),
        *libraries,
        "-o",
        str(output),
    ]


def library_path(isa: str | None = None) -> Path:
    """Where the library for this source, torch build and compiler command of `isa` (default: this process's path)
    lives."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(_command(Path("SRC"), Path("OUT"), isa=isa)).encode())
    return envs.cache_root() / "kernels" / f"blocked-{digest.hexdigest()[:16]}.so"


def _record(path: Path) -> Path:
    """Where a build records the sha256 of what it wrote."""
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _why_not_use(path: Path) -> str | None:
    """Why the cached library must not be loaded (None: it may): trust, then its content against its record."""
    for part in (path.parent, path, _record(path)):
        if not part.exists():
            return f"{part} is missing"
        reason = distrust(part)
        if reason:
            return reason
    if _record(path).read_text().strip() != _sha256(path):
        return f"{path}'s content differs from what its build recorded"
    return None


def build(isa: str | None = None) -> Path:
    """The compiled library for `isa` (default: this process's path): the cached one if it is trusted and intact, else
    compiled now (or refused). Another path's library is built into the same cache, where a process held to that path
    finds it (tests/stages/test_aarch64.py builds every path's; `make test`'s path loops then load them)."""
    path = library_path(isa)
    if path.exists():
        reason = _why_not_use(path)
        if reason is None:
            return path
        if not ours_to_replace(path) or distrust(path.parent):
            raise KernelBuildError(f"refusing the cached kernel library: {reason}")
        logger.warning("rebuilding the kernel library: %s", reason)
    path.parent.mkdir(parents=True, exist_ok=True)
    if distrust(path.parent):
        raise KernelBuildError(f"refusing to build the kernel library there: {distrust(path.parent)}")
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = _command(SOURCE, partial, isa=isa)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"cannot compile {SOURCE.name}: {err}") from err
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise KernelBuildError(
            f"compiling {SOURCE.name} failed ({shlex.join(command[:1])} exit {done.returncode}):\n{tail}"
        )
    record = partial.with_name(partial.name + ".sha256")
    record.write_text(_sha256(partial) + "\n")
    os.replace(partial, path)
    os.replace(record, _record(path))
    return path


def _loaded() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            path = build()
            try:
                library = ctypes.CDLL(str(path))
            except OSError as err:
                raise KernelBuildError(f"cannot load {path}: {err}") from err
            library.omniserve_kernels_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            library.omniserve_kernels_install.restype = ctypes.c_int
            library.omniserve_kernels_uninstall.argtypes = [ctypes.c_char_p]
            library.omniserve_kernels_error.restype = ctypes.c_char_p
            library.omniserve_kernels_packed_weights.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
            library.omniserve_kernels_packed_weights.restype = ctypes.c_int
            library.omniserve_kernels_isa.restype = ctypes.c_char_p
            _library = library
        return _library


def packed_weights(limit_bytes: int | None = None) -> dict:
    """The packed-weight cache of the fixed-order GEMM; sets its bound if given."""
    stats = (ctypes.c_int64 * 6)()
    _loaded().omniserve_kernels_packed_weights(-1 if limit_bytes is None else limit_bytes, stats)
    return dict(zip(("hits", "packs", "uncached_packs", "entries", "bytes", "limit_bytes"), stats, strict=True))


def loaded_isa() -> str:
    """The CPU path the loaded library was compiled for (what it says of itself)."""
    return _loaded().omniserve_kernels_isa().decode()


def install(dispatch_key: str, ops: tuple[str, ...]) -> list[str]:
    """Register the blocked kernels for `ops` on `dispatch_key` ("CPU" or "CUDA"); the aten names installed."""
    library = _loaded()
    if dispatch_key == "CPU":
        packed_weights(envs.read("OMNISERVE_PACKED_WEIGHTS_MB") << 20)
    if library.omniserve_kernels_install(dispatch_key.encode(), ",".join(ops).encode()) != 0:
        raise KernelBuildError(f"registering the kernels failed: {library.omniserve_kernels_error().decode()}")
    return [f"aten::{name}" for name in ops]


def uninstall(dispatch_key: str) -> None:
    """Remove what `install` registered on `dispatch_key`; the stock kernels answer again."""
    if _library is not None:
        _library.omniserve_kernels_uninstall(dispatch_key.encode())
