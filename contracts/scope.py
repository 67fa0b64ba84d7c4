"""The verified scope as data: what an audit measured, and whether a replica's configuration is inside it.

An audit (`omniserve audit --record`) that saw its control vary and 0 differing elements with the kernels on
writes one `ScopeRecord`: the `Configuration` it ran (everything that can change a kernel's arithmetic: model
and weights, dtype, device and its kernel path or compute capability, library versions, the kernels' source,
thread count, the engine settings that matter) plus what it covered (batch sizes, image sizes, orderings).
Records live in the repository (`SHIPPED_RECORDS`, for the configurations we ship) and in the user's cache
(`user_records()`, for audits run on the user's own machine).

A replica `match`es its own configuration at start-up: `verified` when a valid record has an equal
configuration and covers its batch bound and (diffusion) its default size; else the nearest record's
differences, e.g. "dtype bfloat16 not audited (audited float32)". A diffusion request for a size no record
covers is outside the scope too: that image's provenance says `verified: false` with the reason.
`strict` (config, or OMNISERVE_STRICT_SCOPE) turns "unverified" into a refusal to start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, computed_field

from . import envs

logger = logging.getLogger(__name__)

#: The records of the configurations this repository ships (committed).
SHIPPED_RECORDS = Path(__file__).resolve().parent.parent / "docs" / "evidence" / "scope"
STRICT_VARIABLE = "OMNISERVE_STRICT_SCOPE"


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Configuration(_Data):
    """What a replica (or an audit's kernels-on run) is, as far as its arithmetic goes; equal or not."""

    stage: Literal["llm", "diffusion"]
    model: str
    weights: str  # sha256 of the weight files' bytes ("unhashed:<id>" when they are not local files)
    dtype: str
    device: str  # "cpu", "cuda"
    hardware: list[str]  # CPU: the kernel path and ATen's level (["path:avx2", "aten:AVX2"]); CUDA: compute capability
    versions: dict[str, str | None]  # torch, and diffusers or vllm
    kernels: str  # digest of the batch-invariant kernels' source
    torch_threads: int
    engine: dict[str, Any]  # LLM: engine arguments that change the arithmetic; diffusion: the batching mode

    def compare_golden(self, digests: Mapping[str, str], columns: Sequence[GoldenColumn]) -> SelfCheck:
        """`digests` (what this machine computed) against this configuration's golden column."""
        path = ",".join(self.hardware)
        column = next((c for c in columns if c.configuration == self), None)
        if column is None:
            return SelfCheck(path=path)
        differing = sorted(case for case, digest in column.digests.items() if digests.get(case) != digest)
        return SelfCheck(path=path, total=len(column.digests), differing=differing)

    def match(
        self,
        records: Sequence[ScopeRecord],
        *,
        batch_size: int,
        size: str | None = None,
        self_check: SelfCheck | None = None,
        self_audit: SelfAudit | None = None,
    ) -> Verdict:
        """Verified when a record covers this configuration at batch sizes 1..`batch_size` (and `size`) and this replica's
        self-check, where it ran, reproduced its golden column; else the nearest record's differences (the fewest).

        On CPU a configuration names the kernel path, not the CPU's flags (stages/scope.py), so a record made on another
        machine of the same path covers this one: the record proves the configuration invariant, the self-check that
        this machine computes that path's bits. A self-check that differs leaves the replica unverified whatever covers it,
        and so does a self-audit whose kernels-on runs differed (this replica, here, gave batch-dependent bits). Among
        covering records a self-audit's (this configuration, proven where it runs) is preferred."""
        candidates = [
            (r.uncovered(self, batch_size=batch_size, size=size), r)
            for r in records
            if r.configuration.stage == self.stage
        ]
        if self_audit is not None and self_audit.differing:  # measured here: nothing written elsewhere outweighs it
            found = min((f for f, _ in candidates), key=len, default=[])
            return Verdict(verified=False, differences=[*found, self_audit.reason])
        if not candidates:
            return Verdict(verified=False, differences=[f"no audit record for the {self.stage} stage"])
        # The fewest differences; on a tie, a record of the same weights (its reasons are the ones to read), then a
        # self-audit's.
        found, nearest = min(
            candidates,
            key=lambda pair: (
                len(pair[0]),
                pair[1].configuration.weights != self.weights,
                not pair[1].by_self_audit,
            ),
        )
        if self_check is not None and self_check.total and self_check.differing:  # this machine computes other bits
            return Verdict(verified=False, differences=[*found, self_check.reason])
        if found:
            return Verdict(verified=False, differences=found)
        if nearest.by_self_audit:
            by = f"self-audit record {nearest.name} ({nearest.audited.get('summary', '')})"
            return Verdict(verified=True, record=nearest.name, by=by)
        by = f"audit record {nearest.name}"
        return Verdict(
            verified=True,
            record=nearest.name,
            by=f"{self_check.reason}; {by}" if self_check and self_check.verified else by,
        )


class Coverage(_Data):
    """What the audit varied around its target."""

    batch_sizes: list[int]
    sizes: list[str] = []  # diffusion: "WxH"
    orderings: list[str]
    steps: int | None = None  # diffusion; steps and guidance change values, never a kernel's shapes
    detail: dict[str, Any] = {}  # LLM: targets, samplings, tokens generated


class AuditResult(_Data):
    control_runs: int
    control_varied: bool  # kernels off, some co-batched run differed from solo: the audit can fail
    invariant_runs: int
    differing_with_kernels_on: int  # elements, over all kernels-on runs
    # Set where the control varied only at another thread count than the configuration's (whose own control never
    # varied): the kernels-on runs at both counts gave the same bits, run for run, so the configuration computes
    # exactly what was proven invariant against a varying control.
    control_threads: int | None = None


class ScopeRecord(_Data):
    configuration: Configuration
    coverage: Coverage
    result: AuditResult
    audited: dict[str, Any] = {}  # when, the command, the CPU's name: for readers, never matched

    @property
    def valid(self) -> bool:
        """Only a record whose control varied and whose kernels-on runs all matched verifies anything."""
        return self.result.control_varied and self.result.differing_with_kernels_on == 0

    @property
    def by_self_audit(self) -> bool:
        """Written by a replica's start-up self-audit (`SelfAudit`), not by `omniserve audit`."""
        return self.audited.get("by") == "self-audit"

    @property
    def name(self) -> str:
        """The file name: stage, model, dtype, threads, sizes, and a digest of configuration and coverage."""
        c = self.configuration
        blob = json.dumps([c.model_dump(mode="json"), self.coverage.sizes], sort_keys=True).encode()
        slug = c.model.replace("/", "-").replace(":", "-")
        sizes = "-" + "-".join(self.coverage.sizes) if self.coverage.sizes else ""
        grid = c.engine.get("parallel")  # a parallel render's degrees (evidence.parallel)
        sizes += f"-cfg{grid['cfg']}-sp{grid['sp']}" if grid else ""
        sizes += "-self-audit" if self.by_self_audit else ""
        return f"{c.stage}-{slug}-{c.dtype}-{c.device}-t{c.torch_threads}{sizes}-{hashlib.sha256(blob).hexdigest()[:10]}.json"

    def uncovered(self, mine: Configuration, *, batch_size: int, size: str | None) -> list[str]:
        """What in `mine` (and the batch bound, the size) this record does not cover; empty: it covers them."""
        theirs, found = self.configuration, []
        if mine.stage != theirs.stage:
            return [f"stage {mine.stage} not audited"]
        for field, label in _LABELS.items():
            a, b = getattr(mine, field), getattr(theirs, field)
            if a != b:
                found.append(f"{label} {_short(a)} not audited (audited {_short(b)})")
        for group, label in (("versions", ""), ("engine", "engine setting ")):
            a, b = getattr(mine, group), getattr(theirs, group)
            for key in sorted(a.keys() | b.keys()):
                if a.get(key) != b.get(key):
                    found.append(f"{label}{key} {a.get(key)} not audited (audited {b.get(key)})")
        covered = set(self.coverage.batch_sizes)
        if not set(range(1, batch_size + 1)) <= covered:
            found.append(f"batch sizes up to {batch_size} not audited (audited {_short(sorted(covered))})")
        if size is not None and size not in self.coverage.sizes:
            found.append(f"size {size} not audited (audited {_short(self.coverage.sizes)})")
        if not self.valid:
            found.append(INVALID_RECORD)
        return found

    def write_into(self, directory: Path) -> Path:
        """This record as a file of `directory` (refused when it verifies nothing)."""
        if not self.valid:
            raise ValueError("a record whose control did not vary, or whose kernels-on runs differed, verifies nothing")
        directory.mkdir(parents=True, exist_ok=True)
        return write_atomically(directory / self.name, self)


class Verdict(_Data):
    verified: bool
    differences: list[str] = []  # why not: the nearest record's differences (empty when verified)
    record: str | None = None  # the covering record's name
    by: str = ""  # how it was verified: the record, and the self-check where the record's machine was another


#: The golden table (docs/evidence/golden.json): per stage and kernel path, the sha256 of canonical requests.
GOLDEN_TABLE = SHIPPED_RECORDS.parent / "golden.json"


def cpu_golden_table(cpu: str) -> Path:
    """Where the columns a CPU model computes live when they differ from the shipped table's (same path, other bits:
    docs/evidence/golden-by-cpu/<model>.json). Evidence and a regression check for machines of that model
    (tests/test_golden.py); never what a replica's self-check compares with, since no audit was made on them."""
    slug = "-".join(part for part in "".join(ch if ch.isalnum() else " " for ch in cpu.lower()).split())
    return SHIPPED_RECORDS.parent / "golden-by-cpu" / f"{slug or 'unknown'}.json"


class GoldenColumn(_Data):
    """What canonical requests give on one configuration (on CPU, one kernel path: any machine held to it must
    give these bits)."""

    configuration: Configuration
    digests: dict[str, str]  # case name -> sha256 of its output
    made: dict[str, Any] = {}  # when, the command, the CPU's name: for readers, never matched

    def write_into(self, path: Path = GOLDEN_TABLE) -> None:
        """Add this column to the table at `path`, replacing the one of the same configuration."""
        kept = [c for c in load_golden(path) if c.configuration != self.configuration]
        columns = sorted(
            [*kept, self], key=lambda c: json.dumps(c.configuration.model_dump(mode="json"), sort_keys=True)
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"columns": [c.model_dump(mode="json") for c in columns]}, indent=1, sort_keys=True) + "\n"
        )


