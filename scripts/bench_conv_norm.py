"""Convolution and group_norm with the invariant kernels vs stock, per CPU path (issue 21, item 6).

    .venv/bin/python scripts/bench_conv_norm.py --threads 1,2 --json docs/evidence/bench-conv-norm-avx2.json
    OMNISERVE_CPU_ISA=generic .venv/bin/python scripts/bench_conv_norm.py ...

At the tiny UNet's and VAE's shapes (batch 8, 64x64 images: latents 8x8, VAE up to 64x64), float32 and bfloat16,
each input in the layout the pipeline hands that layer. Stock and invariant alternate within every repeat;
the ratio is time(stock) / time(invariant), paired per repeat (>= 1: the invariant op is as fast). At one torch
thread the clock is the thread's CPU time (other load on a shared box barely moves it), at more the wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from contracts.cpu import hold_process_to_path

hold_process_to_path()  # before torch computes anything

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels, native  # noqa: E402

#: (name, input shape, weight shape, layout): conv2d 3x3 padding 1. The first layer gets the pipeline's channels-first
#: latents; inner layers get what the convolution before them returned: channels-last (ours keeps it, stock too).
CONVS = (
    ("conv 4->32 @ 8x8", (8, 4, 8, 8), (32, 4, 3, 3), "first"),
    ("conv 64->64 @ 16x16", (8, 64, 16, 16), (64, 64, 3, 3), "last"),
    ("conv 128->128 @ 32x32", (8, 128, 32, 32), (128, 128, 3, 3), "last"),
    ("conv 64->3 @ 64x64", (8, 64, 64, 64), (3, 64, 3, 3), "last"),
)
#: group_norm with 32 groups (diffusers' default), in both layouts.
NORMS = tuple(
    (f"group_norm {c} @ {hw}x{hw} {layout}", (8, c, hw, hw), layout)
    for c, hw in ((64, 16), (128, 32), (64, 64))
    for layout in ("first", "last")
)
#: The same at the widths users serve (`--widths real`): SD1.5's UNet at 512x512 with CFG (batch 2: 320, 640 and 1280
#: channels at 64x64, 32x32, 16x16) and its VAE decoder's largest (batch 1: 512 channels at 64x64 and 128x128, 256 at
#: 256x256, 128 at 512x512).
REAL_NORMS = tuple(
    (f"group_norm {n}x{c} @ {hw}x{hw} {layout}", (n, c, hw, hw), layout)
    for n, c, hw in (
        (2, 320, 64),
        (2, 640, 32),
        (2, 1280, 16),
        (1, 512, 64),
        (1, 512, 128),
        (1, 256, 256),
        (1, 128, 512),
    )
    for layout in ("first", "last")
)


def _layout(x, layout: str):
    return x.contiguous(memory_format=torch.channels_last) if layout == "last" else x.contiguous()


def _time(fn, calls: int, threads: int) -> float:
    """Seconds per call: one thread's CPU time (barely moved by other load on a shared box); with several threads
    the wall clock, since the other threads' work is not this thread's."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def _point(fn, repeats: int, threads: int = 1) -> dict:
    fn()
    calls = max(1, min(200, int(0.05 / max(_time(fn, 1, threads), 1e-6))))
    stock, ours = [], []
    for _ in range(repeats):
        disable_batch_invariant_kernels()
        stock.append(_time(fn, calls, threads))
        enable_batch_invariant_kernels("cpu")
        ours.append(_time(fn, calls, threads))
    disable_batch_invariant_kernels()
    ratios = sorted(s / o for s, o in zip(stock, ours, strict=True))
    return {
        "stock_ms": statistics.median(stock) * 1e3,
        "invariant_ms": statistics.median(ours) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default="1", help="torch thread counts, e.g. 1,2")
    parser.add_argument("--ops", default="conv,norm", help="of conv,norm")
    parser.add_argument("--widths", default="tiny", help="group_norm shapes: tiny (the tiny models'), real, or both")
    parser.add_argument("--json")
    args = parser.parse_args()
    threads, ops = [int(t) for t in args.threads.split(",")], set(args.ops.split(","))
    enable_batch_invariant_kernels("cpu")  # the library built and loaded before any timing
    rows = []
    with torch.inference_mode():
        for count in threads:
            torch.set_num_threads(count)
            gen = torch.Generator().manual_seed(0)
            for dtype in (torch.float32, torch.bfloat16):
                common = {"dtype": str(dtype).split(".")[1], "threads": count}
                for name, shape, weight_shape, layout in CONVS if "conv" in ops else ():
                    x = _layout(torch.randn(shape, generator=gen).to(dtype), layout)
                    w = torch.randn(weight_shape, generator=gen).to(dtype)
                    rows.append(
                        {
                            "op": f"{name} {layout}",
                            **common,
                            **_point(lambda x=x, w=w: F.conv2d(x, w, padding=1), args.repeats, count),
                        }
                    )
                norms = (NORMS if "tiny" in args.widths else ()) + (REAL_NORMS if "real" in args.widths else ())
                for name, shape, layout in norms if "norm" in ops else ():
                    x = _layout(torch.randn(shape, generator=gen).to(dtype), layout)
                    rows.append({"op": name, **common, **_point(lambda x=x: F.group_norm(x, 32), args.repeats, count)})
    report = {
        "path": native.loaded_isa(),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "repeats": args.repeats,
        "widths": args.widths,
        "rows": rows,
    }
    for row in rows:
        print(
            f"{report['path']:8} t{row['threads']} {row['dtype']:9} {row['op']:42} stock {row['stock_ms']:8.3f} ms  ours "
            f"{row['invariant_ms']:8.3f} ms  stock/ours {row['ratio_median']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
