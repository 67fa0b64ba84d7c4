"""What every stage's start-up self-audit shares (issue 44): finding an earlier start's finding, and keeping this one.

Each stage proves its own configuration where it runs (`stages.diffusion.self_audit`, `stages.llm.self_audit`):
its canonical requests solo and co-batched, with its kernels and with stock kernels as the control. A proof is a
`ScopeRecord` (`audited.by: "self-audit"`) in the user's record cache, keyed by what decides the bits; a finding that
proves nothing (no control varied) is kept apart so the next start need not render it again; a finding of differences
is never kept, so that replica audits again at its next start.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import contracts.scope
from contracts.scope import (
    INVALID_RECORD,
    AuditResult,
    Configuration,
    Coverage,
    ScopeRecord,
    SelfAudit,
    load_records,
    write_atomically,
)


def inconclusive() -> Path:
    """Where a self-audit whose control never varied keeps its finding: not a record (it proves nothing, and
    `load_records` never reads this folder), but the next start of the same configuration need not render it again."""
    return contracts.scope.user_records() / "inconclusive"  # looked up per call: tests point it elsewhere


def reusable(
    configuration: Configuration, orderings: Collection[str], batch_size: int, size: str | None = None
) -> ScopeRecord | None:
    """An earlier start's self-audit record (or inconclusive finding) that covers this configuration with at least
    these orderings. A finding of differences is never kept: a replica that differed audits again at its next start."""
    for record in load_records([contracts.scope.user_records(), inconclusive()]):
        gaps = record.uncovered(configuration, batch_size=batch_size, size=size)
        if record.by_self_audit and set(orderings) <= set(record.coverage.orderings):
            if not [gap for gap in gaps if gap != INVALID_RECORD or record.result.differing_with_kernels_on]:
                return record
    return None


@dataclass(frozen=True)
class Finding:
    """What one start's self-audit rendered: `runs` with the kernels (the `differing` cases, `elements` in all) and
    `control_runs` with stock kernels, of which `control_varied` differed co-batched from solo."""

    runs: int
    differing: list[str]
    elements: int
    control_runs: int
    control_varied: int

    def kept(
        self, configuration: Configuration, coverage: Coverage, *, mode: str, replica: str, started: float
    ) -> SelfAudit:
        """The finding as the replica reports it, its record written as `keep` decides (its name in `record`)."""
        audit = SelfAudit(
            mode=mode,
            runs=self.runs,
            seconds=round(time.monotonic() - started, 2),
            control_varied=self.control_varied > 0,
            differing=self.differing,
        )
        summary = (
            f"{mode}: control varied in {self.control_varied} of {self.control_runs} co-batched runs, "
            f"kernels on 0 in {self.runs}"
        )
        record = ScopeRecord(
            configuration=configuration,
            coverage=coverage,
            result=AuditResult(
                control_runs=self.control_runs,
                control_varied=audit.control_varied,
                invariant_runs=self.runs,
                differing_with_kernels_on=self.elements,
            ),
            audited={
                "by": "self-audit",
                "replica": replica,
                "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "seconds": audit.seconds,
                "summary": summary,
            },
        )
        return audit.model_copy(update={"record": keep(record)})


def keep(record: ScopeRecord) -> str | None:
    """A proof into the user's record cache (its name returned); a finding that proves nothing into the inconclusive
    folder; a finding of differences nowhere."""
    if record.valid:
        record.write_into(contracts.scope.user_records())
        return record.name
    if not record.result.differing_with_kernels_on:
        write_atomically(inconclusive() / record.name, record)
    return None
