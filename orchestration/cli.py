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
        path=args.path,
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
    """`--load none`: images/s with kernels on vs off. Otherwise a served-load benchmark (see `omniserve bench -h`)."""
    import json
    from pathlib import Path

    command = ["omniserve", *sys.argv[1:]]
    module, report = _bench_run(args, command)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(module.markdown(report))
    if args.picture:
        if not hasattr(module, "picture"):
            print("--picture applies to --load mixed only", file=sys.stderr)
        else:
            module.picture(report, args.picture)
    print(module.markdown(report))
    return 0


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options the user set (None: the benchmark's own default, defined once in its spec)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _bench_run(args: argparse.Namespace, command: list[str]):
    """(the benchmark's module, its report) for `--load`."""
    model = args.model[0] if args.model else None
    if args.load == "none":
        from stages import bench as module
        from stages.embedded import embedded_models

        return module, module.run_benchmark(
            args.model or embedded_models("diffusion"), command=command, sizes=args.sizes, batch_sizes=args.batch_sizes,
            steps=args.steps, repeats=args.repeats or 5, log=_log)
    if args.load == "mixed":
        from stages import bench_load as module

        spec = module.LoadSpec(**_given(args, "rate", "requests", "short_fraction", "short_steps", "long_steps", "size", "seed"))
        return module, module.run_mixed_load(spec, modes=args.modes, repeats=args.repeats or 5, model=model,
                                             max_batch_size=args.max_batch_size, torch_threads=args.torch_threads,
                                             command=command, log=_log)
    if args.load == "distinct-guidance":
        from stages import bench_memory as module

        spec = module.MemorySpec(**_given(args, "requests", "warm_up", "concurrency", "size"))
        return module, module.run_memory(spec, modes=args.modes, model=model, torch_threads=args.torch_threads,
                                         command=command, log=_log)
    from orchestration import build_app
    from stages import bench_abandon as module

    spec = module.AbandonSpec(**_given(args, "give_up_s", "big_requests"), trials=args.repeats or 3)
    return module, module.run_abandon(build_app, spec, modes=args.modes, command=command, log=_log)


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
    diffusion.add_argument("--path", choices=["engine", "pipeline"], default="engine",
                           help="engine: the step engine that serves (neighbours of other steps and guidance); "
                           "pipeline: the diffusers pipeline on whole-request batches")
    llm = parser.add_argument_group("LLM stage")
    llm.add_argument("--targets", type=_words, default=list(TARGETS), help=f"of {','.join(TARGETS)}")
    llm.add_argument("--orderings", type=_words, default=list(LLM_ORDERINGS), help=f"of {','.join(LLM_ORDERINGS)}")
    llm.add_argument("--samplings", type=_words, default=list(SAMPLINGS), help=f"of {','.join(SAMPLINGS)}")
    llm.add_argument("--max-tokens", type=int, default=16)
    llm.add_argument("--torch-threads", type=int, default=None, help="OpenMP threads of vLLM's CPU worker")
    llm.add_argument("--ablation", choices=sorted(ABLATIONS), help="kernels on, one engine setting changed")
    parser.set_defaults(run=audit)


def _bench_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="diffusion benchmarks: kernels on vs off, and the stage under served loads",
        description="--load none (default): images/s of the diffusion renderer with batch-invariant kernels on vs off. "
        "--load mixed: Poisson arrivals of short and long requests, step-level vs request-level batching alternating "
        "in one process (per-class p50/p95 latency, images/s; --picture draws them). --load distinct-guidance: RSS "
        "growth of a replica after many requests with distinct guidance_scale values (a fresh process per mode). "
        "--load abandoned: on the default app over HTTP (local Ray), a small request right after big ones whose "
        "clients gave up. Options left out take each benchmark's own defaults (stages/bench*.py).",
    )
    parser.add_argument("--stage", choices=["diffusion"], default="diffusion")
    parser.add_argument("--load", choices=["none", "mixed", "distinct-guidance", "abandoned"], default="none")
    parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    parser.add_argument("--repeats", type=int, help="repeats per setting (default 5; trials per mode for abandoned: 3)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    parser.add_argument("--picture", metavar="PATH", help="--load mixed: PNG bars of p50/p95 latency per class and mode")
    kernels = parser.add_argument_group("--load none (kernels on vs off)")
    kernels.add_argument("--sizes", type=_ints, default=[64, 256], help="image sides, e.g. 64,256")
    kernels.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    kernels.add_argument("--steps", type=int, default=8)
    _bench_load_options(parser)
    parser.set_defaults(run=bench)


def _bench_load_options(parser) -> None:
    served = parser.add_argument_group("--load mixed / distinct-guidance / abandoned (the stage under load)")
    served.add_argument("--modes", type=_words, default=["step", "request"], help="batching modes (default: step,request)")
    served.add_argument("--requests", type=int, help="requests per run (mixed: 160; distinct-guidance: 10000)")
    served.add_argument("--size", type=int, help="image side (default 64)")
    served.add_argument("--max-batch-size", type=int, default=8)
    served.add_argument("--torch-threads", type=int, help="threads per stage (default: all usable cores)")
    mixed = parser.add_argument_group("--load mixed")
    mixed.add_argument("--rate", type=float, help="mean arrivals per second (Poisson)")
    mixed.add_argument("--short-fraction", type=float, help="share of short requests (default 0.5)")
    mixed.add_argument("--short-steps", type=int, help="default 4")
    mixed.add_argument("--long-steps", type=int, help="default 32")
    mixed.add_argument("--seed", type=int, help="the schedule's seed (repeat r uses seed + r)")
    memory = parser.add_argument_group("--load distinct-guidance")
    memory.add_argument("--warm-up", type=int, help="requests before the first RSS reading (default 500)")
    memory.add_argument("--concurrency", type=int, help="concurrent clients (default 16)")
    abandoned = parser.add_argument_group("--load abandoned")
    abandoned.add_argument("--big-requests", type=int, help="abandoned n=8 256x256 50-step requests (default 4)")
    abandoned.add_argument("--give-up-s", type=float, help="the big clients' timeout (default 1.0)")


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
