"""What the shipped audit records can verify: a fact of the repository and of the machines it was audited on.

An audit refuses to record where its control never varies (stages/audit/record.py). On an AVX2 machine the default
LLM's control never varied (1 thread: 0 of 104 kernels-off runs differed from solo), so no LLM record was made for
the current kernels there; tests that need the default LLM verified say so and skip until a machine whose control
varies records one (`omniserve audit --stage llm --model default --torch-threads 1 --record docs/evidence/scope`).
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
    return (f"no shipped audit record covers the default LLM with kernels {kernels}: its audit refused to record "
            "where its control never varied (see tests/scope_facts.py); the LLM stage is unverified until one is made")