class SelfCheck(_Data):
    """A replica's start-up check against its golden column: which canonical requests it reproduced."""

    path: str  # the column's hardware, e.g. "path:avx2,aten:AVX2"
    total: int = 0  # cases in its column (0: no column for this configuration)
    differing: list[str] = []  # cases whose sha256 differed

    @property
    def verified(self) -> bool:
        return self.total > 0 and not self.differing

    @property
    def reason(self) -> str:
        if not self.total:
            return f"no golden column for this configuration on {self.path} (omniserve golden --record makes one)"
        done = f"self-check reproduced {self.total - len(self.differing)} of {self.total} golden outputs on {self.path}"
        return done if not self.differing else f"{done}; differing: {', '.join(self.differing)}"


class SelfAudit(_Data):
    """A replica's start-up audit of its own configuration (`stages.diffusion.self_audit`, `stages.llm.self_audit`):
    its canonical requests solo and co-batched with unlike neighbours, with its kernels and with stock kernels (the
    control)."""

    mode: Literal["quick", "full"]
    runs: int = 0  # co-batched runs compared with solo, kernels on (the control stops at the first that differs)
    seconds: float = 0.0
    control_varied: bool = False
    differing: list[str] = []  # the kernels-on cases whose target differed from solo, with their element counts
    record: str | None = None  # the record it wrote, or reused
    reused: bool = False  # an earlier start's record covered this configuration: nothing rendered

    @computed_field  # type: ignore[prop-decorator]  # in every dump: /health, the bench and the GPU check read it
    @property
    def reason(self) -> str:
        if self.reused and not self.control_varied:
            return (
                f"self-audit reused an earlier start's finding ({self.record}): no stock control varied on this "
                "device, so its 0 differing proves nothing here"
            )
        if self.reused:
            return f"self-audit reused its record {self.record}"
        if self.differing:
            return f"self-audit: with the kernels on, co-batched differed from solo: {'; '.join(self.differing)}"
        if not self.control_varied:
            return (
                f"self-audit: no stock control varied in {self.runs} co-batched runs on this device, so its "
                "0 differing proves nothing here"
            )
        return f"self-audit: control varied, 0 of {self.runs} co-batched runs differed with the kernels on"


