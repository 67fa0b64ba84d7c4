"""Throughput of the diffusion stage's renderer with batch-invariant kernels on vs off.

A benchmark, not a test: this machine is shared and noisy, so settings are interleaved
(off, on, off, on, ...) within one process and the medians compared as ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.load import spread
from bench.plot import ratio_picture
from contracts.sampling import DiffusionSamplingParams
from evidence.diffusion import stock_renderer
from evidence.report import environment
from stages.diffusion import DiffusionRenderer, Job
from stages.embedded import embedded_models
from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels


def _seconds(renderer: DiffusionRenderer, jobs: list[Job]) -> float:
    start = time.perf_counter()
    renderer.render(jobs)
    return time.perf_counter() - start


def benchmark_model(
    model: str,
    *,
    sizes: Sequence[int] = (64, 256),
    batch_sizes: Sequence[int] = (1, 4, 8),
    steps: int = 8,
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> list[dict]:
    renderer = stock_renderer(model, batch_invariant=False)  # kernels are switched below, between rounds
    rows = []
    for size in sizes:
        params = renderer.resolve(DiffusionSamplingParams(seed=0, num_inference_steps=steps, height=size, width=size))
        timings: dict[tuple[str, int], list[float]] = {}
        for repeat in range(repeats + 1):  # the first round warms every shape up and is dropped
            for setting in ("off", "on"):
                if setting == "on":
                    enable_batch_invariant_kernels("cpu")
                else:
                    disable_batch_invariant_kernels()
                for batch in batch_sizes:
                    jobs = [Job(f"benchmark prompt {i}", params.model_copy(update={"seed": i})) for i in range(batch)]
                    seconds = _seconds(renderer, jobs)
                    if repeat:
                        timings.setdefault((setting, batch), []).append(seconds)
        disable_batch_invariant_kernels()
        for batch in batch_sizes:
            off, on = (statistics.median(timings[(s, batch)]) for s in ("off", "on"))
            row: dict[str, Any] = {
                "model": model,
                "size": size,
                "steps": steps,
                "batch_size": batch,
                "images_per_s_off": round(batch / off, 3),
                "images_per_s_on": round(batch / on, 3),
                "on_over_off": round(off / on, 3),
                "repeats": repeats,
                # Per repeat, off and on ran back to back: their ratios show the spread the medians hide.
                "on_over_off_paired": spread(
                    [a / b for a, b in zip(timings[("off", batch)], timings[("on", batch)], strict=True)]
                ),
            }
            rows.append(row)
            log(
                f"[bench] {model} {size}px batch {batch}: off {row['images_per_s_off']} img/s, "
                f"on {row['images_per_s_on']} img/s, on/off {row['on_over_off']}"
            )
        on_rate = {
            b: next(
                r["images_per_s_on"] for r in rows if r["size"] == size and r["batch_size"] == b and r["model"] == model
            )
            for b in batch_sizes
        }
        log(
            f"[bench] {model} {size}px kernels on: batch {max(batch_sizes)} vs 1 per image: "
            f"{on_rate[max(batch_sizes)] / on_rate[min(batch_sizes)]:.2f}x"
        )
    return rows


def run_benchmark(
    models: Sequence[str] = embedded_models("diffusion"), *, command: Sequence[str] | None = None, **options
) -> dict:

    rows = [row for model in models for row in benchmark_model(model, **options)]
    return {"rows": rows, "environment": environment(command)}


def _paired(row: dict) -> str:
    paired = row.get("on_over_off_paired")  # absent from reports written before it was recorded
    return f" (paired {paired['min']}-{paired['max']})" if paired else ""


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"Hardware: {env['hardware']['cpu']}, {env['hardware']['usable_cpus']} usable CPUs, "
        f"torch threads {env['hardware']['torch_threads']}. Command: `{env['command']}`",
        "",
        "| model | size | steps | batch | images/s off | images/s on | on / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['size']}x{r['size']} | {r['steps']} | {r['batch_size']} | "
            f"{r['images_per_s_off']} | {r['images_per_s_on']} | {r['on_over_off']}{_paired(r)} |"
        )
    return "\n".join(lines) + "\n"


def picture(report: dict, path: str) -> None:
    """On/off images/s against batch size, one line per model and size (median, min-max over repeats)."""

    series: dict[str, list] = {}
    for r in report["rows"]:
        series.setdefault(f"{r['model'].rsplit('/', 1)[-1]} {r['size']}px", []).append(
            (r["batch_size"], r["on_over_off_paired"])
        )
    repeats = report["rows"][0]["repeats"] if report["rows"] else 0
    ratio_picture(
        path,
        title=f"diffusion renderer, images/s kernels on / off; {repeats} repeats paired, median, whiskers min-max",
        x_label="batch size",
        series=series,
    )
