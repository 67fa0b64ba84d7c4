"""A model larger than a fixed packed-weight bound: does each forward pack its weights again?

`.venv/bin/python -m bench.packed_bound [--layers 40] [--width 4096] [--forwards 3] [--bounds auto,2048]`: for each
`OMNISERVE_PACKED_WEIGHTS_MB` setting, a fresh process holds `layers` float32 linear layers of width x width (40 x
4096 x 4096: 2.5 GiB of weights), runs one row through all of them `forwards` times with the kernels on, one torch
thread, and prints each forward's seconds and the packed-weight cache's counters (`native.packed_weights()`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from contracts import envs


def run(layers: int, width: int, forwards: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from stages.kernels import enable_batch_invariant_kernels, native

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(width, width, generator=generator) * 0.01 for _ in range(layers)]
    enable_batch_invariant_kernels("cpu")
    row, rows = torch.randn(1, width, generator=generator), []
    for _ in range(forwards):
        started, hidden = time.perf_counter(), row
        for weight in weights:
            hidden = F.linear(hidden, weight)
        rows.append({"seconds": round(time.perf_counter() - started, 3), **native.packed_weights()})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--bounds", default="auto,2048", help="OMNISERVE_PACKED_WEIGHTS_MB settings, one process each")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run(args.layers, args.width, args.forwards)))
        return
    for bound in args.bounds.split(","):
        command = [
            sys.executable,
            "-m",
            "bench.packed_bound",
            "--child",
            f"--layers={args.layers}",
            f"--width={args.width}",
            f"--forwards={args.forwards}",
        ]
        with envs.overriding({"OMNISERVE_PACKED_WEIGHTS_MB": bound}):
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        for index, row in enumerate(json.loads(out.strip().splitlines()[-1])):
            print(
                f"OMNISERVE_PACKED_WEIGHTS_MB={bound} forward {index}: {row['seconds']:.2f} s, packs {row['packs']}, "
                f"hits {row['hits']}, kept {row['entries']} ({row['bytes'] >> 20} MiB of {row['limit_bytes'] >> 20})"
            )


if __name__ == "__main__":
    main()
