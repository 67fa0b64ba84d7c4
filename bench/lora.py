"""What per-row LoRA adapters cost (issue 24, item 6): a mixed-adapter load against the same load without adapters and
against merging each adapter into the weights per batch; and the memory one loaded adapter takes.

A benchmark, not a test. One step engine of the embedded default model (64x64, kernels on) renders a closed load of
`samples` requests submitted at once (batches of `max_batch_size`), in three ways, alternating their order per repeat:

    none     no request names an adapter (the replica has the adapters hooked all the same: what rows without an
             adapter pay is the hooks' check)
    mixed    half the requests name one of three adapters (the trained "twins" and two random ones of its size),
             co-batched with the rest: per-row updates (stages.diffusion.lora)
    merged   the same requests, batched by adapter the way a merging server must: the adapter-free ones together,
             then per adapter its requests with `W += scale * B A` merged into the UNet's weights for that batch and
             unmerged after (a copy restored, so the base stays exact); merging and unmerging are timed

Reported: images/s per way as min/median/max over repeats and the ratios paired by repeat; the bytes one adapter
takes in the denoiser's dtype. `python -m bench.lora --json docs/evidence/bench-lora.json --markdown ...`
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.load import mode_orders, spread
from contracts.config import DiffusionStageConfig
from contracts.sampling import DiffusionSamplingParams, LoraChoice
from stages.embedded import DEFAULT_MODELS

WAYS = ("none", "mixed", "merged")
ADAPTERS = ("twins", "rand1", "rand2")


def adapters_directory(directory, unet) -> None:
    """The trained "twins" and two random adapters of its layers and rank, in `directory`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.embedded.diffusion import ADAPTERS_PATH

    shutil.copytree(ADAPTERS_PATH / "twins", directory / "twins")
    twins = load_file(str(ADAPTERS_PATH / "twins" / "pytorch_lora_weights.safetensors"))
    for seed, name in enumerate(ADAPTERS[1:], start=1):
        gen = torch.Generator().manual_seed(seed)
        save_file(
            {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in twins.items()},
            str(directory / f"{name}.safetensors"),
        )


