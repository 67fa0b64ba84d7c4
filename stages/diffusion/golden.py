"""Canonical requests and the bits they must give: the golden table (contracts/scope.py) from the torch side.

A column holds, for one configuration on one kernel path, the sha256 of each canonical request's output. The
same functions compute them for `omniserve golden --record` (which writes docs/evidence/golden.json), for
tests/test_golden.py (which renders them on whatever machine runs the suite) and for each replica at start-up
(its self-check, a second or so): a replica that reproduces its column computes the bits of the machine that
made it, so that machine's audit records cover it too (`contracts.scope.match`).

Diffusion cases, on the step engine: a target solo; the same target co-batched with two neighbours of other
step counts and guidance (it must give the solo bits, and the neighbours theirs); the second image of an n=2
request (its derived seed); an edit of a fixed procedural picture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from contracts.sampling import DiffusionSamplingParams
from contracts.scope import Configuration, SelfCheck, compare_golden, load_golden
from contracts.seeds import seed_for_image

# 64x64 whatever the replica's default size: the check stays about a second.
SIZE = {"height": 64, "width": 64}
TARGET: tuple[str, dict[str, Any]] = (
    "a red circle on a blue background",
    {"seed": 7, "num_inference_steps": 4, "guidance_scale": 5.0, **SIZE},
)
NEIGHBOURS = (
    (
        "a small green star on a white background, left",
        {"seed": 11, "num_inference_steps": 6, "guidance_scale": 3.0, **SIZE},
    ),
    ("a yellow square on a black background", {"seed": 3, "num_inference_steps": 2, "guidance_scale": 1.0, **SIZE}),
)
EDIT = ("a purple triangle on a grey background", {"seed": 5, "num_inference_steps": 4, "strength": 0.6, **SIZE})


def image_digest(image: Any) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(image, dtype=np.float32).tobytes()).hexdigest()


def edit_picture(size: int = 64):
    """The edit's input: a fixed procedural picture (no file), the same on every machine."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), ((x + y) % 32) * 8], axis=-1).astype("uint8")
    return Image.fromarray(pixels)


def diffusion_digests(renderer, engine) -> dict[str, str]:
    """The canonical requests rendered on `engine` (a StepEngine over `renderer`'s family): case -> sha256."""
    from stages.diffusion.engine import Sample

    def sample(prompt: str, params: dict, image: Any = None) -> Sample:
        # Whatever this deployment's limits (a step limit under 6 must not stop its replicas starting).
        resolved = renderer.resolve(DiffusionSamplingParams(**params), step_engine=True, serving_limits=False)
        return Sample(prompt, resolved, on_done=None, image=image)

    prompt, params = TARGET
    solo = engine.render([sample(prompt, params)])
    batch = engine.render([sample(*NEIGHBOURS[0]), sample(prompt, params), sample(*NEIGHBOURS[1])])
    second = engine.render([sample(prompt, {**params, "seed": seed_for_image(params["seed"], 1)})])
    picture = renderer.pipe.image_processor.preprocess(edit_picture())
    edited = engine.render([sample(*EDIT, image=picture)])
    return {
        "solo": image_digest(solo[0]),
        "co-batched target": image_digest(batch[1]),
        "co-batched neighbour 1": image_digest(batch[0]),
        "co-batched neighbour 2": image_digest(batch[2]),
        "n=2 image 1": image_digest(second[0]),
        "edit": image_digest(edited[0]),
    }


def diffusion_self_check(renderer, engine, configuration: Configuration, columns=None) -> SelfCheck:
    """Render the canonical requests and compare them with this configuration's golden column."""
    columns = load_golden() if columns is None else columns
    if not any(c.configuration == configuration for c in columns):
        return compare_golden(configuration, {}, columns)  # no column: nothing to render
    return compare_golden(configuration, diffusion_digests(renderer, engine), columns)


# --- the table's driver: `omniserve golden [--record]` and tests/test_golden.py --------------------------------


def diffusion_column(dtype: str):
    """The default diffusion model's column on this machine's path (invariance on, step engine, 1 thread)."""
    import datetime

    from contracts.config import DiffusionStageConfig
    from contracts.cpu import cpu_flags
    from contracts.scope import GoldenColumn
    from stages.diffusion import DiffusionRenderer
    from stages.diffusion.engine import StepEngine
    from stages.scope import diffusion_configuration

    config = DiffusionStageConfig(batch_invariant=True, dtype=dtype, torch_threads=1)
    renderer = DiffusionRenderer(config)
    assert renderer.family is not None  # the default model's pipeline is one the step engine knows
    engine = StepEngine(renderer.family, max_batch_size=config.max_batch_size, torch_threads=config.torch_threads)
    try:
        digests = diffusion_digests(renderer, engine)
    finally:
        engine.stop()
    if digests["solo"] != digests["co-batched target"]:  # the cases themselves must be invariant to be golden
        raise RuntimeError(f"{dtype}: the co-batched target differs from its solo render; nothing golden here")
    from stages.audit.report import cpu_model

    flags = " ".join(sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_flags()))
    made = {"command": "omniserve golden --record", "date": datetime.date.today().isoformat(), "cpu_flags": flags}
    return GoldenColumn(
        configuration=diffusion_configuration(renderer, "step"), digests=digests, made={**made, "cpu": cpu_model()}
    )


def llm_column(model: str | None = None):
    """An LLM's column on this machine's path (invariance on, the stage's default config; None: the default model)."""
    import asyncio

    from contracts.config import LLMStageConfig
    from stages.llm.engine import LLMEngine
    from stages.llm.golden import llm_golden_column
    from stages.scope import llm_configuration

    async def run():
        engine = await LLMEngine(LLMStageConfig(batch_invariant=True, model=model)).start()
        try:
            column = await llm_golden_column(engine, llm_configuration(engine))
        finally:
            engine.shutdown()
        for sampling in ("greedy", "seeded"):
            if column.digests[f"{sampling} solo"] != column.digests[f"{sampling} co-batched target"]:
                raise RuntimeError(
                    f"llm {sampling}: the co-batched target differs from its solo run; nothing golden here"
                )
        return column

    return asyncio.run(run())


def compare_or_record(
    dtypes: list[str], *, record: bool, table, log, stages=("diffusion", "llm"), llm_model: str | None = None
) -> int:
    """Each column of this path against the table (0: all reproduced), or written into it."""
    from contracts.scope import compare_golden, load_golden, write_golden

    columns, failed = load_golden(table), 0
    made: list[tuple[str, Callable[..., Any]]] = [
        (f"diffusion {dtype}", lambda dtype=dtype: diffusion_column(dtype)) for dtype in dtypes if "diffusion" in stages
    ]
    made += [("llm", lambda: llm_column(llm_model))] if "llm" in stages else []
    for name, make in made:
        column = make()
        if record:
            write_golden(column, table)
            log(f"{name} on {','.join(column.configuration.hardware)}: {len(column.digests)} cases recorded")
            continue
        check = compare_golden(column.configuration, column.digests, columns)
        log(f"{name}: {check.reason}")
        failed += not check.verified
    return 1 if failed else 0
