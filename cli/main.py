"""The `omniserve` command line: one entry for every command (`omniserve audit`, `bench`, `generate`, `verify`, `health`).

`generate`, `verify` and `health` talk to a running server (`--url`, else OMNISERVE_URL); `cli.client`
holds their HTTP side."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

#: The audit's batch sizes unless told (`--batch-sizes`).
AUDIT_BATCH_SIZES = list(range(1, 9))


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


def _audited_models(args: argparse.Namespace) -> list[str] | None:
    """The --model values, "default" standing for the stage's default model (whatever its id is; audit, bench)."""
    from stages.embedded import DEFAULT_MODELS

    return [DEFAULT_MODELS[args.stage] if model == "default" else model for model in args.model or []] or None


def _diffusion_report(args: argparse.Namespace, command: list[str]) -> dict:
    from evidence.diffusion import run_diffusion_audit
    from stages.embedded import embedded_models

    if args.parallel:
        return _parallel_report(args, command)
    return run_diffusion_audit(
        _audited_models(args) or embedded_models("diffusion"),
        picture_path=args.picture,
        command=command,
        log=_log,
        kernels=args.kernels,
        batch_sizes=args.batch_sizes,
        dtype=args.dtype,
        steps=args.steps,
        size=args.size or 64,
        path=args.path,
        torch_threads=args.torch_threads,
    )


def _parallel_report(args: argparse.Namespace, command: list[str]) -> dict:
    from evidence.parallel import DIT_MODELS, run_parallel_audit

    if args.picture or args.path != "engine" or args.batch_sizes != AUDIT_BATCH_SIZES:
        _log("--parallel renders one request on the step engine's family: --picture, --path, --batch-sizes unused")
    cfg, sp = args.parallel
    return run_parallel_audit(
        _audited_models(args) or DIT_MODELS,
        cfg=cfg,
        sp=sp,
        kernels=args.kernels,
        dtype=args.dtype,
        steps=args.steps,
        size=args.size or 64,
        torch_threads=args.torch_threads,
        command=command,
        log=_log,
    )


