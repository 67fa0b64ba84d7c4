"""From an audit report to scope records (contracts/scope.py): one per audited configuration, written only when
its control varied and its kernels-on runs had 0 differing elements (`omniserve audit --record`).

Each audit puts one entry per model into `report["scope"]`: the kernels-on run's `Configuration` (described by
`stages.scope`, exactly as a replica describes itself) and what the audit held fixed (sizes, steps, targets).
The batch sizes and orderings covered, and the result, are read from the runs themselves.
"""

from __future__ import annotations

import time
from pathlib import Path

from contracts.scope import AuditResult, Configuration, Coverage, ScopeRecord, write_record


def scope_entry(model: str, configuration: Configuration, **coverage) -> dict:
    """What an audit reports of one model's kernels-on configuration, for `build_record`."""
    return {"model": model, "configuration": configuration.model_dump(mode="json"), "coverage": coverage}


def build_record(report: dict, entry: dict) -> tuple[ScopeRecord | None, str]:
    """(the record, "") when the runs verify the entry's configuration; else (None, why not)."""
    runs = [r for r in report["runs"] if r["model"] == entry["model"]]
    control = [r for r in runs if r["kernels"] == "off"]
    invariant = [r for r in runs if r["kernels"] == "on"]
    if not control or not invariant:
        return None, "a record needs both the control (kernels off) and kernels on: run --kernels off,on"
    result = AuditResult(
        control_runs=len(control), control_varied=any(r["differing_elements"] > 0 for r in control),
        invariant_runs=len(invariant), differing_with_kernels_on=sum(r["differing_elements"] for r in invariant),
    )
    if not result.control_varied:
        return None, (f"the control never varied ({len(control)} runs with kernels off all matched solo), so this "
                      "audit proves nothing here; audit larger batch sizes or a model whose stock kernels vary")
    if result.differing_with_kernels_on:
        return None, f"{result.differing_with_kernels_on} elements differed with the kernels on: not invariant here"
    coverage = Coverage(batch_sizes=sorted({r["batch_size"] for r in invariant}),
                        orderings=sorted({r["ordering"] for r in invariant}), **entry["coverage"])
    env = report.get("environment", {})
    audited = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": env.get("command"),
               "cpu": env.get("hardware", {}).get("cpu")}
    return ScopeRecord(configuration=Configuration.model_validate(entry["configuration"]), coverage=coverage,
                       result=result, audited=audited), ""


def record_report(report: dict, directory: Path, log=print) -> bool:
    """Write every record the report verifies into `directory`; True when each entry was recorded."""
    entries = report.get("scope") or []
    if not entries:
        log("NOT RECORDED: this audit ran no kernels-on configuration")
    recorded = bool(entries)
    for entry in entries:
        record, why = build_record(report, entry)
        if record is None:
            log(f"NOT RECORDED ({entry['model']}): {why}")
            recorded = False
        else:
            log(f"recorded {entry['model']}: {write_record(record, directory)}")
    return recorded
