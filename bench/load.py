"""The diffusion stage under an arrival process: step-level vs request-level batching, side by side in one run.

A benchmark, not a test. Requests arrive as a Poisson process (a seeded RNG: the same seed, the same
schedule) mixing short (4-step) and long (32-step) images of one size, and go to `DiffusionStage`
instances driven by asyncio tasks in this process (no Ray: `render` is an async generator). Every mode
gets the same schedule within a repeat, and the modes alternate (step, request, request, step, ...) so
that the noise of a shared machine falls on both. A request's latency runs from its *scheduled* arrival
to its image, so a stalled generator cannot hide queueing. Reported per mode: per-class p50/p95 latency
and images/s (completed images over first arrival to last image), each as min/median/max over repeats,
and the request/step ratios paired by repeat.

With invariance on both modes render every request to the same bytes; the report counts any that differ.

    poisson_schedule   the seeded arrivals
    open_stage         a DiffusionStage without Ray Serve, in either batching mode
    run_mixed_load     repeats x modes -> the report; `markdown` and `picture` render it
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import cast

from bench.plot import COLOURS, Chart
from contracts.config import DiffusionStageConfig
from contracts.jobs import RenderJob, final_image
from contracts.sampling import DiffusionSamplingParams
from evidence.report import environment

MODES = ("step", "request")
#: The step engine with one latent shape per forward (`pack_sizes: false`): what FLUX's size packing is weighed against.
BY_SHAPE = "step-by-shape"
CLASSES = ("short", "long")


@dataclass(frozen=True)
class LoadSpec:
    """The arrival process: `requests` images at `rate` per second on average, `short_fraction` of them short."""

    rate: float = 3.0
    requests: int = 160
    # The two classes of request: short and long, of one image size (`size`), or the long ones of `long_size`.
    short_fraction: float = 0.5
    short_steps: int = 4
    long_steps: int = 32
    size: int = 64
    long_size: int | None = None
    seed: int = 0  # of the arrival schedule (repeat r uses seed + r)


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float  # seconds after the run starts
    kind: str  # "short" | "long"
    steps: int
    seed: int
    size: int

    @property
    def prompt(self) -> str:
        return f"a {self.kind} benchmark image, number {self.index}"

    def params(self) -> dict:
        return {"seed": self.seed, "num_inference_steps": self.steps, "height": self.size, "width": self.size}


def poisson_schedule(spec: LoadSpec, seed: int | None = None) -> list[Arrival]:
    """Exponential gaps of mean 1/rate; each request short with probability `short_fraction`. Seeded: reproducible."""
    rng = random.Random(spec.seed if seed is None else seed)
    at, arrivals = 0.0, []
    for index in range(spec.requests):
        at += rng.expovariate(spec.rate)
        short = rng.random() < spec.short_fraction
        arrivals.append(
            Arrival(
                index,
                round(at, 6),
                "short" if short else "long",
                spec.short_steps if short else spec.long_steps,
                rng.randrange(1 << 31),
                spec.size if short else spec.long_size or spec.size,
            )
        )
    return arrivals


# --- statistics ----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


def all_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- the stage, outside Ray Serve ----------------------------------------------------------------------


@contextlib.contextmanager
def outside_serve() -> Iterator[None]:
    """Let `@serve.batch` queues (request mode) start outside a replica.

    Ray Serve's batch queue reads `serve.get_replica_context()` once, only to warn when max_batch_size exceeds
    the deployment's max_ongoing_requests, and raises outside a replica. That warning is skipped here.
    """
    from unittest import mock

    from ray.serve import batching

    with mock.patch.object(
        batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None
    ):
        yield


def open_stage(mode: str, *, model: str | None = None, max_batch_size: int = 8, torch_threads: int | None = None):
    """A DiffusionStage instance (invariance on) in `mode` ("step", "request" or BY_SHAPE), in this process."""
    from ray.serve import Deployment

    from stages.diffusion import DiffusionStage

    config = DiffusionStageConfig(
        model=model,
        batching="step" if mode == BY_SHAPE else mode,
        pack_sizes=mode != BY_SHAPE,
        batch_invariant=True,
        max_batch_size=max_batch_size,
        torch_threads=torch_threads or all_cores(),
        max_queued=4096,
    )
    # @serve.deployment made the class a Deployment (mypy does not apply class decorators); this is the class itself.
    stage_class = cast("type[DiffusionStage]", cast(Deployment, DiffusionStage).func_or_class)
    stage = stage_class(config)
    if stage.batching.mode != config.batching:
        raise RuntimeError(f"{stage.renderer.model} runs {stage.batching.mode!r} batching, not {mode!r}")
    return stage


# --- one run: a schedule through one stage -------------------------------------------------------------


async def run_schedule(stage, schedule: Sequence[Arrival]) -> dict:
    """Send each request at its scheduled time; per request: latency from that time, sha256, batch size."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05

    async def one(arrival: Arrival) -> dict:
        await asyncio.sleep(max(0.0, start + arrival.at - loop.time()))
        job = RenderJob(prompt=arrival.prompt, params=DiffusionSamplingParams(**arrival.params()))
        image = await final_image(stage.render(job))
        return {
            "kind": arrival.kind,
            "latency_s": loop.time() - start - arrival.at,
            "done_s": loop.time() - start,
            "sha256": image.sha256,
            "batch_size": image.batch_size,
        }

    results = await asyncio.gather(*(one(a) for a in schedule))
    return summarize_run(results, first_arrival_s=schedule[0].at)