def _degrees(text: str) -> tuple[int, int]:
    from evidence.parallel import parse_degrees

    try:
        return parse_degrees(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _llm_report(args: argparse.Namespace, command: list[str]) -> dict:
    from evidence.llm import run_llm_audit

    if args.picture:
        print("--picture applies to the diffusion stage only", file=sys.stderr)
    models: Sequence[str | None] = _audited_models(args) or [None]  # None: the stage's default model
    reports = [
        run_llm_audit(
            model,
            kernels=args.kernels,
            targets=args.targets,
            batch_sizes=args.batch_sizes,
            orderings=args.orderings,
            samplings=args.samplings,
            max_tokens=args.max_tokens,
            ablation=args.ablation,
            command=command,
            log=_log,
            dtype=args.dtype,
            torch_threads=args.torch_threads,
            control_threads=args.control_threads,
            tensor_parallel=args.tensor_parallel,
        )
        for model in models
    ]
    report = reports[0]
    for extra in reports[1:]:
        report["runs"] += extra["runs"]
        report["scope"] += extra["scope"]
    return report


def audit(args: argparse.Namespace) -> int:
    """Run an invariance audit; exit 1 when kernels were on and any run differed, or `--record` recorded nothing."""
    from pathlib import Path

    from contracts.scope import user_records
    from evidence.record import record_report
    from evidence.report import markdown_table, write_outputs

    command = ["omniserve", *args.argv]
    if args.real_width:
        return _real_width(args, command)
    if args.stage is None:
        raise SystemExit("omniserve audit: --stage diffusion|llm (or --real-width)")
    report = (_diffusion_report if args.stage == "diffusion" else _llm_report)(args, command)
    write_outputs(report, args.json, args.markdown)
    print(markdown_table(report))
    differed = [r for r in report["runs"] if r["kernels"] == "on" and r["differing_elements"] > 0]
    if differed:
        print(f"NOT INVARIANT: {len(differed)} run(s) with kernels on differed", file=sys.stderr)
        return 1
    if args.record is not None:
        return 0 if record_report(report, Path(args.record) if args.record else user_records(), log=_log) else 1
    return 0


def _real_width(args: argparse.Namespace, command: list[str]) -> int:
    """`--real-width`: the families' denoisers and VAE decoders at public widths (evidence/real_width.py); the
    report is written after each component, so a run cut short keeps what it measured."""
    from evidence.real_width import FAMILIES, markdown, run_real_width_audit
    from evidence.report import write_outputs

    def write(report: dict) -> None:
        write_outputs(report, args.json, None)
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(markdown(report))

    if args.stage or args.model or args.record is not None or args.picture or args.parallel:
        _log("--real-width builds its own models: --stage, --model, --record, --picture, --parallel unused")
    report = run_real_width_audit(
        args.families or list(FAMILIES),
        size=args.size,
        blocks=args.blocks,
        arrangements=args.arrangements,
        kernels=args.kernels,
        torch_threads=args.torch_threads or 1,
        command=command,
        log=_log,
        progress=write,
    )
    write(report)
    print(markdown(report))
    differed = [r for r in report["runs"] if r["kernels"] == "on" and r["differing_elements"] > 0]
    if differed:
        print(f"NOT INVARIANT: {len(differed)} run(s) with kernels on differed", file=sys.stderr)
    return 1 if differed or report["failures"] else 0


def _arrangements(text: str) -> list[tuple[str, int]]:
    """'first:2,middle:3,last:4' -> [("first", 2), ...]."""
    pairs = []
    for word in _words(text):
        ordering, _, size = word.partition(":")
        if ordering not in ("first", "middle", "last") or not size.isdigit() or int(size) < 2:
            raise argparse.ArgumentTypeError(f"{word!r}: ORDERING:BATCH, ORDERING first|middle|last, BATCH >= 2")
        pairs.append((ordering, int(size)))
    return pairs


def bench(args: argparse.Namespace) -> int:
    """One benchmark (see `omniserve bench -h`): its report printed as markdown, and written where asked."""
    import json
    from pathlib import Path

    command = ["omniserve", *args.argv]
    module, report = (_bench_run if args.stage == "diffusion" else _stage_run)(args, command)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(module.markdown(report))
    if args.picture:
        if not hasattr(module, "picture"):
            print("--picture: this benchmark draws none (--load distinct-guidance, abandoned)", file=sys.stderr)
        else:
            module.picture(report, args.picture)
    print(module.markdown(report))
    return 0


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options the user set (None: the benchmark's own default, defined once in its spec)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _bench_run(args: argparse.Namespace, command: list[str]):
    """(the benchmark's module, its report) for `--load`."""
    from bench import load

    model = args.model[0] if args.model else None
    if args.cache:
        return _cache_bench(args, command)
    if args.load == "none":
        from bench import diffusion as module
        from stages.embedded import embedded_models

        return module, module.run_benchmark(
            args.model or embedded_models("diffusion"),
            command=command,
            sizes=args.sizes,
            batch_sizes=args.batch_sizes,
            steps=args.steps or 8,
            repeats=args.repeats or 5,
            log=_log,
        )
    if args.load == "mixed":
        load_spec = load.LoadSpec(
            **_given(
                args, "rate", "requests", "short_fraction", "short_steps", "long_steps", "size", "long_size", "seed"
            )
        )
        return load, load.run_mixed_load(
            load_spec,
            modes=args.modes,
            repeats=args.repeats or 5,
            model=model,
            max_batch_size=args.max_batch_size,
            torch_threads=args.torch_threads,
            command=command,
            log=_log,
        )
    if args.load == "distinct-guidance":
        from bench import memory

        given = _given(args, "requests", "warm_up", "size")
        if args.concurrency:
            given["concurrency"] = _one(args.concurrency, "--concurrency")
        memory_spec = memory.MemorySpec(**given)
        return memory, memory.run_memory(
            memory_spec, modes=args.modes, model=model, torch_threads=args.torch_threads, command=command, log=_log
        )
    from bench import abandon
    from orchestration import build_app

    abandon_spec = abandon.AbandonSpec(**_given(args, "give_up_s", "big_requests"), trials=args.repeats or 3)
    return abandon, abandon.run_abandon(build_app, abandon_spec, modes=args.modes, command=command, log=_log)


def _cache_bench(args: argparse.Namespace, command: list[str]):
    """(the benchmark's module, its report) for `--cache`: step caching against off (bench/step_cache.py)."""
    from bench import load, step_cache
    from stages.embedded import DEFAULT_MODELS

    mixed = _given(args, "rate", "short_steps", "seed")
    return step_cache, step_cache.run_cache_bench(
        _audited_models(args) or [DEFAULT_MODELS["diffusion"]],
        args.cache,
        steps_list=[args.steps] if args.steps else [50, 8],
        images=args.requests or 16,
        repeats=args.repeats or 3,
        spec=load.LoadSpec(**{"rate": 2.0, "requests": 24, "short_steps": 8, **mixed}),
        max_batch_size=args.max_batch_size,
        torch_threads=args.torch_threads or 2,
        command=command,
        log=_log,
    )


def _one(values: list[int], option: str) -> int:
    if len(values) != 1:
        raise SystemExit(f"{option}: this benchmark takes one value, got {values}")
    return values[0]


def _stage_run(args: argparse.Namespace, command: list[str]):
    """(the benchmark's module, its report) for `--stage llm | app | kernels`."""
    if args.stage == "llm":
        from bench import llm as module

        given = _given(args, "concurrency", "requests", "max_tokens", "torch_threads", "repeats")
        spec = module.LLMBenchSpec(**given, model=args.model[0] if args.model else None)
        return module, module.run_llm_bench(spec, command=command, log=_log)
    if args.stage == "app":
        from bench import app as app_bench
        from orchestration import build_app
        from orchestration.config import AppConfig

        given = _given(args, "concurrency", "requests", "size", "steps", "repeats")
        app = (
            AppConfig.from_args(dict(_pair(item) for item in args.app)).model_dump(exclude_unset=True)
            if args.app
            else {}
        )
        app_spec = app_bench.AppBenchSpec(**given, rewrites=[w == "on" for w in args.rewrites], app=app)
        return app_bench, app_bench.run_app_bench(build_app, app_spec, command=command, log=_log)
    from bench import gemm  # the CPU GEMM kernels against stock, per thread count

    return gemm, gemm.run_benchmark(repeats=args.repeats or 5, threads=args.threads, command=command)


def _pair(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--app takes key=value (e.g. diffusion.num_replicas=2), got {item!r}")
    return key, value


def _audit_parser(commands) -> None:
    parser = commands.add_parser(
        "audit",
        help="prove (or disprove) batch invariance bit for bit",
        description="Run a target request solo and co-batched in several orderings and batch sizes, "
        "kernels off (the control) and on, and count differing elements.",
    )
    parser.add_argument("--stage", choices=["diffusion", "llm"], help="the stage to audit (or --real-width)")
    parser.add_argument(
        "--model",
        action="append",
        help="model id or path, or `default`: the stage's default model "
        "(repeatable; default: diffusion, the embedded random-weight ones; llm, its default)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full report (runs, summary, environment)")
    parser.add_argument("--markdown", metavar="PATH", help="write the evidence table")
    parser.add_argument("--kernels", type=_words, default=["off", "on"], help="settings to run (default: off,on)")
    parser.add_argument("--batch-sizes", type=_ints, default=AUDIT_BATCH_SIZES, help="e.g. 1-8 or 1,4,8")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads of the renderer / of vLLM's CPU worker (default: torch's, vLLM's own choice)",
    )
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        metavar="DIR",
        help="write a scope record per configuration whose control varied and whose kernels-on runs "
        "had 0 differing elements (default DIR: the user's cache; docs/evidence/scope for shipped ones)",
    )
    _audit_stage_arguments(parser)
    _real_width_arguments(parser)
    parser.set_defaults(run=audit)


def _real_width_arguments(parser) -> None:
    real = parser.add_argument_group(
        "--real-width (denoisers and VAE decoders at public configurations' widths, random weights; one forward "
        "solo vs co-batched, kernels off and on, timed; verifies the kernels at those shapes, not a checkpoint)"
    )
    real.add_argument("--real-width", action="store_true", help="run the real-width audit (evidence/real_width.py)")
    real.add_argument(
        "--families",
        type=_words,
        help="of sd15,sdxl,sd35m,flux1,qwen-image,wan21 (default: all); --size: the image side (default 128), "
        "--torch-threads: default 1",
    )
    real.add_argument("--blocks", type=int, help="blocks of the families cut short (default: each family's own)")
    real.add_argument(
        "--arrangements",
        type=_arrangements,
        default=[("first", 2), ("middle", 3), ("last", 4)],
        help="the target's place and batch size, e.g. first:2,middle:3,last:4 (the default)",
    )


def _audit_stage_arguments(parser) -> None:
    """The audit's options of one stage each."""
    from evidence.llm import ABLATIONS, SAMPLINGS, TARGETS
    from evidence.llm import ORDERINGS as LLM_ORDERINGS

    diffusion = parser.add_argument_group("diffusion stage")
    diffusion.add_argument("--picture", metavar="PATH", help="PNG of solo | co-batched | difference")
    diffusion.add_argument("--steps", type=int, default=8, help="denoising steps")
    diffusion.add_argument("--size", type=int, help="image side in pixels (default 64; --real-width: 128)")
    diffusion.add_argument(
        "--path",
        choices=["engine", "pipeline"],
        default="engine",
        help="engine: the step engine that serves (neighbours of other steps and guidance); "
        "pipeline: the diffusers pipeline on whole-request batches",
    )
    diffusion.add_argument(
        "--parallel",
        type=_degrees,
        metavar="cfg=N,sp=N",
        help="one guided request rendered by gloo workers (SD3 DiTs): CFG parallel, Ulysses sequence parallel or "
        "both, each grid against the single worker, bit for bit; records carry the degree",
    )
    llm = parser.add_argument_group("LLM stage")
    llm.add_argument("--targets", type=_words, default=list(TARGETS), help=f"of {','.join(TARGETS)}")
    llm.add_argument("--orderings", type=_words, default=list(LLM_ORDERINGS), help=f"of {','.join(LLM_ORDERINGS)}")
    llm.add_argument("--samplings", type=_words, default=list(SAMPLINGS), help=f"of {','.join(SAMPLINGS)}")
    llm.add_argument("--max-tokens", type=int, default=16)
    llm.add_argument(
        "--control-threads",
        type=int,
        default=None,
        help="run off and on again at this thread count too: where the control never varies at "
        "--torch-threads, a record may rest on one that varies here if the kernels-on bits are equal",
    )
    llm.add_argument("--ablation", choices=sorted(ABLATIONS), help="kernels on, one engine setting changed")
    llm.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="vLLM workers per engine (tensor_parallel_size; --torch-threads is per worker)",
    )


