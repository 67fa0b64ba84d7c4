"""The kernels' cost at real widths as a serving replica pays it: the first forward after the kernels are installed
(it packs every weight into the fixed-order GEMM's panels) and the forwards after it (the packed copies reused), each
against stock kernels.

A replica installs the kernels once and keeps them; its packed-weight cache (`stages.kernels.native.packed_weights`)
lives as long as the kernels do, so every request after the first reuses the packed weights. The real-width audit
(`omniserve audit --real-width`) installs and removes the kernels around every forward it times (removing them empties
the cache), so each of its kernels-on forwards is a first one: this benchmark separates the two.

Two stocks: stock kernels in a process of their own that nothing holds to a kernel path (ATen, oneDNN and MKL at the
machine's widest: what a user running stock diffusers here gets; after one untimed forward), and stock kernels in this
process, held to the kernel path as a replica is (`contracts.cpu.hold_process_to_path`: MKL in its reproducible
COMPATIBLE mode, ATen and oneDNN at the path's level: what a replica with invariance off runs).

Per component (`evidence.real_width`: random weights from a fixed seed at a public configuration's widths, float32),
one torch thread, the target sample alone; per repeat the three settings in alternating order, each timed by the
process's CPU seconds (one thread: the forward's own work, whatever else the machine runs). Ratios are paired by
repeat: min / median / max.

    .venv/bin/python -m bench.real_width_speed --families flux1,sd35m,sd15 --size 512 --repeats 3 \
        [--json docs/evidence/bench-real-width-speed.json] [--markdown docs/evidence/bench-real-width-speed.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.load import mode_orders, spread


def _timed(forward: Callable[[], object]) -> float:
    started = time.process_time()
    forward()
    return time.process_time() - started


def unheld_stock(args: Sequence[str]) -> float:
    """CPU seconds of one stock forward (after an untimed one) in a child process held to no kernel path."""
    from contracts.cpu import unheld_environment

    done = subprocess.run([sys.executable, "-m", "bench.real_width_speed", "--stock-child", *args],
                          env=unheld_environment(), capture_output=True, text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the unheld stock process failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def _stock_child(family: str, role: str, size: int, blocks: int | None) -> None:
    import torch

    from evidence.real_width import TARGET_SEED, TARGET_T, components

    torch.set_num_threads(1)
    (component,) = [c for c in components([family], size, blocks) if c.role == role and c.family == family]
    module, inputs = component.build(), component.sample(TARGET_SEED, TARGET_T)
    with torch.inference_mode():
        component.call(module, inputs, 1)
        print(_timed(lambda: component.call(module, inputs, 1)))


def _kernels_first_and_warm(forward: Callable[[], object]) -> dict:
    """With the kernels installed (their packed-weight cache empty): the first forward's and the next one's CPU
    seconds, and what each packed."""
    from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels, native

    if not enable_batch_invariant_kernels("cpu").installed:
        raise RuntimeError("the CPU kernels could not be installed")
    try:
        before = native.packed_weights()  # counters run over the process; the cache starts empty here
        first = _timed(forward)
        after_first = native.packed_weights()
        warm = _timed(forward)
        after_warm = native.packed_weights()
    finally:
        disable_batch_invariant_kernels()
    packs = [c["packs"] + c["uncached_packs"] for c in (before, after_first, after_warm)]
    return {
        "first_cpu_s": round(first, 6),
        "warm_cpu_s": round(warm, 6),
        "first_packs": packs[1] - packs[0],
        "warm_packs": packs[2] - packs[1],
        "warm_hits": after_warm["hits"] - after_first["hits"],
        "packed_mib": round(after_warm["bytes"] / (1 << 20), 1),
    }


def measure(component, repeats: int, child_args: Sequence[str] | None = None, log=print) -> dict:
    """One component's repeats: stock (unheld, in a child process given `child_args`; None: not measured), stock held
    to the path, and the kernels' first and warm forward, in CPU seconds; and the packed-weight counters."""
    import torch

    from evidence.real_width import TARGET_SEED, TARGET_T
    from stages.kernels import disable_batch_invariant_kernels

    built = time.monotonic()
    module = component.build()
    inputs = component.sample(TARGET_SEED, TARGET_T)
    log(f"{component.family} {component.role}: built in {time.monotonic() - built:.1f} s ({component.depth})")

    def forward():
        with torch.inference_mode():
            return component.call(module, inputs, 1)

    runs = []
    settings = ("unheld stock", "stock", "kernels") if child_args is not None else ("stock", "kernels")
    for repeat, order in enumerate(mode_orders(settings, repeats)):
        run: dict = {"repeat": repeat, "order": order}
        for setting in order:
            disable_batch_invariant_kernels()
            if setting == "unheld stock":
                run["unheld_stock_cpu_s"] = round(unheld_stock(child_args or ()), 6)
                continue
            if setting == "stock":
                run["stock_cpu_s"] = round(_timed(forward), 6)
                continue
            run |= _kernels_first_and_warm(forward)
        log(
            f"  repeat {repeat} ({' then '.join(order)}): unheld stock {run.get('unheld_stock_cpu_s')} s, "
            f"stock {run['stock_cpu_s']} s, kernels first "
            f"{run['first_cpu_s']} s ({run['first_packs']} packs), warm {run['warm_cpu_s']} s "
            f"({run['warm_packs']} packs, {run['warm_hits']} hits)"
        )
        runs.append(run)
    return {
        "family": component.family,
        "role": component.role,
        "class": component.cls,
        "source": component.source,
        "size": component.size,
        "depth": component.depth,
        "runs": runs,
        "first_over_stock": spread([r["first_cpu_s"] / r["stock_cpu_s"] for r in runs]),
        "warm_over_stock": spread([r["warm_cpu_s"] / r["stock_cpu_s"] for r in runs]),
        **(
            {
                "first_over_unheld_stock": spread([r["first_cpu_s"] / r["unheld_stock_cpu_s"] for r in runs]),
                "warm_over_unheld_stock": spread([r["warm_cpu_s"] / r["unheld_stock_cpu_s"] for r in runs]),
            }
            if child_args is not None
            else {}
        ),
    }


