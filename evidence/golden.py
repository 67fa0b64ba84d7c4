"""The golden table's recorder: `omniserve golden [--record]` and tests/test_golden.py.

A column holds, for one configuration on one kernel path, the sha256 of each canonical request's output
(docs/evidence/golden.json, `contracts.scope`). The canonical requests, and the digests a replica compares with its
column at start-up, are served code (stages/diffusion/self_check.py, stages/llm/self_check.py); this module only
renders them as a recorder does (invariance on, the stage's default model) and writes or compares the columns.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from typing import Any

from contracts.config import DiffusionStageConfig, LLMStageConfig
from contracts.cpu import cpu_flags
from contracts.scope import Configuration, GoldenColumn, load_golden
from evidence.report import cpu_model, environment
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import StepEngine
from stages.diffusion.self_check import diffusion_digests
from stages.llm.engine import LLMEngine
from stages.llm.self_check import llm_digests
from stages.scope import diffusion_configuration, llm_configuration


def diffusion_column(dtype: str) -> GoldenColumn:
    """The default diffusion model's column on this machine's path (invariance on, step engine, 1 thread)."""
    config = DiffusionStageConfig(batch_invariant=True, dtype=dtype, torch_threads=1)
    renderer = DiffusionRenderer(config)
    assert renderer.family is not None  # the default model's pipeline is one the step engine knows
    engine = StepEngine(renderer.family, max_batch_size=config.max_batch_size, torch_threads=config.torch_threads)
    try:
        digests = diffusion_digests(renderer, engine)
    finally:
        engine.stop()
    if digests["solo"] != digests["co-batched target"]:  # the cases themselves must be invariant to be golden
        raise RuntimeError(f"{dtype}: the co-batched target differs from its solo render; nothing golden here")
    flags = " ".join(sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_flags()))
    made = {"command": "omniserve golden --record", "date": datetime.date.today().isoformat(), "cpu_flags": flags}
    return GoldenColumn(
        configuration=diffusion_configuration(renderer, "step"), digests=digests, made={**made, "cpu": cpu_model()}
    )


async def llm_golden_column(engine, configuration: Configuration) -> GoldenColumn:
    """A started engine's column for the recorder (`contracts.scope.write_golden`): the digests, when and on what CPU."""
    digests = await llm_digests(engine)
    made = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": environment([])["hardware"]["cpu"]}
    return GoldenColumn(configuration=configuration, digests=digests, made=made)


def llm_column(model: str | None = None) -> GoldenColumn:
    """An LLM's column on this machine's path (invariance on, the stage's default config; None: the default model)."""

    async def run():
        engine = await LLMEngine(LLMStageConfig(batch_invariant=True, model=model)).start()
        try:
            column = await llm_golden_column(engine, llm_configuration(engine))
        finally:
            engine.shutdown()
        for sampling in ("greedy", "seeded"):
            if column.digests[f"{sampling} solo"] != column.digests[f"{sampling} co-batched target"]:
                raise RuntimeError(
                    f"llm {sampling}: the co-batched target differs from its solo run; nothing golden here"
                )
        return column

    return asyncio.run(run())


def compare_or_record(
    dtypes: list[str], *, record: bool, table, log, stages=("diffusion", "llm"), llm_model: str | None = None
) -> int:
    """Each column of this path against the table (0: all reproduced), or written into it."""
    columns, failed = load_golden(table), 0
    made: list[tuple[str, Callable[..., Any]]] = [
        (f"diffusion {dtype}", lambda dtype=dtype: diffusion_column(dtype)) for dtype in dtypes if "diffusion" in stages
    ]
    made += [("llm", lambda: llm_column(llm_model))] if "llm" in stages else []
    for name, make in made:
        column = make()
        if record:
            column.write_into(table)
            log(f"{name} on {','.join(column.configuration.hardware)}: {len(column.digests)} cases recorded")
            continue
        check = column.configuration.compare_golden(column.digests, columns)
        log(f"{name}: {check.reason}")
        failed += not check.verified
    return 1 if failed else 0