def _bench_parser(commands) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmarks: invariance off vs on per stage and for the app, and the diffusion stage under load",
        description="Every benchmark measures in one run, settings alternating, several repeats; ratios are "
        "median (min-max). --stage diffusion --load none (default): images/s of the diffusion renderer with "
        "batch-invariant kernels on vs off, per size and batch size. --stage llm: the LLM stage's chat request on two "
        "engines (invariance off, on), output tokens/s and p50/p95 latency per concurrency. --stage app: two apps "
        "over HTTP (local Ray, loopback), both stages off vs both on, images/s and p50/p95 latency with prompt "
        "rewriting off and on. --stage kernels: the CPU GEMM kernels against stock, per thread count. "
        "--picture: a PNG of the on/off ratio against batch size or concurrency (--load mixed: latency bars). "
        "--load mixed: Poisson arrivals of short and long requests, step-level vs request-level batching alternating "
        "in one process. --load distinct-guidance: RSS growth of a replica after many requests with distinct "
        "guidance_scale values. --load abandoned: on the default app over HTTP, a small request right after big "
        "ones whose clients gave up. Options left out take each benchmark's own defaults (bench/, "
        "bench/app.py).",
    )
    parser.add_argument("--stage", choices=["diffusion", "llm", "app", "kernels"], default="diffusion")
    parser.add_argument(
        "--load",
        choices=["none", "mixed", "distinct-guidance", "abandoned"],
        default="none",
        help="--stage diffusion only",
    )
    parser.add_argument("--model", action="append", help="model id or path (repeatable; default: the embedded ones)")
    parser.add_argument("--repeats", type=int, help="repeats per setting (default 5; llm, app, abandoned: 3)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    parser.add_argument(
        "--picture",
        metavar="PATH",
        help="PNG: on/off ratio (llm, app, kernels, --load none); "
        "--load mixed: p50/p95 latency bars per class and mode",
    )
    kernels = parser.add_argument_group("--stage diffusion --load none (kernels on vs off)")
    kernels.add_argument("--sizes", type=_ints, default=[64, 256], help="image sides, e.g. 64,256")
    kernels.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    kernels.add_argument("--steps", type=int, help="denoising steps (default 8)")
    stages = parser.add_argument_group("--stage llm / app (invariance off vs on)")
    stages.add_argument(
        "--concurrency",
        type=_ints,
        help="requests in flight, e.g. 1,4,8,16 (llm default; app: 16; distinct-guidance: one value, 16)",
    )
    stages.add_argument("--max-tokens", type=int, help="llm: output tokens per request, exactly (default 32)")
    stages.add_argument(
        "--rewrites", type=_words, default=["off", "on"], help="app: enhance_prompt settings (default off,on)"
    )
    stages.add_argument(
        "--app",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="app: config both apps share, dotted keys (e.g. diffusion.num_replicas=2; repeatable)",
    )
    parser.add_argument_group("--stage kernels").add_argument(
        "--threads", type=_ints, default=[1, 2], help="torch threads, e.g. 1,2"
    )
    _bench_load_options(parser)
    parser.set_defaults(run=bench)


