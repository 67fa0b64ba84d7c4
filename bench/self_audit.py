"""What a replica's start-up self-audit costs (stages/diffusion/self_audit.py, stages/llm/self_audit.py): a diffusion,
video or LLM replica's start with `self_audit: off`, with `quick` on a first start (an empty record cache: it audits) and on a second start (its
record reused), each start in a fresh process, as a replica starts, the modes alternating over repeats.

A benchmark, not a test. A start is the Serve class's constructor (model load or engine start, kernels, golden
self-check, self-audit, warm-up off), timed inside the process; the process's imports are not counted (the same for
every mode).

    .venv/bin/python -m bench.self_audit --repeats 3 [--stage video|llm] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from contracts.cpu import cpu_isa
from evidence.report import environment

#: One replica start in this process: prints {"seconds", "verified", "self_audit"} as JSON.
START = """
import asyncio, json, sys, time
from pathlib import Path
import contracts.scope
records = Path(sys.argv[1])
contracts.scope.user_records = lambda: records
from contracts.config import DiffusionStageConfig, LLMStageConfig, VideoStageConfig
settings = {"batch_invariant": True, "torch_threads": 1, "self_audit": sys.argv[2]}

def diffusion(video):
    if video:
        from stages.diffusion.video_stage import VideoStage as Stage
    else:
        from stages.diffusion import DiffusionStage as Stage
    config = (VideoStageConfig if video else DiffusionStageConfig)(warm_up=False, **settings)
    started = time.monotonic()
    stage = Stage.func_or_class(config)
    seconds = time.monotonic() - started
    stage.batching.engine.stop()
    return seconds, stage.scope

async def llm():
    from stages.llm import LLMStage
    stage = LLMStage.func_or_class.__new__(LLMStage.func_or_class)
    started = time.monotonic()
    await stage.__init__(LLMStageConfig(**settings))
    seconds = time.monotonic() - started
    stage.engine.shutdown()
    return seconds, stage.engine.scope

if __name__ == "__main__":
    seconds, scope = asyncio.run(llm()) if sys.argv[3] == "llm" else diffusion(sys.argv[3] == "video")
    audit = scope.self_audit
    print(json.dumps({"seconds": seconds, "verified": scope.verdict.verified,
                      "self_audit": audit.model_dump() if audit else None}))
"""

MODES = ("off", "quick, first start", "quick, second start")


def start(records: Path, mode: str, stage: str) -> dict:
    """One start: the constructor's seconds (timed inside) and the whole process's (imports and exit included). A
    process that aborts at exit after printing its result still counts, with its exit status kept (a diffusion
    start's process ended in SIGABRT, "terminate called without an active exception", until `StepEngine.stop` waited
    for its thread: docs/invariance/scope.md)."""
    audit = "off" if mode == "off" else "quick"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", START, str(records), audit, stage], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"the start printed no result (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1]) | {"process_seconds": time.monotonic() - began, "exit": done.returncode}


def run(repeats: int, stage: str) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as directory:
            records = Path(directory) / "scope"
            order = MODES if repeat % 2 == 0 else ("quick, first start", "quick, second start", "off")
            for mode in order:  # a second start always follows its first; off before or after them
                results[mode].append(start(records, mode, stage))
    return results


def markdown(results: dict[str, list[dict]], stage: str) -> str:
    off = [r["seconds"] for r in results["off"]]
    lines = [
        f"### The {stage} replica's start with and without its self-audit",
        "",
        f"`.venv/bin/python -m bench.self_audit {' '.join(sys.argv[1:])}` ({environment()['hardware']['cpu']}, CPU kernel path {cpu_isa()}); seconds per start, min / median / max over "
        f"{len(off)} repeats, each start a fresh process (constructor: timed inside it; process: its whole life, "
        "imports of torch, diffusers or vLLM included); ratios to `off` paired by repeat.",
        "",
        "| self_audit | constructor s | ratio to off | process s | ratio to off | rendered runs | verified | what it said |",
        "|---|---|---|---|---|---|---|---|",
    ]
    whole = [r["process_seconds"] for r in results["off"]]
    for mode, runs in results.items():
        cells = []
        for key, base in (("seconds", off), ("process_seconds", whole)):
            seconds = [r[key] for r in runs]
            ratios = [s / o for s, o in zip(seconds, base, strict=True)]
            cells.append(f"{min(seconds):.2f} / {statistics.median(seconds):.2f} / {max(seconds):.2f}")
            cells.append(f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}")
        audit = runs[-1]["self_audit"]
        lines.append(
            f"| {mode} | {' | '.join(cells)} "
            f"| {audit['runs'] if audit else 0} | {runs[-1]['verified']} | {audit['reason'] if audit else 'not run'} |"
        )
    aborted = sum(r["exit"] != 0 for runs in results.values() for r in runs)
    lines.append(
        f"\nProcesses that exited non-zero after printing their result: {aborted} of {len(off) * len(results)}."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stage", choices=("diffusion", "video", "llm"), default="diffusion")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    report = markdown(run(args.repeats, args.stage), args.stage)
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
