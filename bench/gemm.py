"""The cost of invariant GEMMs: `F.linear` with the project's kernels vs stock, at LLM shapes.

`omniserve bench --stage kernels`. For each thread count, dtype, (K, N) and row count M it times
three ways of computing the same linear layer, alternating within every repeat:
- `stock`: `F.linear` with the stock kernels (MKL for float32, oneDNN for bfloat16 on this build);
- `onednn`: what vLLM's CPU linear layers run without invariance (`onednn_mm` on a handler made
  once per weight, as `dispatch_cpu_unquantized_gemm` does), where vLLM's CPU ops are installed;
- `invariant`: `F.linear` with `stages.kernels` enabled (the fixed-order packed GEMM).
Ratios are time(other) / time(invariant), paired within a repeat; >= 1 means the invariant kernel
is as fast. With one thread the clock is the thread's CPU time (other people's load on a shared box
then barely moves it); with more, wall time (the only honest clock for threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench.plot import ratio_picture
from evidence.report import environment
from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels

#: The issue's shapes: (K, N) of the embedded LLMs' projections and of larger models'.
SHAPES = ((512, 1408), (1408, 512), (1024, 2816), (2048, 5632), (4096, 4096))
ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)
DTYPES = ("float32", "bfloat16")
TARGET_S = 0.02  # time per measurement: calls repeat until about this long


def _onednn_linear(weight: torch.Tensor) -> Callable | None:
    """vLLM's stock CPU linear for this weight, or None where vLLM's CPU ops are not installed or oneDNN has no
    kernel for it (bfloat16 below AVX-512: "could not create a primitive descriptor")."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        handler = ops.create_onednn_mm(weight.t(), 32)
    except RuntimeError:
        return None
    return lambda x, bias: ops.onednn_mm(handler, x, bias)


def _timed(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def _calls(fn: Callable[[], object]) -> int:
    """How many calls make about TARGET_S (measured once, after a warm-up call)."""
    fn()
    one = max(_timed(fn, 1, time.perf_counter), 1e-6)
    return max(1, min(1000, int(TARGET_S / one)))


def _point(k: int, n: int, m: int, dtype: torch.dtype, repeats: int, clock) -> dict:
    gen = torch.Generator().manual_seed(m * 7919 + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    linear = lambda: F.linear(x, weight, bias)  # noqa: E731
    onednn = _onednn_linear(weight)
    ways: dict[str, Callable[[], object]] = {"stock": linear, "invariant": linear}
    if onednn is not None:
        ways["onednn"] = lambda: onednn(x, bias)
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    calls: dict[str, int] = {}
    for repeat in range(repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))  # alternate who goes first
        for way in order:
            if way == "invariant":
                enable_batch_invariant_kernels("cpu")
            else:
                disable_batch_invariant_kernels()
            # Warm every time: turning the kernels off empties their packed-weight cache, and a replica packs a weight
            # once, at its warm-up (a pack inside the timing made large single-row products look 0.77x stock).
            calls.setdefault(way, _calls(ways[way]))
            ways[way]()
            seconds[way].append(_timed(ways[way], calls[way], clock))
    disable_batch_invariant_kernels()
    row = {"k": k, "n": n, "m": m, "seconds_median": {w: statistics.median(s) for w, s in seconds.items()}}
    for other in ("stock", "onednn"):
        if other in seconds:
            ratios = [o / i for o, i in zip(seconds[other], seconds["invariant"], strict=True)]
            row[f"{other}_over_invariant"] = _spread(ratios)
    return row


def _spread(values: Sequence[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def run_benchmark(
    *,
    repeats: int = 5,
    threads: Sequence[int] = (1, 2),
    dtypes: Sequence[str] = DTYPES,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    rows: Sequence[int] = ROWS,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:

    before = torch.get_num_threads()
    results = []
    try:
        for count in threads:
            torch.set_num_threads(count)
            clock = time.thread_time if count == 1 else time.perf_counter
            for dtype_name in dtypes:
                for k, n in shapes:
                    for m in rows:
                        row = _point(k, n, m, getattr(torch, dtype_name), repeats, clock)
                        row.update(threads=count, dtype=dtype_name, clock=clock.__name__)
                        results.append(row)
                        log(
                            f"[bench] {count} thread(s) {dtype_name} K={k} N={n} M={m}: stock/invariant "
                            f"{row['stock_over_invariant']['median']}, onednn/invariant "
                            f"{row.get('onednn_over_invariant', {}).get('median')}"
                        )
    finally:
        torch.set_num_threads(before)
    return {"rows": results, "repeats": repeats, "environment": environment(command)}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"Hardware: {env['hardware']['cpu']}, {env['hardware']['usable_cpus']} usable CPUs. "
        f"Command: `{env['command']}`. {report['repeats']} alternating repeats; "
        "cells: time(other) / time(invariant), median (min-max).",
        "",
    ]
    groups = sorted({(r["threads"], r["dtype"]) for r in report["rows"]})
    for threads, dtype in groups:
        rows = [r for r in report["rows"] if r["threads"] == threads and r["dtype"] == dtype]
        ms = sorted({r["m"] for r in rows})
        for other in ("stock", "onednn"):
            key = f"{other}_over_invariant"
            if not any(key in r for r in rows):
                continue
            lines += [
                f"**{threads} thread(s), {dtype}, {other} / invariant** ({rows[0]['clock']})",
                "",
                "| K x N | " + " | ".join(f"M={m}" for m in ms) + " |",
                "|---" * (len(ms) + 1) + "|",
            ]
            for k, n in dict.fromkeys((r["k"], r["n"]) for r in rows):
                cells = []
                for m in ms:
                    s = next(r[key] for r in rows if (r["k"], r["n"], r["m"]) == (k, n, m))
                    cells.append(f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
                lines.append(f"| {k} x {n} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def picture(report: dict, path: str) -> None:
    """stock / invariant against M, one line per thread count and dtype: the median over the (K, N)
    shapes of each shape's median, whiskers from the lowest to the highest single repeat of any shape."""

    by_point: dict[tuple[str, int], list[dict]] = {}
    for r in report["rows"]:
        by_point.setdefault((f"{r['threads']} thread(s) {r['dtype']}", r["m"]), []).append(r["stock_over_invariant"])
    series: dict[str, list] = {}
    for (label, m), spreads in by_point.items():
        series.setdefault(label, []).append(
            (
                m,
                {
                    "median": statistics.median(s["median"] for s in spreads),
                    "min": min(s["min"] for s in spreads),
                    "max": max(s["max"] for s in spreads),
                },
            )
        )
    ratio_picture(
        path,
        title=f"F.linear at {len(SHAPES)} (K, N) shapes, time stock / invariant; {report['repeats']} repeats paired",
        x_label="rows M",
        series=series,
    )


def main() -> None:
    """`python -m bench.gemm`: the same points in a process held to no path, so stock is MKL and oneDNN at this
    CPU's widest (what stock PyTorch gets here); `omniserve bench --stage kernels` compares against stock held to the
    kernel path, as a replica with invariance off runs."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M, e.g. 1,2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    report = run_benchmark(
        repeats=args.repeats,
        threads=[int(t) for t in args.threads.split(",")],
        dtypes=args.dtypes.split(","),
        rows=[int(m) for m in args.rows.split(",")],
        command=[sys.executable, "-m", "bench.gemm", *sys.argv[1:]],
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(markdown(report))


if __name__ == "__main__":
    main()