def summarize_run(results: list[dict], *, first_arrival_s: float) -> dict:
    wall = max(r["done_s"] for r in results) - first_arrival_s
    classes = {}
    for kind in CLASSES:
        latencies = [r["latency_s"] for r in results if r["kind"] == kind]
        if latencies:
            classes[kind] = {
                "count": len(latencies),
                "p50_s": round(percentile(latencies, 50), 4),
                "p95_s": round(percentile(latencies, 95), 4),
                "max_s": round(max(latencies), 4),
            }
    return {
        "classes": classes,
        "images": len(results),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(results) / wall, 3),
        "median_batch_size": statistics.median(r["batch_size"] for r in results),
        "sha256": [r["sha256"] for r in results],
    }


# --- repeats x modes -----------------------------------------------------------------------------------


def mode_orders(modes: Sequence[str], repeats: int) -> list[list[str]]:
    """Alternating order per repeat (A B, B A, A B, ...): neither mode always runs first."""
    return [list(modes) if r % 2 == 0 else list(reversed(modes)) for r in range(repeats)]


def run_mixed_load(
    spec: LoadSpec,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    model: str | None = None,
    max_batch_size: int = 8,
    torch_threads: int | None = None,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:

    with outside_serve():
        stages = {
            mode: open_stage(mode, model=model, max_batch_size=max_batch_size, torch_threads=torch_threads)
            for mode in modes
        }
        # One event loop for everything: request mode's @serve.batch queues live on the loop that made them.
        runs = asyncio.run(_alternate(stages, spec, repeats, log))
    first = next(iter(stages.values()))
    setup = {
        "model": first.renderer.model,
        "max_batch_size": max_batch_size,
        "torch_threads": first.renderer.torch_threads,
        "batch_invariant": True,
        "batch_wait_timeout_s": first.config.batch_wait_timeout_s,
    }
    return summarize(runs, spec=spec, modes=modes, repeats=repeats, setup=setup, environment=environment(command))


async def _alternate(stages: dict, spec: LoadSpec, repeats: int, log: Callable[[str], None]) -> list[dict]:
    warm = LoadSpec(**{**asdict(spec), "requests": min(spec.requests, 24)})
    for stage in stages.values():  # both step counts and several batch sizes once, before anything is timed
        await run_schedule(stage, poisson_schedule(warm, seed=-1))
    runs = []
    for repeat, order in enumerate(mode_orders(list(stages), repeats)):
        schedule = poisson_schedule(spec, seed=spec.seed + repeat)
        for mode in order:
            run = await run_schedule(stages[mode], schedule)
            runs.append({"repeat": repeat, "mode": mode, "schedule_seed": spec.seed + repeat, **run})
            log(_run_line(runs[-1]))
    return runs


def _run_line(run: dict) -> str:
    classes = ", ".join(f"{k} p50 {c['p50_s']:.3f}s p95 {c['p95_s']:.3f}s" for k, c in run["classes"].items())
    return f"[bench] repeat {run['repeat']} {run['mode']:>7}: {classes}, {run['images_per_s']} images/s"


def summarize(
    runs: list[dict], *, spec: LoadSpec, modes: Sequence[str], repeats: int, setup: dict, environment: dict
) -> dict:
    """Per mode: min/median/max over repeats; ratios paired by repeat; bytes compared across modes."""
    metrics = {f"{kind}_{q}_s": (kind, f"{q}_s") for kind in CLASSES for q in ("p50", "p95")}
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in modes}
    summary = {}
    for mode, mode_runs in by_mode.items():
        summary[mode] = {
            name: spread([r["classes"][k][q] for r in mode_runs if k in r["classes"]])
            for name, (k, q) in metrics.items()
            if any(k in r["classes"] for r in mode_runs)
        }
        summary[mode]["images_per_s"] = spread([r["images_per_s"] for r in mode_runs])
    report = {
        "kind": "mixed-load",
        "load": {**asdict(spec), "repeats": repeats, "modes": list(modes)},
        "stage": setup,
        "runs": [{k: v for k, v in r.items() if k != "sha256"} for r in runs],
        "summary": summary,
        "environment": environment,
    }
    if set(MODES) <= set(modes):
        report["ratios"], report["targets"] = ratios(by_mode)
    if {"step", BY_SHAPE} <= set(modes):
        report["packing"] = ratios(by_mode, other=BY_SHAPE)[0]
    if len(modes) > 1:
        report["bytes"] = compare_bytes(by_mode)
    return report


