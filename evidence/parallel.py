"""The parallel-render audit (`omniserve audit --stage diffusion --parallel cfg=2,sp=2`, issue 27 item 3): does one
image's bytes change with how many workers render it?

The diffusion audit's target request (its prompt and seed, guided) is rendered by one set of gloo workers
(`evidence.parallel_render`) on the single worker and on every grid the degrees allow (cfg alone, sp alone, both),
kernels off (the control: stock kernels) and on. Each grid's render is compared with the single worker's of the same
setting, bit for bit: final latents and decoded pixels. A grid's scope record (`--record`) carries its degree in its
configuration's engine (`{"batching": "step", "parallel": {"cfg": 2, "sp": 1}}`), so it matches a replica rendering
on that grid and never a single-worker one; like every record it needs its own control to have varied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from contracts.scope import Configuration
from evidence.diffusion import TARGET
from evidence.parallel_render import DEGREES, ParallelRender, render_parallel_runs
from evidence.record import scope_entry
from evidence.report import environment, summarize
from stages.embedded import EMBEDDED_MODELS

GUIDANCE = 5.0  # CFG parallel needs a guided request (guidance_scale above 1)
#: The models parallel rendering drives: the SD3 DiT family's embedded model(s).
DIT_MODELS = tuple(m.id for m in EMBEDDED_MODELS.values() if m.recipe == "dit")


def parse_degrees(text: str) -> tuple[int, int]:
    """`cfg=2,sp=2` (either may be left out: 1) -> (cfg, sp)."""
    degrees = {"cfg": 1, "sp": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in degrees or not value.isdigit() or int(value) not in DEGREES:
            raise ValueError(f"--parallel: expected cfg=N,sp=N with N in {DEGREES}, got {part!r}")
        degrees[name] = int(value)
    if degrees["cfg"] * degrees["sp"] == 1:
        raise ValueError("--parallel: name a degree above 1 (cfg=2, sp=2 or both)")
    return degrees["cfg"], degrees["sp"]


def grids(cfg: int, sp: int) -> tuple[tuple[int, int], ...]:
    """The single worker first (the reference), then every grid the degrees allow."""
    return tuple(dict.fromkeys([(1, 1), (cfg, 1), (1, sp), (cfg, sp)]))


def grid_name(cfg: int, sp: int) -> str:
    return "x".join(name for name in (f"cfg{cfg}" if cfg > 1 else "", f"sp{sp}" if sp > 1 else "") if name) or "one"


def _compare(reference: ParallelRender, other: ParallelRender) -> dict:
    latents = int((reference.latents != other.latents).sum())
    pixels = int((reference.image != other.image).sum())
    return {
        "final_latents_differing": latents,
        "pixels_differing": pixels,
        "differing_elements": latents + pixels,
        "total_elements": reference.latents.size + reference.image.size,
        "max_abs_diff": float(np.abs(reference.image.astype(np.float64) - other.image).max()),
        "target_digest": other.sha256,
        "reference_digest": reference.sha256,
    }


def _run(model: str, dtype: str, size: int, steps: int, reference: ParallelRender, render: ParallelRender) -> dict:
    name = grid_name(render.cfg, render.sp)
    return {
        "stage": "diffusion",
        "model": model,
        "kernels": "on" if render.kernels else "off",
        "ordering": "solo",
        "batch_size": 1,
        "target_position": 0,
        "dtype": dtype,
        "detail": f"{size}x{size}, {steps} steps, parallel {name} ({render.cfg * render.sp} workers)",
        "path": "parallel",
        "parallel": name,
        "bytes_per_step": render.bytes_per_step,
        "calls_per_step": render.calls_per_step,
        "denoise_s_per_step": render.denoise_s / render.steps,
        "reference_denoise_s_per_step": reference.denoise_s / reference.steps,
        **_compare(reference, render),
    }


def audit_parallel_model(
    model: str, cfg: int, sp: int, *, kernels: Sequence[str], dtype: str, steps: int, size: int, torch_threads: int
) -> tuple[list[dict], list[dict]]:
    """(the runs, the scope entries: one per parallel grid) of one model."""
    params = {
        "seed": TARGET[1],
        "num_inference_steps": steps,
        "height": size,
        "width": size,
        "guidance_scale": GUIDANCE,
    }
    renders = render_parallel_runs(
        model,
        TARGET[0],
        params,
        grids=grids(cfg, sp),
        kernels=tuple(setting == "on" for setting in kernels),
        torch_threads=torch_threads,
        dtype=dtype,
    )
    reference = {r.kernels: r for r in renders if (r.cfg, r.sp) == (1, 1)}
    parallel = [r for r in renders if r.cfg * r.sp > 1]
    runs = [_run(model, dtype, size, steps, reference[r.kernels], r) for r in parallel]
    entries = [
        {
            **scope_entry(model, Configuration.model_validate(r.configuration), sizes=[f"{size}x{size}"], steps=steps),
            "parallel": grid_name(r.cfg, r.sp),
        }
        for r in parallel
        if r.kernels
    ]
    return runs, entries


def run_parallel_audit(
    models: Sequence[str] = DIT_MODELS,
    *,
    cfg: int,
    sp: int,
    kernels: Sequence[str] = ("off", "on"),
    dtype: str = "float32",
    steps: int = 8,
    size: int = 64,
    torch_threads: int | None = None,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Every model's parallel audit, as the diffusion audit reports: {"runs", "summary", "environment", "scope"}."""

    runs: list[dict] = []
    scope: list[dict] = []
    for model in models:
        model_runs, entries = audit_parallel_model(
            model, cfg, sp, kernels=kernels, dtype=dtype, steps=steps, size=size, torch_threads=torch_threads or 1
        )
        for run in model_runs:
            log(
                f"[parallel audit] {model} kernels={run['kernels']} {run['parallel']}: "
                f"{run['differing_elements']}/{run['total_elements']} differ, {run['bytes_per_step']} bytes per step"
            )
        runs += model_runs
        scope += entries
    return {"runs": runs, "summary": summarize(runs), "environment": environment(command), "scope": scope}
