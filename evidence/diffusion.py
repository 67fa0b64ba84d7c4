"""The diffusion audit: does a request's output change with what it is batched with?

For each model, a target request runs solo and co-batched (target first, last, middle,
reversed, shuffled, a neighbour's prompt mutated; batch sizes 1 to 8), with kernels off
(the control) and on, through one of the stage's two paths:
  engine    the step engine that serves (`stages.diffusion.engine`): the neighbours also differ in step count and
            guidance, so they leave while the target runs on and share its forwards at other timesteps (and, for a
            family that packs sizes, FLUX, every other one is twice the target's side: the same calls, padded);
  pipeline  the diffusers pipeline itself on a whole-request batch of one key (request-level batching).
Compared bit for bit: initial latents, final latents and decoded pixels; for a video family also the encoded MP4 and
the VAE's decode schedules (`evidence.video`). On a mismatch on the pipeline
path the audit names the first module whose output for the target diverges (forward hooks comparing
per-sample outputs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from contracts.config import DiffusionStageConfig
from contracts.sampling import DiffusionSamplingParams
from evidence.record import scope_entry
from evidence.report import environment, summarize
from evidence.video import file_bytes, is_video, schedules_run
from stages.diffusion import DiffusionRenderer, Job
from stages.diffusion.engine import Sample as Item
from stages.diffusion.engine import StepEngine
from stages.embedded import embedded_models
from stages.kernels import disable_batch_invariant_kernels
from stages.scope import diffusion_configuration

TARGET = ("a red fox in the snow, watercolor", 42)
NEIGHBOURS = [
    ("a lighthouse at dusk, oil painting", 7),
    ("two cats asleep on a windowsill", 99),
    ("a bowl of ramen, studio light", 1234),
    ("mountains under a starry sky", 5),
    ("a vintage car in the rain", 31337),
    ("a watercolor map of an island", 2024),
    ("macro photo of a dew drop on a leaf", 8),
]
ORDERINGS = ("first", "middle", "last", "reversed", "shuffled", "mutated-neighbour")


@dataclass
class Sample:
    initial_latents: torch.Tensor
    final_latents: torch.Tensor
    pixels: torch.Tensor


def stock_renderer(
    model: str, *, batch_invariant: bool, dtype: str = "float32", torch_threads: int | None = None
) -> DiffusionRenderer:
    """The stage's own renderer, from stock kernels; it installs the kernels itself when `batch_invariant`.

    torch_threads=None: torch's own thread count, as the audit and the benchmark have always measured.
    """
    disable_batch_invariant_kernels()
    config = DiffusionStageConfig(
        model=model, batch_invariant=batch_invariant, dtype=dtype, torch_threads=torch_threads
    )
    return DiffusionRenderer(config)


def batches(batch_sizes: Sequence[int], orderings: Sequence[str]) -> list[tuple[str, list[tuple[str, int]], int]]:
    """(ordering, requests, target index) for every audited arrangement."""
    plans = []
    for size in batch_sizes:
        others = NEIGHBOURS[: size - 1]
        for ordering in orderings if size > 1 else ("solo",):
            if ordering == "solo":
                order = [TARGET]
            elif ordering == "first":
                order = [TARGET, *others]
            elif ordering == "last":
                order = [*others, TARGET]
            elif ordering == "middle":
                order = [*others[: size // 2], TARGET, *others[size // 2 :]]
            elif ordering == "reversed":
                order = list(reversed([*others[: size // 2], TARGET, *others[size // 2 :]]))
            elif ordering == "shuffled":
                order = [TARGET, *others]
                random.Random(size).shuffle(order)
            elif ordering == "mutated-neighbour":
                mutated = [(prompt + ", mutated", seed + 1) for prompt, seed in others]
                order = [*mutated[: size // 2], TARGET, *mutated[size // 2 :]]
            else:
                raise ValueError(f"unknown ordering {ordering!r}")
            plans.append((ordering, order, order.index(TARGET)))
    return plans


def render(
    renderer: DiffusionRenderer, requests: list[tuple[str, int]], params: DiffusionSamplingParams
) -> list[Sample]:
    """Run the requests through the stage's renderer as request batching queues them: one batch per request group
    (`DiffusionRenderer.request_group`: all of them, but for Qwen-Image, whose prompts batch by token count)."""
    jobs = [Job(prompt, params.model_copy(update={"seed": seed})) for prompt, seed in requests]
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, job in enumerate(jobs):
        groups.setdefault(renderer.request_group(job), []).append(index)
    samples: dict[int, Sample] = {}
    for members in groups.values():
        samples.update(zip(members, _render_batch(renderer, [jobs[i] for i in members]), strict=True))
    return [samples[i] for i in range(len(jobs))]


def _render_batch(renderer: DiffusionRenderer, jobs: list[Job]) -> list[Sample]:
    """Run one batch through the stage's renderer, capturing initial and final latents per sample."""
    captured: dict[str, torch.Tensor] = {}
    pipe = renderer.pipe
    original = pipe.prepare_latents

    def prepare_latents(*args, **kwargs):
        latents = original(*args, **kwargs)
        captured["initial"] = (latents[0] if isinstance(latents, tuple) else latents).detach().clone()
        return latents

    def on_step_end(_pipe, step, _timestep, tensors):
        captured["final"] = tensors["latents"].detach().clone()
        return tensors

    pipe.prepare_latents = prepare_latents
    try:
        images = renderer.render(jobs, callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
    finally:
        del pipe.prepare_latents
    pixels = torch.from_numpy(images)
    return [Sample(captured["initial"][i], captured["final"][i], pixels[i]) for i in range(len(jobs))]


#: Engine path: what each neighbour changes besides prompt and seed (step count as a fraction of the target's).
ENGINE_VARIANTS = ({"steps": 0.5, "guidance_scale": 1.0}, {"steps": 1.5}, {"steps": 1.0, "guidance_scale": 9.0})


def render_engine(
    renderer: DiffusionRenderer, requests: list[tuple[str, int]], params: DiffusionSamplingParams
) -> list[Sample]:
    """Run the requests through the step engine together; the target (the params' request) keeps `params`."""

    assert renderer.family is not None  # the audited models' pipelines are ones the step engine knows
    engine = StepEngine(renderer.family, max_batch_size=len(requests), torch_threads=renderer.torch_threads)
    items = []
    for index, (prompt, seed) in enumerate(requests):
        fields: dict[str, Any] = {"seed": seed}
        if (prompt, seed) != TARGET:
            variant = dict(ENGINE_VARIANTS[index % len(ENGINE_VARIANTS)])
            steps = cast(int, params.num_inference_steps)  # resolved params: set
            fields["num_inference_steps"] = max(1, round(steps * variant.pop("steps")))
            fields.update(variant)
            if renderer.capabilities.true_cfg and "guidance_scale" in variant:
                # FLUX, Qwen-Image: the second guidance branch (on a negative prompt) in the same call.
                fields.update(negative_prompt="blurry, dark", true_cfg_scale=variant["guidance_scale"])
            if renderer.family.packs_sizes and index % 2:  # FLUX, Qwen-Image: every other neighbour twice the side
                fields.update(height=2 * cast(int, params.height), width=2 * cast(int, params.width))
        items.append(Item(prompt, params.model_copy(update=fields), on_done=None))
    initial: dict[int, torch.Tensor] = {}
    prepare = renderer.family.prepare

    def capture(item) -> None:
        prepare(item)
        initial[id(item)] = item.latents.detach().clone()

    # This instance's own, for this render only (`del` below uncovers the method again).
    renderer.family.prepare = capture  # type: ignore[method-assign,assignment]
    try:
        images = engine.render(items)
    finally:
        del renderer.family.prepare
        engine.stop()
    return [
        Sample(initial[id(item)][0], item.latents[0].detach().clone(), torch.from_numpy(image))
        for item, image in zip(items, images, strict=False)
    ]


RENDER_PATHS = {"engine": render_engine, "pipeline": render}


def compare(reference: Sample, other: Sample) -> dict:
    counts: dict[str, float] = {}
    for name in ("initial_latents", "final_latents", "pixels"):
        a, b = getattr(reference, name), getattr(other, name)
        counts[f"{name}_differing"] = int((a != b).sum())
        counts[f"{name}_total"] = a.numel()
        if name == "pixels":
            counts["max_abs_diff"] = float((a.double() - b.double()).abs().max())
    counts["differing_elements"] = sum(counts[f"{n}_differing"] for n in ("initial_latents", "final_latents", "pixels"))
    counts["total_elements"] = sum(counts[f"{n}_total"] for n in ("initial_latents", "final_latents", "pixels"))
    if is_video(reference.pixels):  # and the file a client downloads: one element, its bytes equal or not
        counts["file_differing"] = int(file_bytes(reference.pixels) != file_bytes(other.pixels))
        counts["differing_elements"] += counts["file_differing"]
        counts["total_elements"] += 1
    return counts


def first_divergent_module(
    renderer: DiffusionRenderer, order: list[tuple[str, int]], target: int, params
) -> str | None:
    """The first module (in execution order) whose output for the target differs solo vs in `order`."""

    def trace(requests, position) -> list[tuple[str, torch.Tensor]]:
        calls: dict[str, int]
        size, records, calls, hooks = len(requests), [], {}, []

        def hook_for(name):
            def hook(_module, _inputs, output):
                tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
                tensor = getattr(tensor, "last_hidden_state", tensor)
                if not torch.is_tensor(tensor) or tensor.dim() == 0:
                    return
                if tensor.shape[0] == size:
                    rows = tensor[position : position + 1]
                elif tensor.shape[0] == 2 * size:  # classifier-free guidance doubles the batch
                    rows = torch.cat([tensor[position : position + 1], tensor[size + position : size + position + 1]])
                else:
                    return
                index = calls[name] = calls.get(name, -1) + 1
                records.append((f"{name}#{index}", rows.detach().float().clone()))

            return hook

        for component, module in renderer.pipe.components.items():
            if isinstance(module, torch.nn.Module):
                for sub, child in module.named_modules():
                    hooks.append(child.register_forward_hook(hook_for(f"{component}.{sub}" if sub else component)))
        try:
            render(renderer, requests, params)
        finally:
            for handle in hooks:
                handle.remove()
        return records

    solo = dict(trace([order[target]], 0))
    for name, rows in trace(order, target):
        reference = solo.get(name)
        if reference is not None and reference.shape == rows.shape and not torch.equal(reference, rows):
            return name.split("#")[0]
    return None


def _run_row(model: str, setting: str, ordering: str, order: list, target: int, **held: Any) -> dict:
    """One run's row of the report, before its counts."""
    size, steps, path = held["size"], held["steps"], held["path"]
    return {
        "stage": "diffusion",
        "model": model,
        "kernels": setting,
        "ordering": ordering,
        "batch_size": len(order),
        "target_position": target,
        "dtype": held["dtype"],
        "detail": f"{size}x{size}, {steps} steps, {path}",
        "path": path,
    }


def audit_model(
    model: str,
    *,
    kernels: Sequence[str] = ("off", "on"),
    batch_sizes: Sequence[int] = tuple(range(1, 9)),
    orderings: Sequence[str] = ORDERINGS,
    dtype: str = "float32",
    steps: int = 8,
    size: int = 64,
    path: str = "engine",
    locate: bool = True,
    log: Callable[[str], None] = print,
    torch_threads: int | None = None,
    scope: list[dict] | None = None,
) -> tuple[list[dict], dict[str, list[Sample | None]]]:
    """All runs for one model; also returns (solo, co-batched) samples of the worst run per setting, for pictures.

    `scope`, when given, receives the kernels-on configuration (`evidence.record.scope_entry`)."""
    runs: list[dict] = []
    examples: dict[str, list[Sample | None]] = {}  # (solo, the worst co-batched; None: none ran)
    plans, held = batches(batch_sizes, orderings), {"dtype": dtype, "size": size, "steps": steps, "path": path}
    render_path = RENDER_PATHS[path]
    locate = locate and path == "pipeline"  # module hooks see one request's rows only on the pipeline path
    for setting in kernels:  # each setting starts from stock kernels
        renderer = stock_renderer(model, batch_invariant=setting == "on", dtype=dtype, torch_threads=torch_threads)
        if setting == "on" and scope is not None:
            batching = "step" if path == "engine" else "request"
            scope.append(
                scope_entry(model, diffusion_configuration(renderer, batching), sizes=[f"{size}x{size}"], steps=steps)
            )
        params = renderer.resolve(
            DiffusionSamplingParams(seed=TARGET[1], num_inference_steps=steps, height=size, width=size)
        )
        solo = render_path(renderer, [TARGET], params)[0]
        if is_video(solo.pixels):  # the VAE's decode schedules, on the target's own latents
            runs.append(schedules_run(renderer.family, solo, _run_row(model, setting, "", [TARGET], 0, **held), log))
        worst: tuple[int, Sample | None] = (-1, None)
        for ordering, order, target in plans:
            sample = render_path(renderer, order, params)[target]
            counts = compare(solo, sample)
            run = _run_row(model, setting, ordering, order, target, **held)
            run.update(counts)
            # Locating costs two traced renders: do it for every failure with kernels on, and once
            # per model for the control (where every arrangement diverges at the same place).
            located = any(
                "first_divergent_module" in r for r in runs if r["model"] == model and r["kernels"] == setting
            )
            if counts["differing_elements"] and locate and (setting == "on" or not located):
                run["first_divergent_module"] = first_divergent_module(renderer, order, target, params)
            runs.append(run)
            if counts["differing_elements"] > worst[0]:
                worst = (counts["differing_elements"], sample)
            log(
                f"[diffusion audit] {model} kernels={setting} batch={len(order)} {ordering}: "
                f"{counts['differing_elements']}/{counts['total_elements']} differ"
                + (f" (first at {run['first_divergent_module']})" if "first_divergent_module" in run else "")
            )
        examples[setting] = [solo, worst[1]]
    disable_batch_invariant_kernels()
    return runs, examples


def picture(examples: dict[str, list[Sample | None]], path: str, scale: int = 4) -> None:
    """PNG: solo | co-batched | |difference| heatmap; control row over invariant row; one colour scale."""
    from PIL import Image, ImageDraw

    # The solo sample is always there; a pair with its co-batched one too is drawn.
    rows = [(setting, cast(list[Sample], pair)) for setting, pair in examples.items() if pair[1] is not None]
    diffs = {setting: (pair[0].pixels.double() - pair[1].pixels.double()).abs().amax(-1) for setting, pair in rows}
    top = max((float(d.max()) for d in diffs.values()), default=0.0) or 1.0
    height, width = rows[0][1][0].pixels.shape[:2]
    tile_w, tile_h, label_h = width * scale, height * scale, 14
    canvas = Image.new("RGB", (3 * tile_w, len(rows) * (tile_h + label_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (setting, (solo, batched)) in enumerate(rows):
        heat = (diffs[setting] / top * 255).round().to(torch.uint8).numpy()
        tiles = [
            Image.fromarray((solo.pixels.numpy() * 255).round().clip(0, 255).astype("uint8")),
            Image.fromarray((batched.pixels.numpy() * 255).round().clip(0, 255).astype("uint8")),
            Image.merge("RGB", [Image.fromarray(heat), Image.fromarray(heat * 0), Image.fromarray(255 - heat)]),
        ]
        y = r * (tile_h + label_h)
        draw.text(
            (2, y),
            f"kernels {setting}: solo | co-batched | |diff| (max {float(diffs[setting].max()):.2e}, scale {top:.2e})",
            fill="black",
        )
        for c, tile in enumerate(tiles):
            canvas.paste(tile.resize((tile_w, tile_h), Image.Resampling.NEAREST), (c * tile_w, y + label_h))
    canvas.save(path)


def run_diffusion_audit(
    models: Sequence[str] = embedded_models("diffusion"),
    *,
    picture_path: str | None = None,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
    **options,
) -> dict:
    """Audit every model; returns {"runs": [...], "summary": {...}, "environment": {...}}."""

    runs: list[dict] = []
    first_examples: dict[str, list[Sample | None]] | None = None
    scope: list[dict] = []
    for model in models:
        model_runs, examples = audit_model(model, log=log, scope=scope, **options)
        runs += model_runs
        first_examples = first_examples or examples
    if picture_path and first_examples:
        picture(first_examples, picture_path)
    return {"runs": runs, "summary": summarize(runs), "environment": environment(command), "scope": scope}
