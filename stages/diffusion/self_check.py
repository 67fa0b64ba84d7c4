"""The diffusion stage's canonical requests and the bits they must give: the golden table (contracts/scope.py).

A column holds, for one configuration on one kernel path, the sha256 of each canonical request's output. The
same functions compute them for each replica at start-up (its self-check, a second or so), for
`omniserve golden --record` (evidence/golden.py, which writes docs/evidence/golden.json) and for
tests/test_golden.py (which renders them on whatever machine runs the suite): a replica that reproduces its
column computes the bits of the machine that made it, so that machine's audit records cover it too
(`contracts.scope.match`).

Diffusion cases, on the step engine: a target solo; the same target co-batched with two neighbours of other
step counts and guidance (it must give the solo bits, and the neighbours theirs); the second image of an n=2
request (its derived seed); an edit of a fixed procedural picture.
"""

from __future__ import annotations

import hashlib
from typing import Any

from contracts.sampling import DiffusionSamplingParams, seed_for_image
from contracts.scope import Configuration, SelfCheck, load_golden

from .engine import Sample

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
        return configuration.compare_golden({}, columns)  # no column: nothing to render
    return configuration.compare_golden(diffusion_digests(renderer, engine), columns)
