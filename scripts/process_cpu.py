"""Where a machine's CPU time goes, by kind of process (a Ray worker's title, vLLM's engine core, a compiler, pytest).

    .venv/bin/python scripts/process_cpu.py sample /tmp/cpu.json --until /tmp/done &   # e.g. beside `make test`
    .venv/bin/python scripts/process_cpu.py report /tmp/cpu.json
    .venv/bin/python scripts/process_cpu.py idle --window 60     # an idle Ray and Serve with the tests' two apps

`sample` reads /proc every `--every` seconds until the file `--until` exists: each process's CPU seconds (user and
system, all its threads) and every title it showed (a Ray worker renames itself for the actor it becomes); a process
already running at the first sample counts only what it used after it. A process that lives less than one interval is
missed. `report` sums them by kind. `idle` starts a loopback Ray with Serve as the suite does (bench.local_serve), the
package apps of tests/orchestration/conftest.py ("/" and "/off": 11 replicas and an idle vLLM engine), waits for
them to settle and prints each kind's share of one core over the window; Ray's and Serve's environment variables (e.g.
RAY_SERVE_CONTROL_LOOP_INTERVAL_S) reach every process it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
#: A process's kind: the first pattern its titles match (one title per line), in this order.
KINDS = (
    (r"ray::ServeReplica:[^:\s]+:(\w+)", "replica {}"),
    (r"EngineCore", "vLLM engine core"),
    (r"ray::(ServeController|ProxyActor|DashboardAgent|RuntimeEnvAgent|\w+Worker)", "ray::{}"),
    (r"\b(gcs_server|raylet|log_monitor)\b", "{}"),
    (r"ray::IDLE|default_worker\.py", "ray idle worker"),
    (r"^(cc1plus|c\+\+|g\+\+|\S*/cc1plus)\b", "C++ compiler"),
    (r"^\S*qemu", "qemu"),
    (r"\bpytest\b", "pytest (in-process tests)"),
    (r"python\S* -c ", "python -c (a test's subprocess)"),
)


def kind(titles: list[str]) -> str:
    for pattern, label in KINDS:
        for title in titles:
            found = re.search(pattern, title)
            if found:
                return label.format(*found.groups())
    return titles[0].split(" ")[0] if titles and titles[0] else "other"


def snapshot() -> dict[str, tuple[str, float]]:
    """{pid:start-tick: (title, CPU seconds)} of every process now."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it ended between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{pid}:{fields[19]}"] = (title[:200], (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def sample(out: Path, until: Path, every: float) -> None:
    processes: dict[str, dict] = {}
    first = True
    while True:
        for key, (title, cpu) in snapshot().items():
            seen = processes.setdefault(key, {"titles": [], "cpu0": cpu if first else 0.0})
            seen["cpu"] = cpu
            if title and title not in seen["titles"]:
                seen["titles"].append(title)
        first = False
        out.write_text(json.dumps(processes))
        if until.exists():
            return
        time.sleep(every)


def by_kind(processes: dict[str, dict]) -> dict[str, tuple[int, float]]:
    totals: dict[str, tuple[int, float]] = {}
    for seen in processes.values():
        label = kind(seen["titles"])
        count, cpu = totals.get(label, (0, 0.0))
        totals[label] = (count + 1, cpu + seen["cpu"] - seen["cpu0"])
    return dict(sorted(totals.items(), key=lambda item: -item[1][1]))


def report(path: Path) -> None:
    totals = by_kind(json.loads(path.read_text()))
    whole = sum(cpu for _, cpu in totals.values())
    print(f"{whole:.0f} s of CPU in {sum(count for count, _ in totals.values())} processes")
    for label, (count, cpu) in totals.items():
        if cpu >= 0.005 * whole:
            print(f"{cpu:8.0f} s {100 * cpu / whole:5.1f}%  {count:4d}  {label}")


def idle(window: float, settle: float) -> None:
    sys.path.insert(0, str(ROOT))
    import tests.conftest  # noqa: F401  (the suite's environment: GOMP, the kernel path, the loopback)
    from bench.local_serve import local_serve
    from orchestration import build_app
    from tests.orchestration.conftest import MAIN, OFF

    with local_serve(2, "process-cpu"):
        from ray import serve

        serve.run(build_app(OFF), name="off", route_prefix="/off")
        serve.run(build_app(MAIN), name="main", route_prefix="/")
        time.sleep(settle)
        before, started = snapshot(), time.monotonic()
        time.sleep(window)
        after, seconds = snapshot(), time.monotonic() - started
    used = {
        key: {"titles": [title], "cpu0": before.get(key, (title, 0.0))[1], "cpu": cpu}
        for key, (title, cpu) in after.items()
    }
    shares = {label: 100 * cpu / seconds for label, (_, cpu) in by_kind(used).items() if cpu / seconds >= 0.002}
    knobs = {name: value for name, value in os.environ.items() if name.startswith(("RAY_SERVE_", "RAY_LOG_"))}
    print(json.dumps({"window_s": round(seconds, 1), "settings": knobs, "percent_of_one_core": shares}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sampling = commands.add_parser("sample")
    sampling.add_argument("out", type=Path)
    sampling.add_argument("--until", type=Path, required=True)
    sampling.add_argument("--every", type=float, default=2.0)
    commands.add_parser("report").add_argument("path", type=Path)
    idling = commands.add_parser("idle")
    idling.add_argument("--window", type=float, default=60.0)
    idling.add_argument("--settle", type=float, default=15.0)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.out, args.until, args.every)
    elif args.command == "report":
        report(args.path)
    else:
        idle(args.window, args.settle)


if __name__ == "__main__":
    main()