def ratios(by_mode: dict[str, list[dict]], other: str = "request") -> tuple[dict, dict]:
    """other/step latency (how many times lower with the step engine, or with its size packing against BY_SHAPE)
    and step/other images/s, per repeat."""
    pairs = list(zip(by_mode["step"], by_mode[other], strict=False))
    found = {}
    for kind in CLASSES:
        for q in ("p50", "p95"):
            values = [
                req["classes"][kind][f"{q}_s"] / step["classes"][kind][f"{q}_s"]
                for step, req in pairs
                if kind in step["classes"] and kind in req["classes"]
            ]
            if values:
                found[f"{kind}_{q}_{other}_over_step"] = spread(values, 2)
    found[f"images_per_s_step_over_{other}"] = spread(
        [step["images_per_s"] / req["images_per_s"] for step, req in pairs]
    )
    targets = {  # the step engine's own (issue 11), against request batching
        "short_p95_at_least_3x_lower": found.get(f"short_p95_{other}_over_step", {}).get("median", 0) >= 3.0,
        "images_per_s_not_lower": found[f"images_per_s_step_over_{other}"]["median"] >= 1.0,
    }
    return found, targets


def compare_bytes(by_mode: dict[str, list[dict]]) -> dict[str, int]:
    """Same schedule, same seeds: with invariance on, every image's sha256 must match across modes (each mode's
    run against the first mode's run of the same repeat)."""
    compared = differing = 0
    first, *others = by_mode.values()
    for runs in others:
        for one, another in zip(first, runs, strict=False):
            compared += len(one["sha256"])
            differing += sum(a != b for a, b in zip(one["sha256"], another["sha256"], strict=False))
    return {"compared": compared, "differing": differing}


# --- rendering the report ------------------------------------------------------------------------------


