"""What the shipped audit records can verify: a fact of the repository and of the kernel paths it was audited on.

Records name the kernel path and ATen's level they were made on (stages/scope.py `hardware`); the shipped ones cover
the default models on the avx2, avx512 and generic paths (`audited` in each says which machine made it: avx512 needs
AVX-512 BF16, and its records were made on an AMD EPYC that has it). An
audit refuses to record where its control never varies (evidence/record.py). On the avx2 path the default LLM's
control never varies at its one thread (0 of 104 runs, on an AVX2 and an AVX-512 machine); that record rests on the
control at two threads, where it varies, the kernels-on bits being equal at both (on generic and avx512 it varies at
one thread). The commands, per path (`OMNISERVE_CPU_ISA=<path>` in front for another path):

    omniserve audit --stage diffusion --model default --torch-threads 1 --record docs/evidence/scope
    omniserve audit --stage llm --model default --torch-threads 1 --control-threads 2 --record docs/evidence/scope

A change to the kernels' source makes the records stale, and a path nobody audited has none: tests that need a
default stage verified then say so and skip until one is made. A record covers a machine whose kernel path matches
only if the machine computes the audited bits: a replica checks that by its golden self-check, and so does
`record_gap` (diffusion). On a CPU model other than the auditing machine's the same path can compute other bits
(measured: an Intel Xeon with AMX against the AMD EPYC records, float32 diffusion), and the stage is then rightly
unverified: a machine fact, so those tests skip and say what was measured.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable


def record_gap(stage: str) -> str | None:
    """Why no shipped record can verify `stage`'s default model on this process's kernel path (None: one covers it)."""
    from contracts.scope import SHIPPED_RECORDS, load_records
    from stages.embedded import DEFAULT_MODELS
    from stages.scope import hardware, kernels_digest

    kernels, mine = kernels_digest(), hardware("cpu")
    if any(r.valid and r.configuration.stage == stage and r.configuration.model == DEFAULT_MODELS[stage]
           and r.configuration.kernels == kernels and r.configuration.hardware == mine
           for r in load_records([SHIPPED_RECORDS])):
        return golden_gap() if stage == "diffusion" else None
    return (f"no shipped audit record covers the default {stage} stage with kernels {kernels} on {', '.join(mine)} "
            "(tests/scope_facts.py has the command that makes one); the stage is unverified until one is made")


def by_users_records(verified_by: Iterable[str]) -> bool:
    """Whether each of a replica's `verified_by` names a record of the user's cache that is not shipped.

    Where no shipped record covers a stage (`record_gap`), a replica still reads the user's records (contracts/scope.py
    `load_records`): its own start-up self-audit's where the control varied, an earlier one's, an `omniserve audit`'s.
    Which of those exist depends on what ran on this machine before (other test workers write them while the suite
    runs), so a test that found a gap accepts either verdict, verified only by such a record."""
    from contracts.scope import SHIPPED_RECORDS, user_records

    names = [re.search(r"record (\S+\.json)", by) for by in verified_by]
    return bool(names) and all(
        name is not None and (user_records() / name[1]).is_file() and not (SHIPPED_RECORDS / name[1]).is_file()
        for name in names)



@functools.cache
def golden_gap() -> str | None:
    """Why this machine does not compute the default diffusion model's audited bits (None: it reproduces its path's
    golden column, as a replica's self-check must). Rendered once per process (a few seconds)."""
    from contracts.scope import load_golden
    from evidence.golden import diffusion_column
    from stages.kernels import current_report, disable_batch_invariant_kernels

    installed = current_report().installed
    try:
        column = diffusion_column("float32")
    finally:
        if not installed:  # the kernels are process-wide: leave the process as it was
            disable_batch_invariant_kernels()
    check = column.configuration.compare_golden(column.digests, load_golden())
    if check.verified:
        return None
    return (f"measured: this CPU ({column.made.get('cpu')}) does not compute the audited bits of the default diffusion "
            f"model on its path: {check.reason}; its replicas are rightly unverified (issue 21)")
