"""Seconds per image on a diffusion replica of one worker and of two (`parallel: {cfg: 2}`), the same requests.

Two deployments of one model side by side in one local Ray instance, each with one torch thread per worker; each round
renders the same requests on each (one at a time: a guided image alone puts one branch on each worker of the group),
the two alternating, so a noisy machine slows both alike. Reports per degree the seconds per image (min/median/max over
the rounds), the ratio (two workers / one), and whether the bytes agreed.

    .venv/bin/python -m bench.parallel_group --model omniserve/tiny-sd3-dit --steps 8 --rounds 3 \\
        --markdown docs/evidence/bench-parallel-group.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import cast

from bench.load import spread
from bench.local_serve import local_serve
from contracts.config import DiffusionStageConfig
from contracts.jobs import RenderJob
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion import DiffusionStage
from stages.embedded import embedded_models

PROMPTS = [("a red fox in the snow", 42), ("a lighthouse at dusk", 7), ("two cats asleep on a windowsill", 99)]


def deploy(model: str, cfg: int):
    from ray import serve
    from ray.serve import Deployment

    name = f"bench-cfg{cfg}"
    config = DiffusionStageConfig(
        model=model,
        batch_invariant=True,
        torch_threads=1,
        ray_actor_options={"num_cpus": 0.5},
        parallel={"cfg": cfg},
        self_audit="off",
    )
    stage = cast(Deployment, DiffusionStage).options(name=name, **config.deployment_options())
    return serve.run(stage.bind(config), name=name, route_prefix=None)


def one_round(handle, steps: int, size: int) -> tuple[float, list[str]]:
    """Seconds per image over PROMPTS, one at a time, and their sha256."""
    digests, started = [], time.perf_counter()
    for prompt, seed in PROMPTS:
        params = DiffusionSamplingParams(seed=seed, num_inference_steps=steps, height=size, width=size)
        digests.append(
            list(handle.options(stream=True).render.remote(RenderJob(prompt=prompt, params=params)))[-1].sha256
        )
    return (time.perf_counter() - started) / len(PROMPTS), digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=embedded_models("diffusion")[1])  # the tiny SD3 DiT
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    seconds: dict[int, list[float]] = {1: [], 2: []}
    digests: dict[int, list[str]] = {}
    with local_serve(2, "bench-parallel-group"):
        handles = {cfg: deploy(args.model, cfg) for cfg in (1, 2)}
        for _ in range(args.rounds):
            for cfg, handle in handles.items():
                per_image, digests[cfg] = one_round(handle, args.steps, args.size)
                seconds[cfg].append(per_image)
    ratios = [two / one for one, two in zip(seconds[1], seconds[2], strict=True)]
    lines = [
        f"# One worker against two (CFG parallel): {args.model}, {args.size}x{args.size}, {args.steps} steps",
        "",
        "| workers | seconds per image (min / median / max) |",
        "|---|---|",
        *(f"| {cfg} | {' / '.join(f'{v:.3f}' for v in spread(seconds[cfg]).values())} |" for cfg in (1, 2)),
        "",
        f"Two workers / one, per round: {' / '.join(f'{v:.2f}' for v in spread(ratios).values())} (min / median / max);"
        f" the same bytes: {digests[1] == digests[2]}.",
    ]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