def _bench_load_options(parser) -> None:
    parser.add_argument_group("--stage diffusion --cache (step caching, bench/step_cache.py)").add_argument(
        "--cache",
        type=_words,
        help="cache settings against off, e.g. off,0.1,0.2 (TeaCache thresholds); with --steps one step count "
        "(default 50 and 8), --requests images per burst (default 16), --rate the mixed load's arrivals",
    )
    served = parser.add_argument_group("--load mixed / distinct-guidance / abandoned (the stage under load)")
    served.add_argument(
        "--modes",
        type=_words,
        default=["step", "request"],
        help="batching modes (default: step,request; mixed also step-by-shape: the step engine without FLUX's size "
        "packing)",
    )
    served.add_argument(
        "--requests",
        type=int,
        help="requests per run or point (mixed: 160; distinct-guidance: 10000; llm: 64; app: 96)",
    )
    served.add_argument("--size", type=int, help="image side (default 64; also --stage app)")
    served.add_argument("--max-batch-size", type=int, default=8)
    served.add_argument(
        "--torch-threads", type=int, help="threads per stage (default: all usable cores; llm: the stage's, 1)"
    )
    mixed = parser.add_argument_group("--load mixed")
    mixed.add_argument("--rate", type=float, help="mean arrivals per second (Poisson)")
    mixed.add_argument("--short-fraction", type=float, help="share of short requests (default 0.5)")
    mixed.add_argument("--short-steps", type=int, help="default 4")
    mixed.add_argument("--long-steps", type=int, help="default 32")
    mixed.add_argument("--long-size", type=int, help="the long requests' image side (default: --size)")
    mixed.add_argument("--seed", type=int, help="the schedule's seed (repeat r uses seed + r)")
    memory = parser.add_argument_group("--load distinct-guidance")
    memory.add_argument("--warm-up", type=int, help="requests before the first RSS reading (default 500)")
    abandoned = parser.add_argument_group("--load abandoned")
    abandoned.add_argument("--big-requests", type=int, help="abandoned n=8 256x256 50-step requests (default 4)")
    abandoned.add_argument("--give-up-s", type=float, help="the big clients' timeout (default 1.0)")


