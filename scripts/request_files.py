"""Which of the project's files one image request runs, measured in every process of a running app.

    .venv/bin/python scripts/request_files.py hook /tmp/trace          # writes /tmp/trace/sitecustomize.py
    PYTHONPATH=/tmp/trace make serve &                                  # every Python process of the app is traced
    .venv/bin/python scripts/request_files.py measure /tmp/trace --base http://127.0.0.1:8000

`hook` writes a sitecustomize module that each Python process the app starts (the Serve controller, the proxy,
every replica, vLLM's engine core) imports first: it records, per file of this checkout, the hundredths of a second
in which one of its functions was called (`sys.setprofile`, every thread) and writes them to `<dir>/<pid>.json`
twice a second. `measure` sends one warm-up request, waits, watches an idle window, then sends one image request
(seeded, `Cache-Control: no-cache`: rendered, not read from the result cache) and lists the files called during
it, in the order they were first called, each marked where the same file was also called while the app was idle
(a health check, a metrics push, a polling loop: those are not the request's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contracts", "stages", "orchestration", "examples", "cli")
TIMEOUT_S = 600
#: The trace's clock: ticks per second (a hundredth of a second), in the hook and in the windows read from it.
TICKS_PER_S = 100
IDLE_S = 5.0

HOOK = """
import atexit, json, os, sys, threading, time
_ROOTS = tuple(os.path.join({root!r}, p) + os.sep for p in {packages!r})
_OUT = os.path.join({out!r}, f"{{os.getpid()}}.json")
_seen = {{}}


def _profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(_ROOTS):
        code = frame.f_code
        _seen.setdefault(f"{{code.co_filename}}:{{code.co_qualname}}", set()).add(int(time.time() * {ticks_per_s}))


def _dump():
    snapshot = {{name: sorted(ticks) for name, ticks in list(_seen.items())}}
    with open(_OUT + ".tmp", "w") as f:
        json.dump(snapshot, f)
    os.replace(_OUT + ".tmp", _OUT)


def _dump_often():
    while True:
        time.sleep(0.5)
        _dump()


sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_dump_often, daemon=True).start()
atexit.register(_dump)  # a process that ends between two dumps
"""


def write_hook(trace_dir: Path) -> None:
    trace_dir.mkdir(parents=True, exist_ok=True)
    hook = HOOK.format(root=str(ROOT), packages=PACKAGES, out=str(trace_dir), ticks_per_s=TICKS_PER_S)
    (trace_dir / "sitecustomize.py").write_text(hook)
    print(f"PYTHONPATH={trace_dir} make serve")


def ticks_by_function(trace_dir: Path) -> dict[tuple[str, str], set[int]]:
    """(file, function) -> the hundredths of a second it was called in, over every process's dump."""
    merged: dict[tuple[str, str], set[int]] = {}
    for dump in trace_dir.glob("*.json"):
        for key, ticks in json.loads(dump.read_text()).items():
            name, function = key.rsplit(":", 1)
            merged.setdefault((name, function), set()).update(ticks)
    return merged


def image(http: httpx.Client, seed: int) -> None:
    body = {"prompt": f"a red circle {seed}", "seed": seed, "size": "64x64", "response_format": "b64_json"}
    response = http.post("/v1/images/generations", json=body, headers={"Cache-Control": "no-cache"})
    response.raise_for_status()


def measure(trace_dir: Path, base: str) -> None:
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as http:
        nonce = time.time_ns() % 2**40  # prompts never sent before: no rewrite is read from the ingress's cache
        image(http, nonce)  # warm-up: first calls, lazy imports, compilation
        time.sleep(2.0)
        idle_from = time.time()
        time.sleep(IDLE_S)
        start = time.time()
        image(http, nonce + 1)
        end = time.time()
    time.sleep(1.5)  # the next dumps
    called, idle_files, functions = called_during(
        ticks_by_function(trace_dir),
        window=range(int(start * TICKS_PER_S), int(end * TICKS_PER_S) + 1),
        idle=range(int(idle_from * TICKS_PER_S), int(start * TICKS_PER_S)),
    )
    only = [name for name in called if name not in idle_files]
    print(f"one image request, {end - start:.2f} s: {len(called)} files called, {len(only)} of them only by it")
    for name in called:
        print(f"  {Path(name).relative_to(ROOT)}{'   (also called while idle)' if name in idle_files else ''}")
        print(f"      {', '.join(sorted(set(functions[name])))}")


def called_during(
    ticks: dict[tuple[str, str], set[int]], window: range, idle: range
) -> tuple[list[str], set[str], dict[str, list[str]]]:
    """The files with a function called in `window`, in the order first called; those with any function called in
    `idle` too; and each file's functions called in `window`."""
    first: dict[str, int] = {}
    functions: dict[str, list[str]] = {}
    idle_files: set[str] = set()
    for (name, function), called in ticks.items():
        if any(t in idle for t in called):
            idle_files.add(name)
        during = [t for t in called if t in window]
        if during:
            earliest = min(during)
            first[name] = min(first.get(name, earliest), earliest)
            functions.setdefault(name, []).append(function)
    return sorted(first, key=first.__getitem__), idle_files, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("hook", "measure"))
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    if args.command == "hook":
        write_hook(args.trace_dir)
    else:
        measure(args.trace_dir, args.base)


if __name__ == "__main__":
    main()
