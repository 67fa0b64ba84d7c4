"""Memory of a diffusion replica under many distinct batch keys: RSS before and after N distinct `guidance_scale` values.

Request-level batching keeps one `@serve.batch` queue (and its task) per batch key forever; the step engine keeps
nothing per key. Each mode runs in a fresh process of its own (spawned), so that one mode's heap never counts
against the other: a DiffusionStage (invariance on) is warmed up with `warm_up` requests, then sent `requests`
1-step requests, each with a `guidance_scale` no other request used, by `concurrency` clients that drop every
result. RSS (psutil) is read after `gc.collect()` at every `checkpoint` requests; at the start and the end
also after `malloc_trim(0)` (glibc), which returns freed heap to the OS and so shows what is really kept.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any

from bench.load import open_stage, outside_serve
from contracts.jobs import RenderJob, final_image
from contracts.sampling import DiffusionSamplingParams
from evidence.report import environment


@dataclass(frozen=True)
class MemorySpec:
    """`requests` requests, each with a guidance scale of its own, after `warm_up` ones; RSS every `checkpoint`."""

    requests: int = 10_000
    warm_up: int = 500
    concurrency: int = 16  # clients sending at once
    steps: int = 1
    size: int = 64
    checkpoint: int = 1_000


def guidance(index: int) -> float:
    """A different guidance scale for every request index (all above 1: classifier-free guidance on)."""
    return round(1.0 + (index + 1) / 1000, 3)


def rss_mib(*, trim: bool = False) -> float:
    import psutil

    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return round(psutil.Process().memory_info().rss / 2**20, 1)


async def send_distinct(stage, indices: range, spec: MemorySpec) -> None:
    """`concurrency` clients take the next index in turn; every image is dropped as soon as it arrives."""
    pending = iter(indices)

    async def client() -> None:
        for index in pending:
            params: dict[str, Any] = {
                "seed": index,
                "num_inference_steps": spec.steps,
                "height": spec.size,
                "width": spec.size,
                "guidance_scale": guidance(index),
            }
            job = RenderJob(prompt=f"distinct guidance {index}", params=DiffusionSamplingParams(**params))
            await final_image(stage.render(job))

    await asyncio.gather(*(client() for _ in range(spec.concurrency)))


async def _measure(stage, spec: MemorySpec) -> dict:
    await send_distinct(stage, range(spec.warm_up), spec)
    before = {"rss_mib": rss_mib(), "rss_trimmed_mib": rss_mib(trim=True)}
    trace = [{"requests": 0, "rss_mib": before["rss_mib"]}]
    for first in range(0, spec.requests, spec.checkpoint):
        last = min(first + spec.checkpoint, spec.requests)
        await send_distinct(stage, range(spec.warm_up + first, spec.warm_up + last), spec)
        trace.append({"requests": last, "rss_mib": rss_mib()})
    after = {"rss_mib": trace[-1]["rss_mib"], "rss_trimmed_mib": rss_mib(trim=True)}
    return {
        "before": before,
        "after": after,
        "trace": trace,
        "stage_load": stage.batching.load(),
        "growth_mib": round(after["rss_mib"] - before["rss_mib"], 1),
        "growth_trimmed_mib": round(after["rss_trimmed_mib"] - before["rss_trimmed_mib"], 1),
    }


def measure_mode(mode: str, spec: MemorySpec, model: str | None = None, torch_threads: int | None = None) -> dict:
    """One mode, in this process (call it in a fresh one)."""
    import time

    with outside_serve():
        stage = open_stage(mode, model=model, torch_threads=torch_threads)
        start = time.perf_counter()
        result = asyncio.run(_measure(stage, spec))
    return {"mode": mode, "model": stage.renderer.model, "seconds": round(time.perf_counter() - start, 1), **result}


def run_memory(
    spec: MemorySpec,
    *,
    modes: Sequence[str] = ("step", "request"),
    model: str | None = None,
    torch_threads: int | None = None,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:

    runs = []
    for mode in modes:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            runs.append(pool.submit(measure_mode, mode, spec, model, torch_threads).result())
        log(
            f"[bench] {mode}: RSS {runs[-1]['before']['rss_mib']} -> {runs[-1]['after']['rss_mib']} MiB "
            f"(+{runs[-1]['growth_mib']}; trimmed +{runs[-1]['growth_trimmed_mib']}) after {spec.requests} distinct guidance scales"
        )
    return {
        "kind": "distinct-guidance",
        "spec": asdict(spec),
        "runs": runs,
        "target_mib": 10,
        "met": {r["mode"]: r["growth_mib"] < 10 for r in runs},
        "environment": environment(command),
    }


def markdown(report: dict) -> str:
    spec, env = report["spec"], report["environment"]
    lines = [
        f"{spec['requests']} requests, each with its own guidance_scale, {spec['steps']}-step {spec['size']}x{spec['size']}, "
        f"{spec['concurrency']} concurrent clients, after {spec['warm_up']} warm-up requests; one fresh process per mode.",
        f"Hardware: {env['hardware']['cpu']}, {env['hardware']['usable_cpus']} usable CPUs. Command: `{env['command']}`",
        "",
        "| mode | RSS before MiB | RSS after MiB | growth MiB | growth after malloc_trim MiB | stage state after (`describe`) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        kept = ", ".join(f"{k} {v}" for k, v in r["stage_load"].items())
        lines.append(
            f"| {r['mode']} | {r['before']['rss_mib']} | {r['after']['rss_mib']} | {r['growth_mib']} | "
            f"{r['growth_trimmed_mib']} | {kept} | {r['seconds']} |"
        )
    lines.append("")
    lines.append(
        "RSS every {} requests (MiB): ".format(spec["checkpoint"])
        + "; ".join(f"{r['mode']}: " + " ".join(str(point["rss_mib"]) for point in r["trace"]) for r in report["runs"])
    )
    return "\n".join(lines) + "\n"