def _ratio(value: dict | None) -> str:
    return f"{value['min']} / **{value['median']}** / {value['max']}" if value else "not measured"


def _median(runs: list[dict], key: str) -> float | str:
    values = sorted(r[key] for r in runs if key in r)
    return round(values[len(values) // 2], 2) if values else "-"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# The kernels at real widths: first forward and warm forwards against stock",
        "",
        f"CPU: {env['hardware']['cpu']}; kernel path: {report['kernel_path']}; one torch thread; command: "
        f"`{' '.join(report['command'])}`.",
        "",
        "| component | size | depth | CPU s, median: unheld stock / held stock / kernels first / warm "
        "| kernels warm / unheld stock | kernels first / unheld stock | kernels warm / held stock "
        "| packs first / warm | packed MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["components"]:
        runs, last = c["runs"], c["runs"][-1]
        seconds = " / ".join(str(_median(runs, k)) for k in ("unheld_stock_cpu_s", "stock_cpu_s", "first_cpu_s",
                                                              "warm_cpu_s"))  # fmt: skip
        lines.append(
            f"| {c['family']} {c['role']} ({c['class']}) | {c['size']} | {c['depth']} | {seconds} "
            f"| {_ratio(c.get('warm_over_unheld_stock'))} | {_ratio(c.get('first_over_unheld_stock'))} "
            f"| {_ratio(c['warm_over_stock'])} | {last['first_packs']} / {last['warm_packs']} | {last['packed_mib']} |"
        )
    lines += [
        "",
        "Ratios are the kernels' CPU seconds over a stock's (below 1: faster), min / **median** / max over repeats, "
        "paired by repeat. Unheld stock: a process of its own at the machine's widest ISA (what stock diffusers gets "
        "here); held stock: this process, held to the kernel path as a replica is (MKL in COMPATIBLE mode).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="flux1,sd35m,sd15")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=None, help="blocks per stack where the audit cuts (default 1)")
    parser.add_argument("--role", choices=("denoiser", "vae decoder", "both"), default="denoiser")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-unheld-stock", action="store_true", help="skip the stock process held to no path")
    parser.add_argument("--stock-child", nargs=4, metavar=("FAMILY", "ROLE", "SIZE", "BLOCKS"), help=argparse.SUPPRESS)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    if args.stock_child:
        family, role, size, blocks = args.stock_child
        _stock_child(family, role, int(size), int(blocks) if blocks != "-" else None)
        return None

    from contracts.cpu import cpu_isa, hold_process_to_path

    hold_process_to_path()  # before torch reads ATen's and oneDNN's variables

    import torch

    from evidence.real_width import components
    from evidence.report import environment

    torch.set_num_threads(1)
    chosen = [
        c
        for c in components(args.families.split(","), args.size, args.blocks)
        if args.role == "both" or c.role == args.role
    ]
    command = ["python", "-m", "bench.real_width_speed", *(argv if argv is not None else sys.argv[1:])]

    def child_args(c) -> list[str] | None:
        blocks = "-" if args.blocks is None else str(args.blocks)
        return None if args.no_unheld_stock else [c.family, c.role, str(c.size), blocks]

    report = {
        "environment": environment(command),
        "kernel_path": cpu_isa(),
        "command": command,
        "components": [measure(c, args.repeats, child_args(c)) for c in chosen],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
