"""The generic kernel path on aarch64, run under user-mode emulation, gives the x86 bits.

`tests/stages/aarch64/harness.cpp` computes the kernels' golden cases (the fixed-order GEMM at the shapes the path
comparison in test_kernels.py uses, and group_norm in both layouts) from inputs made of an integer hash, and writes
each output's bytes. It is compiled twice from one source: for x86-64 against this environment's torch, run with the
library of every kernel path this CPU runs; and for aarch64 with Debian's cross compiler against torch's own aarch64
build of the same version (`scripts/aarch64_torch.py`), run by Debian's qemu-aarch64 with the generic path's library
cross-compiled from blocked.cpp. `make toolchains` installs all three.

Convolution is computed and not compared: blocked.cpp hands it to oneDNN, whose kernels are chosen per instruction
set (issue 47 asks for a path-independent one); docs/performance/cpu-paths.md records what the harness measured.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from contracts import cpu
from stages.kernels import native

pytestmark = [pytest.mark.slow, pytest.mark.path_independent]

HERE = Path(__file__).with_name("aarch64")
ROOT = Path(__file__).resolve().parents[2]
CROSS_CXX, CROSS_CC, QEMU = "aarch64-linux-gnu-g++", "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's aarch64 C library, installed with the cross compiler
TORCH_AARCH64 = ROOT / "build" / "aarch64-torch"  # scripts/aarch64_torch.py's target in `make toolchains`
OWN_OPS = ("gemm-", "group-norm")  # computed by blocked.cpp itself on every path; convolution is oneDNN's
TIMEOUT_S = 600


def _run(command: list[str], **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    assert done.returncode == 0, f"{command[0]} exit {done.returncode}: {(done.stderr or done.stdout)[-3000:]}"
    return done.stdout


def _torch_flags(torch_lib: Path) -> list[str]:
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-std=c++20", "-O2",
            *(f"-I{path}" for path in native.torch_includes()),
            f"-L{torch_lib}", "-Wl,--no-as-needed", "-ltorch_cpu", "-lc10"]


def _emulated_machine(root: Path) -> Path:
    """What qemu-aarch64 shows the emulated process (`-L root`: its file opens look there first): the aarch64 C
    library, and an Arm CPU's /proc/cpuinfo and MIDR registers for every CPU of this one, which torch's CPU probe
    (cpuinfo) reads and crashes without (it finds this machine's x86 /proc/cpuinfo)."""
    root.mkdir()
    (root / "lib").symlink_to(SYSROOT / "lib")
    possible = Path("/sys/devices/system/cpu/possible").read_text().strip()
    count = int(possible.split("-")[-1].split(",")[-1]) + 1
    cpuinfo = ""
    for index in range(count):  # a Neoverse N1 (Arm 0xd0c) without SVE: ATen runs its plain NEON code
        cpuinfo += (f"processor\t: {index}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
                    "atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\n"
                    "CPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n")
        midr = root / f"sys/devices/system/cpu/cpu{index}/regs/identification/midr_el1"
        midr.parent.mkdir(parents=True)
        midr.write_text("0x00000000413fd0c1\n")
    (root / "proc").mkdir()
    (root / "proc" / "cpuinfo").write_text(cpuinfo)
    return root


def _digests(directory: Path) -> dict[str, str]:
    return {path.stem: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.glob("*.bin"))}


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory):
    """Runs the harness on the emulated aarch64 machine: `aarch64(stock=False)` -> {case: sha256}."""
    missing = [tool for tool in (CROSS_CXX, CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{missing} missing: `make toolchains` installs them (apt-get, as root)")
    torch_lib = TORCH_AARCH64 / torch.__version__.split("+")[0] / "lib"
    if not (torch_lib / "libtorch_cpu.so").is_file():
        pytest.fail(f"torch's aarch64 libraries are missing in {torch_lib}: `make toolchains` fetches them")
    work = tmp_path_factory.mktemp("aarch64")
    for library in ("cudart", "cupti"):  # stand-ins for the CUDA libraries libtorch_cpu names (cuda_stubs.c)
        (work / f"{library}.map").write_text(f"lib{library}.so.13 {{ global: *; }};\n")
        _run([CROSS_CC, "-shared", "-fPIC", "-O1", f"-Wl,--version-script={work / f'{library}.map'}",
              f"-Wl,-soname,lib{library}.so.13", str(HERE / "cuda_stubs.c"), "-o", str(work / f"lib{library}.so.13")])
    kernels = work / "blocked-generic-aarch64.so"
    _run(native._command(native.SOURCE, kernels, isa="generic", cxx=CROSS_CXX, torch_lib=torch_lib))
    header = kernels.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and header[18] == 0xB7, header  # e_machine: EM_AARCH64
    harness = work / "harness"
    _run([CROSS_CXX, str(HERE / "harness.cpp"), *_torch_flags(torch_lib), f"-Wl,-rpath-link,{torch_lib}:{work}",
          "-o", str(harness)])
    machine = _emulated_machine(work / "root")

    def run(stock: bool = False) -> dict[str, str]:
        out = work / ("stock" if stock else "kernels")
        out.mkdir(exist_ok=True)
        environ = {**os.environ, "QEMU_LD_PREFIX": str(machine), "LD_LIBRARY_PATH": f"{torch_lib}:{work}"}
        said = _run([QEMU, str(harness), str(kernels), str(out), *(["stock"] if stock else [])], env=environ)
        assert said.split()[-1] == ("stock" if stock else "generic"), said
        return _digests(out)

    return run


@pytest.fixture(scope="module")
def x86(tmp_path_factory):
    """{path: {case: sha256}} for every kernel path this CPU runs, the same harness built for this machine."""
    work = tmp_path_factory.mktemp("x86")
    torch_lib = Path(torch.__file__).parent / "lib"
    harness = work / "harness"
    _run([os.environ.get("CXX", "g++"), str(HERE / "harness.cpp"), *_torch_flags(torch_lib),
          f"-Wl,-rpath,{torch_lib}", "-o", str(harness)])
    runs = {}
    for isa in cpu.supported_isas():
        library = native.build(isa)  # into the kernel cache, where `make test`'s loop on that path finds it
        out = work / isa
        out.mkdir()
        said = _run([str(harness), str(library), str(out)], env=cpu.path_environment(isa, os.environ))
        assert said.split()[-1] == isa, said
        runs[isa] = _digests(out)
    return runs


def test_aarch64_the_generic_path_under_emulation_gives_every_x86_paths_gemm_and_group_norm_bits(aarch64, x86):
    emulated = aarch64()
    own = {case for case in emulated if case.startswith(OWN_OPS)}
    assert len(own) >= 80, sorted(emulated)  # 22 GEMM and 20 group_norm cases per dtype
    for isa, bits in x86.items():
        assert set(bits) == set(emulated), isa
        differ = sorted(case for case in own if bits[case] != emulated[case])
        assert not differ, f"aarch64's generic path differs from x86's {isa} path in {len(differ)} cases: {differ}"


def test_aarch64_control_torchs_own_kernels_on_aarch64_give_other_gemm_bits(aarch64, x86):
    """The comparison can fail: with the kernels left out, aarch64's stock GEMM (Arm's libraries) differs."""
    stock, ours = aarch64(stock=True), next(iter(x86.values()))
    differ = sorted(case for case in stock if case.startswith("gemm-") and stock[case] != ours[case])
    assert differ, "stock aarch64 GEMM gave the kernels' x86 bits in every case: the comparison could not fail here"