def generate(args: argparse.Namespace) -> int:
    """Stream one generation with a progress bar; write the PNGs into --out."""
    from pathlib import Path

    from cli.client import ServerError
    from cli.client import generate as stream_images

    body = {**_sampling_body(args), "n": args.n, "partial_images": args.partial_images}
    try:
        stream_images(args.url, body, Path(args.out))
    except ServerError as err:
        print(f"omniserve generate: {err}", file=sys.stderr)
        return 1
    return 0


def _sampling_body(args: argparse.Namespace) -> dict:
    """The request fields `generate` and `video` share, those given."""
    options = {
        "seed": args.seed,
        "size": args.size,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "negative_prompt": args.negative_prompt,
    }
    return {
        "prompt": args.prompt,
        "enhance_prompt": not args.no_enhance,
        **{k: v for k, v in options.items() if v is not None},
    }


def video(args: argparse.Namespace) -> int:
    """One video job with a progress bar; write the MP4 into --out."""
    from pathlib import Path

    from cli.client import ServerError
    from cli.client import video as make_video

    extra = {"seconds": args.seconds, "num_frames": args.frames}
    try:
        make_video(
            args.url, {**_sampling_body(args), **{k: v for k, v in extra.items() if v is not None}}, Path(args.out)
        )
    except ServerError as err:
        print(f"omniserve video: {err}", file=sys.stderr)
        return 1
    return 0


def verify(args: argparse.Namespace) -> int:
    """Render each file again on the server from its own provenance; 0 only if every sha256 matches."""
    from pathlib import Path

    from cli.client import ServerError
    from cli.client import verify as verify_files

    try:
        return verify_files(args.url, [Path(p) for p in args.images])
    except ServerError as err:
        print(f"omniserve verify: {err}", file=sys.stderr)
        return 2


def health(args: argparse.Namespace) -> int:
    """/health as a table; exit 1 when the server says it is down (or cannot be reached)."""
    from cli.client import ServerError, get_json, health_table

    try:
        report = get_json(args.url, "/health", ok=(503,))
    except ServerError as err:
        print(f"omniserve health: {err}", file=sys.stderr)
        return 1
    print(health_table(report))
    return 1 if report.get("status") == "down" else 0


