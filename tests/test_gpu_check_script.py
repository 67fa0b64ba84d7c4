"""scripts/gpu_check.py, what a GPU run must show, kept runnable: its CPU dry run goes through every code path.

The dry run's speed figures are tiny-size noise and are not checked; its structure is, and so are the
invariance verdicts with the CPU kernels on (proven in tests/stages/test_kernels.py, so a failure here means
the script measures wrongly).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SECTIONS = ("invariance", "linear_speed", "op_speed", "diffusion_bits", "diffusion_speed", "self_audit")
SPREAD = {"min", "median", "max"}


def run_script(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the script would run, not refuse")
def test_gpu_check_refuses_cuda_without_a_gpu(tmp_path):
    done = run_script("--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "refusing" in done.stderr and "--device cpu --quick" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing written that could pass for evidence


def _check_timed_rows(report: dict) -> None:
    for name in ("linear_speed", "op_speed", "diffusion_speed"):
        for row in report[name]:
            assert SPREAD <= set(row["on_over_off"]) and SPREAD <= set(row["seconds_off"]) and SPREAD <= set(row["seconds_on"])
            assert row["repeats"] >= 2 and row["on_over_off"]["min"] > 0
    assert {(r["k"], r["n"], r["m"]) for r in report["linear_speed"]} == {
        (k, n, m) for k, n in report["plan"]["speed_shapes"] for m in report["plan"]["speed_rows"]}
    for row in report["diffusion_speed"]:
        assert row["images_per_s_off"] > 0 and row["images_per_s_on"] > 0


@pytest.mark.slow  # two worker processes load torch, the kernels and both embedded pipelines: about 30 s
def test_gpu_check_cpu_dry_run_writes_every_section(tmp_path):
    done = run_script("--out", str(tmp_path), "--device", "cpu", "--quick", timeout=600)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a noisy tiny speed check
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["schema"] == "omniserve-gpu-check/1" and report["device"] == "cpu" and report["quick"] is True
    assert report["errors"] == [], report["errors"]
    assert report["kernels"]["on"]["installed"] and not report["kernels"]["off"]["installed"]
    assert all(report[name] for name in SECTIONS), {name: len(report[name]) for name in SECTIONS}
    assert {"hardware", "versions", "command"} <= set(report["environment"])
    ops = {row["op"] for row in report["invariance"]}
    assert ops == {"linear", "conv2d", "group_norm", "bmm", "sdpa"}
    for row in report["invariance"]:
        assert row["on"]["cases"] == row["off"]["cases"] > 0
        assert row["on"]["differing"] == 0, row  # the CPU kernels are invariant: the script must see it
    for row in report["diffusion_bits"]:
        assert row["on"]["arrangements"] == row["off"]["arrangements"] > 0 and row["on"]["differing"] == 0, row
    assert {row["path"] for row in report["diffusion_bits"]} == {"engine", "pipeline"}
    for row in report["self_audit"]:  # the default model's replica on this CPU path, as a first start
        audit = row["self_audit"]
        assert audit["runs"] == 3 and not audit["reused"] and audit["differing"] == [], row
        assert row["verified"] == audit["control_varied"], row  # proven exactly where its control varied
    _check_timed_rows(report)
    checks = report["checks"]
    assert checks and all({"name", "passed", "detail"} <= set(c) for c in checks)
    assert report["passed"] == all(c["passed"] for c in checks) and (done.returncode == 0) == report["passed"]
    names = " ".join(c["name"] for c in checks)
    assert "invariance on:" in names and "diffusion bits on:" in names and "speed F.linear bf16" in names
    assert "self-audit proves the replica:" in names
    summary = (tmp_path / "gpu-check.md").read_text()
    assert "## Checks" in summary and "PASS" in summary and "not evidence" in summary
    assert all(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}" in done.stdout for c in checks)
