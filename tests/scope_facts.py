"""What the shipped audit records can verify: a fact of the repository and of the machines it was audited on.

An audit refuses to record where its control never varies (stages/audit/record.py). On the avx2 path the default
LLM's control never varies at its one thread (0 of 104 kernels-off runs differed from solo, on an AVX2 and on an
AVX-512 machine); its record rests on the control at two threads, where it varies, the kernels-on bits being equal at
both (`omniserve audit --stage llm --model default --torch-threads 1 --control-threads 2 --record
docs/evidence/scope`). A change to the kernels' source makes that record stale: tests that need the default LLM
verified then say so and skip until it is made again.
"""

from __future__ import annotations


def llm_record_gap() -> str | None:
    """Why no shipped record can verify the default LLM stage (None: one covers its model with these kernels)."""
    from contracts.scope import SHIPPED_RECORDS, load_records
    from stages.embedded import DEFAULT_MODELS
    from stages.scope import kernels_digest

    kernels = kernels_digest()
    if any(r.valid and r.configuration.stage == "llm" and r.configuration.model == DEFAULT_MODELS["llm"]
           and r.configuration.kernels == kernels for r in load_records([SHIPPED_RECORDS])):
        return None
    return (f"no shipped audit record covers the default LLM with kernels {kernels} (see tests/scope_facts.py for the "
            "command that makes one); the LLM stage is unverified until one is made")