def _client_parsers(commands) -> None:
    from contracts.envs import read

    url = argparse.ArgumentParser(add_help=False)
    url.add_argument(
        "--url", default=read("OMNISERVE_URL"), help="the server (default: $OMNISERVE_URL, else %(default)s)"
    )
    parser = commands.add_parser(
        "generate",
        parents=[url],
        help="generate images on a running server, with progress",
        description="One streamed request; each image is written as OUT/image-<i>-<seed>.png "
        "with its provenance inside, and printed with its seed and sha256.",
    )
    _sampling_arguments(parser, "image i gets its own, derived from it")
    parser.add_argument("--n", type=int, help="images (default 1)")
    parser.add_argument("--partial-images", type=int, default=2, help="previews per image, 0-3 (default 2)")
    parser.add_argument("--out", default=".", help="directory for the PNGs (default: here)")
    parser.set_defaults(run=generate)
    parser = commands.add_parser(
        "video",
        parents=[url],
        help="generate a video on a running server (its Videos API), with progress",
        description="One video job, polled until done; its MP4 is written as OUT/video-<seed>.mp4 with its "
        "provenance inside, and printed with its seed, frames and sha256.",
    )
    _sampling_arguments(parser, "required where the video stage is batch invariant")
    parser.add_argument("--seconds", help="length in seconds (seconds x the server's fps + 1 frames)")
    parser.add_argument("--frames", type=int, help="frames, instead of --seconds (the tiny Wan: 4k + 1)")
    parser.add_argument("--out", default=".", help="directory for the MP4 (default: here)")
    parser.set_defaults(run=video)
    parser = commands.add_parser(
        "verify",
        parents=[url],
        help="check that the server renders image files again bit for bit",
        description="Reads each file's provenance, compares the server's stages with it, renders "
        "it again (n=1, its seed and parameters) and compares sha256. Exit 0 only if all match.",
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE.png")
    parser.set_defaults(run=verify)
    parser = commands.add_parser("health", parents=[url], help="the server's stages, switches, kernels and replicas")
    parser.set_defaults(run=health)


def _sampling_arguments(parser: argparse.ArgumentParser, seed: str) -> None:
    parser.add_argument("prompt")
    parser.add_argument("--seed", type=int, help=f"the request's seed ({seed})")
    parser.add_argument("--size", help="WIDTHxHEIGHT, e.g. 64x64 (default: the model's)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the server's)")
    parser.add_argument("--guidance-scale", type=float)
    parser.add_argument("--negative-prompt")
    parser.add_argument("--no-enhance", action="store_true", help="render the prompt as given (no LLM rewrite)")


def golden(args: argparse.Namespace) -> int:
    """Render the canonical requests on this machine's path; compare with the table, or (--record) write the columns."""
    from evidence.golden import compare_or_record

    return compare_or_record(
        _words(args.dtypes),
        record=args.record,
        table=args.table,
        log=_log,
        stages=_words(args.stages),
        llm_model=args.llm_model,
    )


def _golden_parser(commands) -> None:
    from contracts.scope import GOLDEN_TABLE

    parser = commands.add_parser(
        "golden",
        help="the golden table: canonical requests and their sha256 on this kernel path",
        description="Renders the canonical requests (the default models, torch_threads 1, invariance on) on this "
        "machine's kernel path and compares each sha256 with the golden table's column (exit 1 naming what differs), "
        "or with --record writes this path's columns.",
    )
    parser.add_argument("--stages", default="diffusion,llm", help="stages (default %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="diffusion dtypes (default %(default)s)")
    parser.add_argument("--record", action="store_true", help="write (replace) this path's columns")
    parser.add_argument("--llm-model", help="the LLM's model (default: the stage's default; e.g. embedded:tiny-llama)")
    parser.add_argument(
        "--table", type=Path, default=GOLDEN_TABLE, help="the table (default: docs/evidence/golden.json)"
    )
    parser.set_defaults(run=golden)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniserve",
        description="Reproducible two-stage (LLM -> diffusion) generation on Ray Serve.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _audit_parser(commands)
    _bench_parser(commands)
    _golden_parser(commands)
    _client_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from contracts.cpu import hold_process_to_path

    hold_process_to_path()  # ATen, oneDNN and MKL at the kernel path's level, before their first use
    parser = build_parser()
    args = parser.parse_args(argv)
    # What a report records as its command: the arguments given (a caller's own, when it calls main with them).
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