def requests(samples: int, seed: int = 0) -> list[tuple[str, list[LoraChoice] | None]]:
    """(prompt, lora): every other request adapted, by one of ADAPTERS in turn; a seeded shuffle of the order."""
    load = [
        ("a red circle on a blue background", [LoraChoice(name=ADAPTERS[(i // 2) % 3])] if i % 2 else None)
        for i in range(samples)
    ]
    random.Random(seed).shuffle(load)
    return load


def render(renderer, engine, load, seeds: Sequence[int], steps: int, size: int) -> list[Any]:
    from stages.diffusion.engine import Sample

    samples = [
        Sample(
            prompt,
            renderer.resolve(
                DiffusionSamplingParams(seed=seed, lora=lora, num_inference_steps=steps, height=size, width=size),
                step_engine=True,
            ),
            on_done=None,
        )
        for (prompt, lora), seed in zip(load, seeds, strict=True)
    ]
    return engine.render(samples)


def merged(renderer, engine, load, seeds: Sequence[int], steps: int, size: int) -> float:
    """The load batched per adapter, each adapter merged into the weights for its batch; seconds it took."""
    unet = renderer.pipe.unet
    started = time.perf_counter()
    groups: dict[str | None, list[int]] = {}
    for i, (_, lora) in enumerate(load):
        groups.setdefault(lora[0].name if lora else None, []).append(i)
    for name, members in groups.items():
        saved = {}
        if name is not None:
            adapter = renderer.loras.get(name)
            with torch.no_grad():
                for key, layer in adapter.layers.items():  # "unet.<module path>": the UNet's layers only
                    path = key.removeprefix("unet.")
                    weight = unet.get_submodule(path).weight
                    saved[path] = weight.detach().clone()
                    weight += layer.scale * (layer.up @ layer.down)
        render(renderer, engine, [(load[i][0], None) for i in members], [seeds[i] for i in members], steps, size)
        with torch.no_grad():
            for path, weight in saved.items():
                unet.get_submodule(path).weight.copy_(weight)
    return time.perf_counter() - started


def run(samples: int, steps: int, size: int, repeats: int, max_batch_size: int, threads: int, invariant: bool) -> dict:
    import tempfile
    from pathlib import Path

    from stages.diffusion import DiffusionRenderer
    from stages.diffusion.engine import StepEngine

    load, seeds = requests(samples), list(range(100, 100 + samples))
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        config = DiffusionStageConfig(
            model=DEFAULT_MODELS["diffusion"], batch_invariant=invariant, torch_threads=threads, lora_dir=str(directory)
        )
        renderer = DiffusionRenderer(config)
        assert renderer.family is not None  # the default model is a step-engine family
        adapters_directory(directory, renderer.pipe.unet)
        engine = StepEngine(renderer.family, max_batch_size=max_batch_size, torch_threads=threads)
        try:
            render(renderer, engine, load, seeds, steps, size)  # warm: every adapter loaded and hooked
            runs = [
                {
                    "repeat": repeat,
                    "way": way,
                    "seconds": round(seconds, 4),
                    "images_per_s": round(samples / seconds, 3),
                }
                for repeat, order in enumerate(mode_orders(WAYS, repeats))
                for way in order
                for seconds in [_seconds(way, renderer, engine, load, seeds, steps, size)]
            ]
            adapter_bytes = {name: renderer.loras.get(name).nbytes for name in ADAPTERS}
            adapter_layers = len(renderer.loras.get("twins").layers)
        finally:
            engine.stop()
    return {
        "setup": {
            "model": config.model,
            "samples": samples,
            "adapted": sum(1 for _, lora in load if lora),
            "steps": steps,
            "size": f"{size}x{size}",
            "max_batch_size": max_batch_size,
            "torch_threads": threads,
            "batch_invariant": invariant,
            "repeats": repeats,
        },
        "runs": runs,
        "images_per_s": {way: spread([_rate(runs, r, way) for r in range(repeats)]) for way in WAYS},
        "ratios": {
            f"{a}_over_{b}": spread([_rate(runs, r, a) / _rate(runs, r, b) for r in range(repeats)])
            for a, b in (("mixed", "none"), ("mixed", "merged"))
        },
        "adapter_bytes": adapter_bytes,
        "adapter_layers": adapter_layers,
    }


def _seconds(way: str, renderer, engine, load, seeds: Sequence[int], steps: int, size: int) -> float:
    """One way's render of the whole load, in seconds."""
    if way == "merged":
        return merged(renderer, engine, load, seeds, steps, size)
    started = time.perf_counter()
    render(renderer, engine, load if way == "mixed" else [(p, None) for p, _ in load], seeds, steps, size)
    return time.perf_counter() - started


def _rate(runs: list[dict], repeat: int, way: str) -> float:
    return float(next(r["images_per_s"] for r in runs if r["repeat"] == repeat and r["way"] == way))


def markdown(report: dict) -> str:
    def cell(v: dict) -> str:
        return f"{v['median']} ({v['min']}-{v['max']})"

    rows = [f"| {way} | {cell(report['images_per_s'][way])} |" for way in WAYS]
    ratios = [f"| {name.replace('_over_', ' / ')} | {cell(v)} |" for name, v in report["ratios"].items()]
    return "\n".join(
        [
            f"Setup: {json.dumps(report['setup'])}",
            "",
            "| way | images/s |",
            "|---|---|",
            *rows,
            "",
            "| ratio (paired by repeat) | median (min-max) |",
            "|---|---|",
            *ratios,
            "",
            f"Bytes per loaded adapter ({report['adapter_layers']} layers): {report['adapter_bytes']}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stock", action="store_true", help="stock kernels (invariance off): what the GEMMs cost")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    report = run(args.samples, args.steps, args.size, args.repeats, args.max_batch_size, args.threads, not args.stock)
    report["command"] = "python -m bench.lora " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    text = markdown(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
