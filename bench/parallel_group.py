"""Seconds per image on a diffusion replica of one worker and of a parallel group (`parallel: {cfg, sp}`), the same
requests.

One deployment per grid of one model side by side in one local Ray instance, each with one torch thread per worker;
each round renders the same requests on each (one at a time: a guided image alone puts one branch on each worker of a
CFG group), the grids alternating, so a noisy machine slows all alike. Reports per grid the seconds per image
(min/median/max over the rounds), the ratio to one worker, whether the bytes agreed, and the bytes the replica sent
through collectives per denoising step (sequence parallel: its all-to-alls and gathers; CFG moves rows through Ray).

    .venv/bin/python -m bench.parallel_group --model omniserve/tiny-sd3-dit --steps 8 --rounds 3 \\
        --grids 2x1 --markdown docs/evidence/bench-parallel-group.md
    .venv/bin/python -m bench.parallel_group --model omniserve/tiny-flux-dit --true-cfg --grids 2x1,1x2,2x2 ...
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


def deploy(model: str, cfg: int, sp: int):
    from ray import serve
    from ray.serve import Deployment

    name = f"bench-cfg{cfg}-sp{sp}"
    config = DiffusionStageConfig(
        model=model,
        batch_invariant=True,
        torch_threads=1,
        ray_actor_options={"num_cpus": 0.2},  # 9 workers for 1x1, 2x1, 1x2 and 2x2 in 2 CPUs
        parallel={"cfg": cfg, "sp": sp},
        self_audit="off",
    )
    stage = cast(Deployment, DiffusionStage).options(name=name, **config.deployment_options())
    return serve.run(stage.bind(config), name=name, route_prefix=None)


#: A negative prompt and true CFG, for FLUX and Qwen-Image: without them their images have one row, and a CFG group's
#: second worker has nothing to do.
TRUE_CFG = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 3.0}


def one_round(handle, steps: int, size: int, extra: dict) -> tuple[float, list[str]]:
    """Seconds per image over PROMPTS, one at a time, and their sha256."""
    digests, started = [], time.perf_counter()
    for prompt, seed in PROMPTS:
        params = DiffusionSamplingParams(seed=seed, num_inference_steps=steps, height=size, width=size, **extra)
        digests.append(
            list(handle.options(stream=True).render.remote(RenderJob(prompt=prompt, params=params)))[-1].sha256
        )
    return (time.perf_counter() - started) / len(PROMPTS), digests


def sent_bytes(handle) -> int:
    return handle.describe.remote().result(timeout_s=60).details["parallel"]["collectives_sent_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=embedded_models("diffusion")[1])  # the tiny SD3 DiT
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grids", default="2x1", help="CFG x SP degrees beside one worker, e.g. 2x1,1x2,2x2")
    parser.add_argument("--true-cfg", action="store_true", help="a negative prompt and true_cfg_scale 3 (FLUX, Qwen)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    extra = TRUE_CFG if args.true_cfg else {}
    grids = [(1, 1)] + [cast(tuple[int, int], tuple(map(int, g.split("x")))) for g in args.grids.split(",")]
    seconds: dict[tuple[int, int], list[float]] = {grid: [] for grid in grids}
    digests: dict[tuple[int, int], list[str]] = {}
    sent: dict[tuple[int, int], int] = dict.fromkeys(grids, 0)
    with local_serve(2, "bench-parallel-group"):
        handles = {grid: deploy(args.model, *grid) for grid in grids}
        for _ in range(args.rounds):
            for grid, handle in handles.items():
                before = sent_bytes(handle) if grid != (1, 1) else 0
                per_image, digests[grid] = one_round(handle, args.steps, args.size, extra)
                seconds[grid].append(per_image)
                if grid != (1, 1):
                    sent[grid] = (sent_bytes(handle) - before) // (len(PROMPTS) * args.steps)
    lines = [
        f"# One worker against parallel groups: {args.model}, {args.size}x{args.size}, {args.steps} steps"
        + (", true CFG" if args.true_cfg else ""),
        "",
        "| CFG x SP | seconds per image (min / median / max) | / one worker (min / median / max) | same bytes |"
        " replica's collectives per step |",
        "|---|---|---|---|---|",
    ]
    for grid in grids:
        ratios = [mine / one for one, mine in zip(seconds[(1, 1)], seconds[grid], strict=True)]
        lines.append(
            f"| {grid[0]} x {grid[1]} | {' / '.join(f'{v:.3f}' for v in spread(seconds[grid]).values())} "
            f"| {' / '.join(f'{v:.2f}' for v in spread(ratios).values())} | {digests[grid] == digests[(1, 1)]} "
            f"| {sent[grid]:,} B |"
        )
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