def load_golden(path: Path = GOLDEN_TABLE) -> list[GoldenColumn]:
    """Every column of the golden table (none when it is missing)."""
    if not path.is_file():
        return []
    return [GoldenColumn.model_validate(column) for column in json.loads(path.read_text())["columns"]]


class OutsideVerifiedScopeError(RuntimeError):
    """Strict mode: a replica with invariance on refuses to start outside the verified scope."""

    def __init__(self, stage: str, differences: Sequence[str]):
        self.stage, self.differences = stage, list(differences)
        super().__init__(
            f"the {stage} stage is strict and its configuration is outside the verified scope: "
            + "; ".join(self.differences)
        )

    def __reduce__(self):
        return (type(self), (self.stage, self.differences))


def resolve_strict(override: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """A stage's config `strict` wins; else OMNISERVE_STRICT_SCOPE; else off."""
    if override is not None:
        return override
    return bool(envs.read(STRICT_VARIABLE, environ))


def user_records() -> Path:
    """Where `omniserve audit --record` writes by default: the user's cache."""
    return envs.cache_root() / "scope"


def load_records(directories: Iterable[Path] | None = None) -> list[ScopeRecord]:
    """Every readable record in `directories` (default: shipped, then the user's); unreadable ones are logged."""
    records = []
    for directory in directories if directories is not None else (SHIPPED_RECORDS, user_records()):
        for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else ():
            try:
                records.append(ScopeRecord.model_validate_json(path.read_text()))
            except (OSError, ValidationError, ValueError) as err:
                logger.warning("ignoring scope record %s: %s", path, err)
    return records


def write_atomically(path: Path, record: ScopeRecord) -> Path:
    """The record's JSON at `path`, whole or not at all: replicas auditing side by side never read half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record.model_dump(mode="json"), indent=1, sort_keys=True) + "\n")
    partial.replace(path)
    return path


INVALID_RECORD = "the record's control did not vary or its kernels-on runs differed"
#: What a record must equal. Not the model's name or path: the same weights served from another directory, or under
#: another name, compute the same bits (`weights` is their content's digest); the name is kept for readers.
_LABELS = {
    "weights": "weights",
    "dtype": "dtype",
    "device": "device",
    "hardware": "hardware",
    "kernels": "kernels source",
    "torch_threads": "thread count",
}


def _short(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    text = str(value)
    return text[:12] if len(text) == 64 else text  # a sha256: its prefix says enough
