"""Invariance off vs on, measured side by side: what the LLM and the app benchmarks share.

Both keep an "off" and an "on" target alive (two engines, two apps) and drive them alternately, each point
a closed loop: `requests` calls, at most `concurrency` in flight. Per repeat the order flips (off on, on off,
...), so neither setting always runs first; ratios are paired by repeat (the two runs next to each other in
time) and reported as median (min-max).

    closed_loop     one point: per-request latency, units (tokens, images) per second
    summarize       per setting and point: min/median/max over repeats; on/off ratios paired by repeat
    markdown_rows   the tables both reports print; environment_lines: hardware, versions, command
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from bench.load import mode_orders, percentile, spread

SETTINGS = ("off", "on")


def setting_orders(repeats: int) -> list[list[str]]:
    """off on, on off, off on, ...: one order per repeat."""
    return mode_orders(SETTINGS, repeats)


async def closed_loop(call: Callable[[int], Awaitable[int]], *, requests: int, concurrency: int) -> dict:
    """Run call(0..requests-1), at most `concurrency` at once; each returns how many units it produced.

    A request's latency runs from when it is sent (it got a slot) to its answer: queueing inside the server
    counts, waiting for a client slot does not.
    """
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> tuple[float, int]:
        async with gate:
            sent = time.perf_counter()
            units = await call(index)
            return time.perf_counter() - sent, units

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - started
    latencies = [latency for latency, _ in results]
    units = sum(count for _, count in results)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "wall_s": round(wall, 4),
        "units": units,
        "units_per_s": round(units / wall, 3),
        "p50_s": round(percentile(latencies, 50), 4),
        "p95_s": round(percentile(latencies, 95), 4),
    }


def summarize(runs: Sequence[dict], *, point: str, rate: str) -> tuple[dict, dict]:
    """(summary, ratios) for runs of {repeat, setting, <point>, <rate>, p50_s, p95_s}.

    summary[setting][point] = {rate, p50_s, p95_s: min/median/max over repeats};
    ratios[point] = {<rate>_on_over_off, p50_s_off_over_on: paired by repeat} (above 1: on is no slower).
    """
    points = list(dict.fromkeys(r[point] for r in runs))  # in the order they ran
    summary: dict = {}
    for setting in SETTINGS:
        for p in points:
            mine = [r for r in runs if r["setting"] == setting and r[point] == p]
            if mine:
                summary.setdefault(setting, {})[str(p)] = {
                    m: spread([r[m] for r in mine]) for m in (rate, "p50_s", "p95_s")
                }
    ratios = {}
    for p in points:
        pairs = _pairs(runs, point, p)
        if pairs:
            ratios[str(p)] = {
                f"{rate}_on_over_off": spread([on[rate] / off[rate] for off, on in pairs]),
                "p50_s_off_over_on": spread([off["p50_s"] / on["p50_s"] for off, on in pairs]),
            }
    return summary, ratios


def _pairs(runs: Sequence[dict], point: str, value) -> list[tuple[dict, dict]]:
    """(off, on) runs of one point, matched by repeat."""
    by = {(r["repeat"], r["setting"]): r for r in runs if r[point] == value}
    return [(by[(k, "off")], by[(k, "on")]) for k in sorted({k for k, _ in by}) if (k, "off") in by and (k, "on") in by]


def _cell(value: dict, digits: int = 3) -> str:
    return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"


def markdown_rows(summary: dict, ratios: dict, *, point: str, rate: str, rate_label: str) -> list[str]:
    """A table per setting and point (median (min-max) over repeats), then the paired ratios."""
    lines = [f"| {point} | setting | {rate_label} | p50 latency s | p95 latency s |", "|---|---|---|---|---|"]
    for p in ratios or next(iter(summary.values()), {}):
        for setting in SETTINGS:
            s = summary.get(setting, {}).get(p)
            if s:
                lines.append(f"| {p} | {setting} | {_cell(s[rate], 2)} | {_cell(s['p50_s'])} | {_cell(s['p95_s'])} |")
    lines += [
        "",
        "Cells: median (min-max) over repeats.",
        "",
        f"| {point} | {rate_label} on/off | p50 latency off/on |",
        "|---|---|---|",
    ]
    for p, r in ratios.items():
        lines.append(f"| {p} | {_cell(r[f'{rate}_on_over_off'])} | {_cell(r['p50_s_off_over_on'])} |")
    lines.append(
        "\nRatios: median (min-max) over repeats, each repeat's off and on runs paired; above 1 means on is no slower."
    )
    return lines


def environment_lines(env: dict) -> list[str]:
    """Hardware, versions and the exact command, from `evidence.report.environment`."""
    hardware = env["hardware"]
    return [
        f"Hardware: {hardware['cpu']}, {hardware['usable_cpus']} usable CPUs, {hardware['memory_gib']} GiB. "
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + ".",
        f"Command: `{env['command']}`",
    ]
