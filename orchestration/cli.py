"""The `omniserve` command line: one entry for every command (`omniserve audit`, `omniserve bench`)."""

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


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _diffusion_report(args: argparse.Namespace, command: list[str]) -> dict:
    from stages.audit.diffusion import run_diffusion_audit
    from stages.embedded import embedded_models

    return run_diffusion_audit(
        args.model or embedded_models("diffusion"), picture_path=args.picture, command=command, log=_log,
        kernels=args.kernels, batch_sizes=args.batch_sizes, dtype=args.dtype, steps=args.steps, size=args.size,
    )


def _llm_report(args: argparse.Namespace, command: list[str]) -> dict:
    from stages.audit.llm import run_llm_audit

    if args.picture:
        print("--picture applies to the diffusion stage only", file=sys.stderr)
    reports = [
        run_llm_audit(
            model, kernels=args.kernels, targets=args.targets, batch_sizes=args.batch_sizes, orderings=args.orderings,
            samplings=args.samplings, max_tokens=args.max_tokens, ablation=args.ablation, command=command, log=_log,
            dtype=args.dtype, torch_threads=args.torch_threads,
        )
        for model in args.model or [None]
    ]
    report = reports[0]
    for extra in reports[1:]:
        report["runs"] += extra["runs"]
    return report


def audit(args: argparse.Namespace) -> int:
    """Run an invariance audit; exit 1 when kernels were on and any run differed."""
    from stages.audit.report import markdown_table, write_outputs

    command = ["omniserve", *sys.argv[1:]]
    report = (_diffusion_report if args.stage == "diffusion" else _llm_report)(args, command)
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

    from stages.bench import markdown, run_benchmark
    from stages.embedded import embedded_models

    report = run_benchmark(
        args.model or embedded_models("diffusion"), command=["omniserve", *sys.argv[1:]], sizes=args.sizes,
        batch_sizes=args.batch_sizes, steps=args.steps, repeats=args.repeats, log=_log,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    print(markdown(report))
    return 0


def _audit_parser(commands) -> None:
    from stages.audit.llm import ABLATIONS, ORDERINGS as LLM_ORDERINGS, SAMPLINGS, TARGETS

    parser = commands.add_parser(
        "audit", help="prove (or disprove) batch invariance bit for bit",
        description="Run a target request solo and co-batched in several orderings and batch sizes, "
        "kernels off (the control) and on, and count differing elements.",
    )
    parser.add_argument("--stage", choices=["diffusion", "llm"], required=True)
    parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    parser.add_argument("--json", metavar="PATH", help="write the full report (runs, summary, environment)")
    parser.add_argument("--markdown", metavar="PATH", help="write the evidence table")
    parser.add_argument("--kernels", type=_words, default=["off", "on"], help="settings to run (default: off,on)")
    parser.add_argument("--batch-sizes", type=_ints, default=list(range(1, 9)), help="e.g. 1-8 or 1,4,8")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    diffusion = parser.add_argument_group("diffusion stage")
    diffusion.add_argument("--picture", metavar="PATH", help="PNG of solo | co-batched | difference")
    diffusion.add_argument("--steps", type=int, default=8, help="denoising steps")
    diffusion.add_argument("--size", type=int, default=64, help="image side in pixels")
    llm = parser.add_argument_group("LLM stage")
    llm.add_argument("--targets", type=_words, default=list(TARGETS), help=f"of {','.join(TARGETS)}")
    llm.add_argument("--orderings", type=_words, default=list(LLM_ORDERINGS), help=f"of {','.join(LLM_ORDERINGS)}")
    llm.add_argument("--samplings", type=_words, default=list(SAMPLINGS), help=f"of {','.join(SAMPLINGS)}")
    llm.add_argument("--max-tokens", type=int, default=16)
    llm.add_argument("--torch-threads", type=int, default=None, help="OpenMP threads of vLLM's CPU worker")
    llm.add_argument("--ablation", choices=sorted(ABLATIONS), help="kernels on, one engine setting changed")
    parser.set_defaults(run=audit)


def _bench_parser(commands) -> None:
    parser = commands.add_parser("bench", help="diffusion throughput with batch-invariant kernels on vs off")
    parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    parser.add_argument("--sizes", type=_ints, default=[64, 256], help="image sides, e.g. 64,256")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    parser.set_defaults(run=bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniserve",
        description="Reproducible two-stage (LLM -> diffusion) generation on Ray Serve.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _audit_parser(commands)
    _bench_parser(commands)
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
