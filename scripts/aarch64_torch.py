"""This environment's torch, built for aarch64: its CPU libraries only, for running the kernels' generic path under
user-mode emulation (tests/stages/test_aarch64.py). `make toolchains` runs it; it fetches the wheel with pip (extra
pip options after the target directory) and keeps libtorch_cpu, libc10 and what they load in
<target>/<torch version>/lib, once per version. The aarch64 wheel is a CUDA build: its CUDA libraries are left out
(the test stands in for the two that libtorch_cpu names, tests/stages/aarch64/cuda_stubs.c).

    python scripts/aarch64_torch.py build/aarch64-torch [pip options]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

#: torch's own libraries a CPU-only process loads (libtorch_cpu's and libc10's NEEDED entries, Linux aarch64 wheel).
KEEP = ("libtorch_cpu.so", "libc10.so", "libgomp", "libarm_compute", "libnvpl_", "libgfortran")


def version() -> str:
    """The torch release this environment runs (the aarch64 wheel must be the same: the headers are shared)."""
    return torch.__version__.split("+")[0]


def libraries(target: Path) -> Path:
    return target / version() / "lib"


def fetch(target: Path, pip_options: list[str]) -> Path:
    """The aarch64 libraries under `target` (fetched if missing)."""
    done = libraries(target)
    if (done / "libtorch_cpu.so").is_file():
        return done
    python = f"{sys.version_info.major}{sys.version_info.minor}"
    with tempfile.TemporaryDirectory(dir=target.parent if target.parent.is_dir() else None) as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--platform", "manylinux_2_28_aarch64", "--python-version", python, "--implementation", "cp",
             "--abi", f"cp{python}", f"torch=={version()}", "-d", scratch, *pip_options],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(scratch).glob("torch-*.whl")
        unpacked = Path(scratch) / "lib"
        unpacked.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                name = Path(member.filename).name
                if member.filename.startswith("torch/lib/") and name.startswith(KEEP) and "cuda" not in name:
                    (unpacked / name).write_bytes(archive.read(member))
        done.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(unpacked, done)
    return done


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]).resolve(), sys.argv[2:]))
