"""From an audit report to scope records (contracts/scope.py): one per audited configuration, written only when
its control varied and its kernels-on runs had 0 differing elements (`omniserve audit --record`).

Each audit puts one entry per model into `report["scope"]`: the kernels-on run's `Configuration` (described by
`stages.scope`, exactly as a replica describes itself) and what the audit held fixed (sizes, steps, targets).
The batch sizes and orderings covered, and the result, are read from the runs themselves.
"""

from __future__ import annotations

import time
from pathlib import Path

from contracts.cpu import cpu_flags
from contracts.scope import AuditResult, Configuration, Coverage, ScopeRecord


def scope_entry(model: str, configuration: Configuration, **coverage) -> dict:
    """What an audit reports of one model's kernels-on configuration, for `build_record`."""
    return {"model": model, "configuration": configuration.model_dump(mode="json"), "coverage": coverage}


def _threads(run: dict, default: int) -> int:
    return run.get("torch_threads", default)  # runs of one thread count only (diffusion) carry none


def _same_run(run: dict) -> tuple:
    """What identifies one run across thread counts."""
    return tuple(run.get(key) for key in ("target", "sampling", "ordering", "batch_size", "target_position", "size"))


def _control_elsewhere(runs: list[dict], threads: int, invariant: list[dict]) -> tuple[int | None, str]:
    """A thread count whose control varied and whose kernels-on runs gave, run for run, the bits of `invariant`
    (the configuration's own kernels-on runs); (None, why not) when there is none."""
    mine = {_same_run(r): (r.get("target_digest"), r.get("reference_digest")) for r in invariant}
    for other in sorted({_threads(r, threads) for r in runs} - {threads}):
        at = [r for r in runs if _threads(r, threads) == other]
        if not any(r["differing_elements"] > 0 for r in at if r["kernels"] == "off"):
            continue
        theirs = {_same_run(r): (r.get("target_digest"), r.get("reference_digest")) for r in at if r["kernels"] == "on"}
        if None in {digest for pair in mine.values() for digest in pair} or theirs != mine:
            return None, (
                f"the control varied at {other} threads, but the kernels-on runs there did not give the bits "
                f"of the {threads}-thread runs run for run, so that control says nothing of {threads} threads"
            )
        return other, ""
    return None, ""


def build_record(report: dict, entry: dict) -> tuple[ScopeRecord | None, str]:
    """(the record, "") when the runs verify the entry's configuration; else (None, why not).

    The control is the configuration's own kernels-off runs. Where it never varied, a control that varied at
    another thread count (`omniserve audit --control-threads`) stands in, but only when the kernels-on runs at
    both thread counts gave the same bits run for run: then this configuration computes exactly what was shown
    invariant against a control that could fail."""
    threads = entry["configuration"].get("torch_threads")
    # A parallel audit's entry is one grid's ("parallel": "cfg2"): its runs are that grid's, its control too.
    runs = [r for r in report["runs"] if r["model"] == entry["model"] and r.get("parallel") == entry.get("parallel")]
    control = [r for r in runs if r["kernels"] == "off" and _threads(r, threads) == threads]
    invariant = [r for r in runs if r["kernels"] == "on" and _threads(r, threads) == threads]
    if not control or not invariant:
        return None, "a record needs both the control (kernels off) and kernels on: run --kernels off,on"
    varied_here = any(r["differing_elements"] > 0 for r in control)
    control_threads, why = (None, "") if varied_here else _control_elsewhere(runs, threads, invariant)
    result = AuditResult(
        control_runs=len(control),
        control_varied=varied_here or control_threads is not None,
        invariant_runs=len(invariant),
        differing_with_kernels_on=sum(r["differing_elements"] for r in invariant),
        control_threads=control_threads,
    )
    if not result.control_varied:
        return None, why or (
            f"the control never varied ({len(control)} runs with kernels off all matched solo), so this audit proves "
            "nothing here; audit larger batch sizes, another thread count (--control-threads) or a model whose stock "
            "kernels vary"
        )
    if result.differing_with_kernels_on:
        return None, f"{result.differing_with_kernels_on} elements differed with the kernels on: not invariant here"
    coverage = Coverage(
        batch_sizes=sorted({r["batch_size"] for r in invariant}),
        orderings=sorted({r["ordering"] for r in invariant}),
        **entry["coverage"],
    )
    env = report.get("environment", {})
    audited = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": env.get("command"),
        "cpu": env.get("hardware", {}).get("cpu"),
        "cpu_flags": _vector_flags(),
    }
    return ScopeRecord(
        configuration=Configuration.model_validate(entry["configuration"]),
        coverage=coverage,
        result=result,
        audited=audited,
    ), ""


def _vector_flags() -> str:
    """The audit machine's vector flags, for readers (records are matched by kernel path, not by these)."""

    return " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "amx"))))


def record_report(report: dict, directory: Path, log=print) -> bool:
    """Write every record the report verifies into `directory`; True when each entry was recorded."""
    entries = report.get("scope") or []
    if not entries:
        log("NOT RECORDED: this audit ran no kernels-on configuration")
    recorded = bool(entries)
    for entry in entries:
        record, why = build_record(report, entry)
        name = " ".join(filter(None, (entry["model"], entry.get("parallel"))))
        if record is None:
            log(f"NOT RECORDED ({name}): {why}")
            recorded = False
        else:
            log(f"recorded {name}: {record.write_into(directory)}")
    return recorded
