"""Step caching's speed and what it costs the pictures (`omniserve bench --stage diffusion --cache off,0.1,0.2`).

On the step engine in this process (invariance on, one model at a time): for each step count, each cache setting
("off" or a TeaCache threshold) renders the same requests under two loads, the settings alternating in rotated order
within each repeat (a shared, noisy machine: off and on are measured side by side):
- burst: every request submitted at once (a saturating burst; the engine batches up to `max_batch_size`);
- mixed: Poisson arrivals of short and long requests (bench/load.py's schedule; short ones at `short_steps`).
Per setting: images/s (and its ratio to "off" per repeat: min/median/max), the mean steps whose denoiser call held
each image's rows, and the pictures against the uncached ones of the same requests: PSNR and SSIM (Gaussian 11x11,
sigma 1.5, per channel), and on the shapes model (the default) the semantic hit rates of issue 15's tests: the shape's
colour on the background asked for (`drawn_as_said`) and the shape where the prompt puts it (nearest anchor to its
centroid). Each cached image's bytes are also checked against the same request's in every other repeat.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from bench.load import LoadSpec, poisson_schedule, spread
from contracts.config import DiffusionStageConfig
from contracts.sampling import DiffusionSamplingParams, StepCache
from evidence.report import environment
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import Sample, StepEngine
from stages.embedded import DEFAULT_MODELS
from stages.embedded.shapes import POSITIONS, SIZES
from training.scenes import CENTRE, HELD_OUT, Scene, centroid, drawn_as_said

OFF = "off"


def policy(setting: str) -> StepCache | None:
    return None if setting == OFF else StepCache(method="teacache", threshold=float(setting))


def scenes(count: int, seed: int = 0) -> list[tuple[Scene, str]]:
    """Held-out scenes of the shapes model with one of their captions (what the semantic rates read)."""
    rng = random.Random(seed)
    held = sorted(HELD_OUT)
    picked = []
    for i in range(count):
        shape, colour, background = held[i % len(held)]
        scene = Scene(shape, colour, background, rng.choice(SIZES), rng.choice(POSITIONS))
        picked.append((scene, scene.caption(rng)))
    return picked


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004) of two float HxWx3 images in [0, 1]: Gaussian 11x11 window, sigma 1.5."""
    x, y = (torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).permute(2, 0, 1)[:, None] for v in (a, b))
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]
    mean = lambda t: torch.nn.functional.conv2d(t, window)  # noqa: E731
    mx, my = mean(x), mean(y)
    vx, vy, cov = mean(x * x) - mx**2, mean(y * y) - my**2, mean(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(value.mean())


def hits(image: np.ndarray, scene: Scene) -> tuple[bool, bool]:
    """(colour on the background asked for, shape where asked): issue 15's pixel statistics."""
    uint8 = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    cx, cy = centroid(uint8, scene.background)
    nearest = min(CENTRE, key=lambda p: (CENTRE[p][0] - cx) ** 2 + (CENTRE[p][1] - cy) ** 2)
    return drawn_as_said(uint8, scene), nearest == scene.position


class Run:
    """One setting's requests through the engine: (images, steps computed, seconds, latencies by class)."""

    def __init__(self, renderer: DiffusionRenderer, engine: StepEngine):
        self.renderer, self.engine = renderer, engine

    def sample(self, prompt: str, seed: int, steps: int, setting: str) -> Sample:
        params = DiffusionSamplingParams(seed=seed, num_inference_steps=steps, cache=policy(setting))
        return Sample(prompt, self.renderer.resolve(params, step_engine=True), on_done=None)

    def burst(self, requests: Sequence[tuple[str, int, int]], setting: str) -> dict:
        samples = [self.sample(p, seed, steps, setting) for p, seed, steps in requests]
        started = time.monotonic()
        images = self.engine.render(samples)
        wall = time.monotonic() - started
        return {"images": images, "computed": [s.steps_computed for s in samples], "wall_s": wall}

    def scheduled(self, arrivals: Sequence[Any], prompts: Sequence[str], setting: str) -> dict:
        """Each arrival submitted at its time (a feeder thread); latency from its arrival to its image."""
        done = threading.Semaphore(0)
        finished: dict[int, float] = {}
        samples = [self.sample(prompts[a.index % len(prompts)], a.seed, a.steps, setting) for a in arrivals]
        started = time.monotonic()

        def finish(index: int, result: Any) -> None:
            finished[index] = time.monotonic() - started
            done.release()

        for index, (arrival, sample) in enumerate(zip(arrivals, samples, strict=True)):
            sample.on_done = lambda result, index=index: finish(index, result)
            time.sleep(max(0.0, arrival.at - (time.monotonic() - started)))
            self.engine.submit(sample)
        for _ in samples:
            done.acquire()
        latency = {
            kind: [finished[i] - a.at for i, a in enumerate(arrivals) if a.kind == kind] for kind in ("short", "long")
        }
        wall = max(finished.values()) - arrivals[0].at
        return {
            "images_per_s": round(len(samples) / wall, 3),
            "p50_s": {k: round(statistics.median(v), 3) for k, v in latency.items() if v},
            "mean_steps_computed": round(statistics.mean(s.steps_computed for s in samples), 2),
        }


def quality(images: list[np.ndarray], reference: list[np.ndarray], picked: Sequence[tuple[Any, str]] | None) -> dict:
    out: dict[str, Any] = {
        "psnr_db": spread([min(psnr(a, b), 99.0) for a, b in zip(images, reference, strict=True)], 2),
        "ssim": spread([ssim(a, b) for a, b in zip(images, reference, strict=True)], 4),
    }
    if picked is not None:
        said = [hits(image, scene) for image, (scene, _) in zip(images, picked, strict=True)]
        out["colour_hit_rate"] = round(sum(c for c, _ in said) / len(said), 3)
        out["position_hit_rate"] = round(sum(p for _, p in said) / len(said), 3)
    return out


def bench_model(
    model: str,
    settings: Sequence[str],
    steps_list: Sequence[int],
    *,
    images: int,
    repeats: int,
    spec: LoadSpec,
    max_batch_size: int,
    torch_threads: int,
    log: Callable[[str], None],
) -> dict:
    renderer = DiffusionRenderer(DiffusionStageConfig(model=model, batch_invariant=True, torch_threads=torch_threads))
    assert renderer.family is not None, f"{model}: the step engine has no family for it"
    engine = StepEngine(renderer.family, max_batch_size=max_batch_size, torch_threads=torch_threads)
    run = Run(renderer, engine)
    is_shapes = renderer.model == DEFAULT_MODELS["diffusion"]  # the trained shapes model: semantic rates apply
    picked = scenes(images)
    prompts = [caption for _, caption in picked]
    report: dict[str, Any] = {"model": renderer.model, "points": []}
    try:
        run.burst([(prompts[0], 0, 2)], OFF)  # warm
        for steps in steps_list:
            requests = [(p, 1000 + i, steps) for i, p in enumerate(prompts)]
            burst: dict[str, list[dict]] = {s: [] for s in settings}
            mixed: dict[str, list[dict]] = {s: [] for s in settings}
            mixed_spec = LoadSpec(**{**spec.__dict__, "long_steps": steps})
            for repeat in range(repeats):
                order = list(settings[repeat % len(settings) :]) + list(settings[: repeat % len(settings)])
                for setting in order:
                    burst[setting].append(run.burst(requests, setting))
                    mixed[setting].append(run.scheduled(poisson_schedule(mixed_spec, seed=repeat), prompts, setting))
                    log(
                        f"[bench cache] {renderer.model} {steps} steps, repeat {repeat}, {setting}: burst "
                        f"{len(requests) / burst[setting][-1]['wall_s']:.2f} images/s, mixed "
                        f"{mixed[setting][-1]['images_per_s']} images/s"
                    )
            report["points"].append(_point(steps, settings, burst, mixed, picked if is_shapes else None))
    finally:
        engine.stop()
    return report


def _point(steps: int, settings: Sequence[str], burst: dict, mixed: dict, picked) -> dict:
    reference = burst[OFF][0]["images"]
    rows = {}
    for setting in settings:
        runs = burst[setting]
        same = all(np.array_equal(a, b) for r in runs[1:] for a, b in zip(r["images"], runs[0]["images"], strict=True))
        rate = [len(r["images"]) / r["wall_s"] for r in runs]
        ratio = [
            len(r["images"]) / r["wall_s"] / (len(o["images"]) / o["wall_s"])
            for r, o in zip(runs, burst[OFF], strict=True)
        ]
        mixed_ratio = [m["images_per_s"] / o["images_per_s"] for m, o in zip(mixed[setting], mixed[OFF], strict=True)]
        rows[setting] = {
            "burst_images_per_s": spread(rate),
            "burst_ratio_to_off": spread(ratio),
            "mean_steps_computed": round(statistics.mean(runs[0]["computed"]), 2),
            "mixed_images_per_s": spread([m["images_per_s"] for m in mixed[setting]]),
            "mixed_ratio_to_off": spread(mixed_ratio),
            "mixed_p50_s": mixed[setting][0]["p50_s"],
            "mixed_mean_steps_computed": mixed[setting][0]["mean_steps_computed"],
            "same_bytes_every_repeat": same,
            **quality(runs[0]["images"], reference, picked),
        }
    return {"steps": steps, "settings": rows}


def run_cache_bench(
    models: Sequence[str],
    settings: Sequence[str],
    *,
    steps_list: Sequence[int] = (50, 8),
    images: int = 16,
    repeats: int = 3,
    spec: LoadSpec | None = None,
    max_batch_size: int = 8,
    torch_threads: int = 2,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:

    settings = [OFF, *[s for s in settings if s != OFF]]
    spec = spec or LoadSpec(rate=2.0, requests=24, short_steps=8)
    return {
        "benchmark": "step caching (TeaCache's rule per sample), off vs thresholds, alternating",
        "setup": {
            "images": images,
            "repeats": repeats,
            "max_batch_size": max_batch_size,
            "torch_threads": torch_threads,
            "mixed_load": {**spec.__dict__, "long_steps": "each point's steps"},
            "batch_invariant": True,
        },
        "models": [
            bench_model(
                m,
                settings,
                steps_list,
                images=images,
                repeats=repeats,
                spec=spec,
                max_batch_size=max_batch_size,
                torch_threads=torch_threads,
                log=log,
            )
            for m in models
        ],
        "environment": environment(command),
    }


def markdown(report: dict) -> str:
    lines = [f"# {report['benchmark']}", "", f"setup: {report['setup']}", ""]
    for model in report["models"]:
        for point in model["points"]:
            lines += [
                f"## {model['model']}, {point['steps']} steps",
                "",
                "| cache | burst images/s (ratio to off, min/med/max) | steps computed | mixed-load ratio | PSNR dB "
                "(min/med) | SSIM (min/med) | colour / position hits | same bytes each repeat |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for setting, row in point["settings"].items():
                semantic = f"{row['colour_hit_rate']} / {row['position_hit_rate']}" if "colour_hit_rate" in row else "-"
                r, m = row["burst_ratio_to_off"], row["mixed_ratio_to_off"]
                lines.append(
                    f"| {setting} | {row['burst_images_per_s']['median']} ({r['min']}/{r['median']}/{r['max']}) | "
                    f"{row['mean_steps_computed']} | {m['min']}/{m['median']}/{m['max']} | "
                    f"{row['psnr_db']['min']}/{row['psnr_db']['median']} | {row['ssim']['min']}/{row['ssim']['median']} | "
                    f"{semantic} | {row['same_bytes_every_repeat']} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"
