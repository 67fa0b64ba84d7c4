"""What the self-audit adds to `make serve`'s whole start-up: the example app (LLM, diffusion and video stages, both
switches on) started as `make serve` starts it (`python -m cli.run`, its environment), timed from the process's start
until `/health` answers 200, with every stage's `self_audit: off`, on a first start (no record: each stage audits)
and on a second start (their records reused); a fresh process each, the modes' order alternating over repeats.

    .venv/bin/python -m bench.app_start --repeats 3 [--markdown FILE]

A first start needs the user's record cache without this configuration's records: the bench moves
`$OMNISERVE_CACHE/scope` aside for it (renamed beside itself) and puts it back after, whatever happens. Port 8000
must be free (serve run's). The app is stopped by SIGTERM to its own process group, then SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import contracts.scope
from cli.run import port_is_free
from contracts import envs
from contracts.cpu import cpu_isa
from evidence.report import environment

URL = "http://127.0.0.1:8000"
STAGES = ("llm", "diffusion", "video")
#: The example app's own arguments (examples/omni_app.py), through its builder so each stage's self_audit can be set.
APP_ARGS = ("ingress.result_cache_mib=256", "video.ray_actor_options.num_cpus=0.2")
MODES = ("off", "quick, first start", "quick, second start")
START_TIMEOUT_S = 600
#: What the Makefile's `serve` recipe sets.
MAKE_SERVE_ENVIRONMENT = {
    "OMNI_LLM_BATCH_INVARIANT": "1",
    "OMNI_DIFFUSION_BATCH_INVARIANT": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


@contextlib.contextmanager
def records_aside() -> Iterator[None]:
    """The user's record cache moved aside (renamed beside itself) while the block runs; put back after."""
    records = contracts.scope.user_records()
    aside = records.with_name(f"{records.name}.bench-app-start-{os.getpid()}")
    moved = records.exists()
    if moved:
        records.rename(aside)
    try:
        yield
    finally:
        if moved:
            shutil.rmtree(records, ignore_errors=True)  # what this start wrote
            aside.rename(records)


def start(mode: str) -> dict:
    """One whole start: seconds until /health answers 200, and each stage's self-audit as /health reports it."""
    audit = "off" if mode == "off" else "quick"
    args = [*APP_ARGS, *(f"{stage}.self_audit={audit}" for stage in STAGES)]
    began = time.monotonic()
    with envs.overriding(MAKE_SERVE_ENVIRONMENT):
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.run", "examples.omni_app:app_builder", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        health = _healthy(process)
        seconds = time.monotonic() - began
    finally:
        _stop(process)
    audits = {stage: _audit(health, stage) for stage in STAGES}
    return {"seconds": seconds, "self_audit": audits}


def _healthy(process: subprocess.Popen) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the app exited with {process.returncode} before it was healthy")
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(f"{URL}/health", timeout=10)
            if response.status_code == 200:
                return response.json()
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {START_TIMEOUT_S} s")


def _audit(health: dict, stage: str) -> dict | None:
    """The stage's self-audit (its first replica's) as /health shows it."""
    audits = (health.get("stages", {}).get(stage) or {}).get("self_audit") or {}
    return next(iter(audits.values()), None)


def _stop(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 90), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run(repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        order = MODES if repeat % 2 == 0 else ("quick, first start", "quick, second start", "off")
        with records_aside():  # a first start, its second start after it, and off, on an empty record cache
            for mode in order:
                results[mode].append(start(mode))
                print(mode, round(results[mode][-1]["seconds"], 1), file=sys.stderr, flush=True)
    return results


def markdown(results: dict[str, list[dict]]) -> str:
    off = [r["seconds"] for r in results["off"]]
    lines = [
        "### `make serve`'s whole start-up with and without the self-audit",
        "",
        f"`.venv/bin/python -m bench.app_start {' '.join(sys.argv[1:])}` ({environment()['hardware']['cpu']}, CPU "
        f"kernel path {cpu_isa()}): seconds from the process's start until `/health` answers 200 (the example app: "
        f"LLM, diffusion and video stages), min / median / max over {len(off)} repeats, each a fresh process; ratios to "
        "`off` paired by repeat. Each stage's own self-audit seconds as its replica reported them.",
        "",
        "| self_audit | start s | ratio to off | LLM audit s | diffusion audit s | video audit s | reused |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        ratios = [s / o for s, o in zip(seconds, off, strict=True)]
        stage_s = []
        for stage in STAGES:
            audits = [r["self_audit"][stage] for r in runs if r["self_audit"][stage]]
            stage_s.append(f"{statistics.median(a['seconds'] for a in audits):.1f}" if audits else "-")
        reused = sorted({str(bool(a["reused"])) for r in runs for a in r["self_audit"].values() if a})
        lines.append(
            f"| {mode} | {min(seconds):.1f} / {statistics.median(seconds):.1f} / {max(seconds):.1f} "
            f"| {min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f} | {' | '.join(stage_s)} "
            f"| {', '.join(reused) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if not port_is_free(8000):
        raise SystemExit("port 8000 is in use: stop what serves there first")
    report = markdown(run(args.repeats))
    print(report)
    if args.markdown:
        args.markdown.write_text(report)


if __name__ == "__main__":
    main()
