"""What holding an AVX-512 machine to the avx2 path costs (issue 21, item 2): the same work on the avx2 and avx512
paths of one machine, alternating path by path within every repeat, each in a fresh process (a path is fixed per
process: ATen, oneDNN, MKL and vLLM read their level once).

    .venv/bin/python scripts/bench_pin.py --repeats 3 --json docs/evidence/bench-pin.json

Per repeat and path, one child process measures, invariance on, one torch thread:
- diffusion: the default image model on the step engine, 8 images of 64x64 at 8 steps (a full step batch), float32
  and bfloat16, seconds per batch (median of 3 after a warm-up batch);
- GEMM: F.linear with the invariant kernels at the embedded LLM's shapes, rows 1 and 64 (median of 20 calls);
- LLM: the default LLM engine, 8 co-batched enhancement requests of 32 tokens (median of 3 after a warm-up).
The ratio is time(avx2) / time(avx512), paired per repeat: above 1, the avx2 pin is that much slower here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ("avx2", "avx512")
LINEAR_SHAPES = ((512, 1024), (512, 2816), (1408, 512))  # (K, N): the tiny Llama's qkv, gate_up and down projections


def _median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _diffusion(dtype: str) -> float:
    from contracts.config import DiffusionStageConfig
    from contracts.sampling import DiffusionSamplingParams
    from stages.diffusion import DiffusionRenderer
    from stages.diffusion.engine import Sample, StepEngine

    config = DiffusionStageConfig(batch_invariant=True, dtype=dtype, torch_threads=1)
    renderer = DiffusionRenderer(config)
    assert renderer.family is not None, "the default model is one the step engine drives"
    engine = StepEngine(renderer.family, max_batch_size=8, torch_threads=1)

    def batch():
        samples = [
            Sample(
                "a red circle on a blue background",
                renderer.resolve(
                    DiffusionSamplingParams(seed=i, num_inference_steps=8, height=64, width=64), step_engine=True
                ),
                on_done=None,
            )
            for i in range(8)
        ]
        engine.render(samples)

    try:
        batch()
        return _median_seconds(batch, 3)
    finally:
        engine.stop()


def _linear() -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from stages.kernels import enable_batch_invariant_kernels

    torch.set_num_threads(1)
    assert enable_batch_invariant_kernels("cpu").installed
    gen, out = torch.Generator().manual_seed(0), {}
    for k, n in LINEAR_SHAPES:
        w = torch.randn(n, k, generator=gen)
        for m in (1, 64):
            x = torch.randn(m, k, generator=gen)
            F.linear(x, w)
            out[f"linear {m}x{k} @ {k}x{n}"] = _median_seconds(lambda x=x, w=w: F.linear(x, w), 20)
    return out


def _llm() -> float:
    import asyncio

    from contracts.config import LLMStageConfig
    from contracts.sampling import LLMSamplingParams
    from stages.llm import LLMEngine, LLMRequests
    from stages.llm.co_batched import generate_co_batched

    async def run() -> float:
        engine = await LLMEngine(LLMStageConfig(batch_invariant=True, torch_threads=1)).start()
        try:
            requests = LLMRequests(engine)

            def batch():
                made = [
                    requests.enhancement(
                        f"a lighthouse number {i}", LLMSamplingParams(temperature=1.0, seed=i, max_tokens=32)
                    )
                    for i in range(8)
                ]
                return [(ids, sampling) for ids, _, sampling in made]

            await generate_co_batched(engine, batch())
            times = []
            for _ in range(3):
                start = time.perf_counter()
                await generate_co_batched(engine, batch())
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            engine.shutdown()

    return asyncio.run(run())


def child() -> None:
    from contracts.cpu import hold_process_to_path

    hold_process_to_path()
    import torch

    torch.set_num_threads(1)
    result = {
        "path": os.environ["OMNISERVE_CPU_ISA"],
        "aten": torch.backends.cpu.get_cpu_capability(),
        "diffusion float32 8x64x64 8 steps": _diffusion("float32"),
        "diffusion bfloat16 8x64x64 8 steps": _diffusion("bfloat16"),
        **_linear(),
        "llm 8 requests x 32 tokens": _llm(),
    }
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    from contracts import cpu

    missing = [p for p in PATHS if p not in cpu.supported_isas()]
    if missing:
        sys.exit(f"this CPU cannot run the {', '.join(missing)} path: the pin costs nothing to measure here")
    runs: dict[str, list[dict]] = {p: [] for p in PATHS}
    for repeat in range(args.repeats):
        for path in PATHS if repeat % 2 == 0 else reversed(PATHS):
            done = subprocess.run(
                [sys.executable, __file__, "--child"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=900,
                env=cpu.path_environment(path, os.environ),
            )
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            runs[path].append(
                json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))
            )
            print(f"repeat {repeat + 1} {path}: done", file=sys.stderr)
    rows = []
    for metric in [k for k in runs["avx2"][0] if k not in ("path", "aten")]:
        ratios = sorted(a[metric] / b[metric] for a, b in zip(runs["avx2"], runs["avx512"], strict=True))
        rows.append(
            {
                "metric": metric,
                "avx2_s": statistics.median(r[metric] for r in runs["avx2"]),
                "avx512_s": statistics.median(r[metric] for r in runs["avx512"]),
                "avx2_over_avx512_median": statistics.median(ratios),
                "min": ratios[0],
                "max": ratios[-1],
            }
        )
    for row in rows:
        print(
            f"{row['metric']:38} avx2 {row['avx2_s'] * 1e3:9.2f} ms  avx512 {row['avx512_s'] * 1e3:9.2f} ms  "
            f"avx2/avx512 {row['avx2_over_avx512_median']:.2f} ({row['min']:.2f}-{row['max']:.2f})"
        )
    if args.json:
        cpu_name = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "unknown",
        )
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_name, "repeats": args.repeats, "rows": rows, "runs": runs}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
