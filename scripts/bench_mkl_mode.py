"""What holding MKL to its COMPATIBLE code costs (issue 21): the diffusion renderer's images/s with MKL_CBWR=AVX2 (what
the avx2 path held it to before) and MKL_CBWR=COMPATIBLE (what every path holds it to now), alternating mode by mode
within every repeat, each run a fresh `omniserve bench --stage diffusion --load none` process (MKL reads its mode once).

    .venv/bin/python scripts/bench_mkl_mode.py --repeats 3 --json docs/evidence/bench-mkl-mode.json \
        --markdown docs/evidence/bench-mkl-mode.md

The ratio is images/s(COMPATIBLE) / images/s(AVX2), paired per repeat, for kernels on (what a replica runs) and off:
below 1, COMPATIBLE is that much slower. MKL computes float32 attention and bmm here; the GEMMs of the linear layers
are the project's own (stages/kernels/blocked.cpp) and convolution is oneDNN's, neither touched by the mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.load import spread  # min/median/max over repeats, as the load benchmark reports them

REPO = Path(__file__).resolve().parents[1]
MODES = ("AVX2", "COMPATIBLE")


def _run(mode: str, args: argparse.Namespace) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(model, size, batch) -> (images/s off, images/s on) for one bench process under MKL_CBWR=mode."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        command = [
            sys.executable,
            "-m",
            "cli.main",
            "bench",
            "--stage",
            "diffusion",
            "--load",
            "none",
            "--sizes",
            args.sizes,
            "--batch-sizes",
            args.batch_sizes,
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
        subprocess.run(
            command, cwd=REPO, env={**os.environ, "MKL_CBWR": mode}, check=True, capture_output=True, timeout=1800
        )
        rows = json.loads(out.read_text())["rows"]
    return {(r["model"], r["size"], r["batch_size"]): (r["images_per_s_off"], r["images_per_s_on"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="64")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    runs: list[dict[str, dict]] = []
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]  # alternate which mode goes first
        runs.append({mode: _run(mode, args) for mode in order})
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    rows = []
    for key in runs[0]["AVX2"]:
        on = [run["COMPATIBLE"][key][1] / run["AVX2"][key][1] for run in runs]
        off = [run["COMPATIBLE"][key][0] / run["AVX2"][key][0] for run in runs]
        rows.append(
            {
                "model": key[0],
                "size": key[1],
                "batch_size": key[2],
                "repeats": len(runs),
                "images_per_s_on": {mode: round(statistics.median(r[mode][key][1] for r in runs), 3) for mode in MODES},
                "compatible_over_avx2_on": spread(on),
                "compatible_over_avx2_off": spread(off),
            }
        )
    from evidence.report import environment  # the CPU, versions and load, as every benchmark records them

    report = {"rows": rows, "environment": environment(" ".join(sys.argv))}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "| model | size | batch | on img/s AVX2 | on img/s COMPATIBLE | COMPATIBLE/AVX2 on (min/median/max) | off |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        on, off = r["compatible_over_avx2_on"], r["compatible_over_avx2_off"]
        lines.append(
            f"| {r['model']} | {r['size']} | {r['batch_size']} | {r['images_per_s_on']['AVX2']} | "
            f"{r['images_per_s_on']['COMPATIBLE']} | {on['min']}/{on['median']}/{on['max']} | "
            f"{off['min']}/{off['median']}/{off['max']} |"
        )
    text = "\n".join(lines) + "\n"
    if args.markdown:
        args.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