def _cell(value: dict) -> str:
    return f"{value['median']:.3f} ({value['min']:.3f}-{value['max']:.3f})"


def markdown(report: dict) -> str:
    """Per mode, median (min-max) over repeats; then the ratios and the targets."""
    env, load, stage = report["environment"], report["load"], report["stage"]
    lines = [
        f"Load: Poisson, {load['rate']} requests/s, {load['requests']} requests per run, {load['short_fraction']:.0%} short "
        f"({load['short_steps']} steps, {load['size']}px) / long ({load['long_steps']} steps, "
        f"{load.get('long_size') or load['size']}px), "
        f"{load['repeats']} repeats, modes alternating. Stage: {stage['model']}, invariance on, max_batch_size "
        f"{stage['max_batch_size']}, torch threads {stage['torch_threads']}.",
        f"Hardware: {env['hardware']['cpu']}, {env['hardware']['usable_cpus']} usable CPUs. Command: `{env['command']}`",
        "",
        "| mode | short p50 s | short p95 s | long p50 s | long p95 s | images/s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in report["summary"].items():
        cells = [
            _cell(s[m]) if m in s else "-"
            for m in ("short_p50_s", "short_p95_s", "long_p50_s", "long_p95_s", "images_per_s")
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines.append("\nCells: median (min-max) over repeats.")
    if "ratios" in report:
        lines += ["", "| ratio (paired by repeat) | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['median']} | {v['min']} | {v['max']} |" for name, v in report["ratios"].items()]
        lines += [
            "",
            "Targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items()) + ".",
        ]
    if "packing" in report:
        lines += ["", "| size packing: ratio (paired by repeat) | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['median']} | {v['min']} | {v['max']} |" for name, v in report["packing"].items()]
    if "bytes" in report:
        lines.append(
            f"\nBytes: {report['bytes']['differing']} of {report['bytes']['compared']} images differ between modes."
        )
    return "\n".join(lines) + "\n"


def picture(report: dict, path: str) -> None:
    """Bars of p95 (and p50) latency per class and mode, medians with min-max whiskers; images/s in the legend."""

    colours = {"step": COLOURS[0], "request": COLOURS[1], BY_SHAPE: COLOURS[2]}
    summary = report["summary"]
    modes = list(summary)
    groups = [(kind, q) for kind in CLASSES for q in ("p50", "p95") if f"{kind}_{q}_s" in summary[modes[0]]]
    top = max(summary[m][f"{k}_{q}_s"]["max"] for m in modes for k, q in groups) or 1.0
    load, bar = report["load"], 40
    chart = Chart(
        120 + 150 * len(groups),
        360,
        f"latency (s) per class: Poisson {load['rate']}/s, {load['short_fraction']:.0%} short "
        f"({load['short_steps']} steps, {load['size']}px) / long ({load['long_steps']}, "
        f"{load.get('long_size') or load['size']}px); median of "
        f"{load['repeats']} repeats, whiskers min-max",
        low=0.0,
        high=top,
    )
    for g, (kind, q) in enumerate(groups):
        x0 = chart.left + 20 + g * 150
        for m, mode in enumerate(modes):
            s = summary[mode][f"{kind}_{q}_s"]
            x = x0 + m * (bar + 6)
            chart.draw.rectangle(
                [x, chart.y(s["median"]), x + bar, chart.base], fill=colours.get(mode, (120, 120, 120))
            )
            chart.whisker(x + bar // 2, s["min"], s["max"])
            chart.draw.text((x, chart.y(s["median"]) - 14), f"{s['median']:.2f}", fill="black")
        chart.draw.text((x0, chart.base + 8), f"{kind} {q}", fill="black")
    for m, mode in enumerate(modes):
        chart.legend(
            m, f"{mode}: {summary[mode]['images_per_s']['median']:.2f} images/s", colours.get(mode, (120, 120, 120))
        )
    chart.save(path)
