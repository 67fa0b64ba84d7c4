"""The `omniserve` command line."""

from __future__ import annotations

import argparse
import sys


def _ints(text: str) -> list[int]:
    """'1-8' or '1,2,4,8' -> a list of ints."""
    if "-" in text:
        low, high = text.split("-", 1)
        return list(range(int(low), int(high) + 1))
    return [int(part) for part in text.split(",") if part]


def _words(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def audit(args: argparse.Namespace) -> int:
    """Run an invariance audit; exit 1 when kernels were on and any run differed."""
    from stages.audit.report import markdown_table, write_outputs

    command = ["omniserve", *sys.argv[1:]]
    if args.stage == "diffusion":
        from stages.audit.diffusion import MODELS, run_diffusion_audit

        report = run_diffusion_audit(
            args.model or MODELS,
            picture_path=args.picture,
            command=command,
            kernels=args.kernels,
            batch_sizes=args.batch_sizes,
            dtype=args.dtype,
            steps=args.steps,
            size=args.size,
            log=lambda line: print(line, file=sys.stderr),
        )
    else:
        from stages.audit.llm import run_llm_audit

        if args.picture:
            print("--picture applies to the diffusion stage only", file=sys.stderr)
        models = args.model or [None]
        reports = [
            run_llm_audit(model, kernels=args.kernels, batch_sizes=args.batch_sizes, command=command,
                          log=lambda line: print(line, file=sys.stderr))
            for model in models
        ]
        report = reports[0]
        for extra in reports[1:]:
            report["runs"] += extra["runs"]
    write_outputs(report, args.json, args.markdown)
    print(markdown_table(report))
    differed = [r for r in report["runs"] if r["kernels"] == "on" and r["differing_elements"] > 0]
    if differed:
        print(f"NOT INVARIANT: {len(differed)} run(s) with kernels on differed", file=sys.stderr)
        return 1
    return 0


def bench(args: argparse.Namespace) -> int:
    """Images/s with kernels on vs off; figures go to --json/--markdown (e.g. under docs/)."""
    import json
    from pathlib import Path

    from stages.bench import MODELS, markdown, run_benchmark

    report = run_benchmark(
        args.model or MODELS, command=["omniserve", *sys.argv[1:]], sizes=args.sizes,
        batch_sizes=args.batch_sizes, steps=args.steps, repeats=args.repeats,
        log=lambda line: print(line, file=sys.stderr),
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    print(markdown(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniserve",
        description="Reproducible two-stage (LLM -> diffusion) generation on Ray Serve.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    audit_parser = commands.add_parser(
        "audit", help="prove (or disprove) batch invariance bit for bit",
        description="Run a target request solo and co-batched in several orderings and batch sizes, "
        "kernels off (the control) and on, and count differing elements.",
    )
    audit_parser.add_argument("--stage", choices=["diffusion", "llm"], required=True)
    audit_parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    audit_parser.add_argument("--json", metavar="PATH", help="write the full report (runs, summary, environment)")
    audit_parser.add_argument("--markdown", metavar="PATH", help="write the evidence table")
    audit_parser.add_argument("--picture", metavar="PATH", help="diffusion: PNG of solo | co-batched | difference")
    audit_parser.add_argument("--kernels", type=_words, default=["off", "on"], help="settings to run (default: off,on)")
    audit_parser.add_argument("--batch-sizes", type=_ints, default=list(range(1, 9)), help="e.g. 1-8 or 1,4,8")
    audit_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="diffusion dtype")
    audit_parser.add_argument("--steps", type=int, default=8, help="diffusion steps")
    audit_parser.add_argument("--size", type=int, default=64, help="diffusion image side in pixels")
    audit_parser.set_defaults(run=audit)

    bench_parser = commands.add_parser("bench", help="diffusion throughput with batch-invariant kernels on vs off")
    bench_parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    bench_parser.add_argument("--sizes", type=_ints, default=[64, 256], help="image sides, e.g. 64,256")
    bench_parser.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    bench_parser.add_argument("--steps", type=int, default=8)
    bench_parser.add_argument("--repeats", type=int, default=5)
    bench_parser.add_argument("--json", metavar="PATH")
    bench_parser.add_argument("--markdown", metavar="PATH")
    bench_parser.set_defaults(run=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
