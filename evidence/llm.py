"""The LLM stage's batch-invariance audit: measured, not asserted.

For each kernel setting (off: the control, on: the LLM switch) one `LLMEngine` is started from an
`LLMStageConfig`. The
targets are the stage's own enhancement requests (chat template, system prompt, structured
output on the embedded model) for a short and a long prompt. Each runs solo, then co-batched
with 1..7 neighbours in several orderings, greedy and seeded. Neighbours differ in prompt length (random-token
prompts and other enhancement requests that share the system prompt: the stage's canonical NEIGHBOURS,
stages/llm/self_check.py), in sampling and in
output length, so the batch changes shape while the target decodes. Every co-batched run is
queued while the scheduler is paused (`stages.llm.co_batched`), so all its requests
enter the same step; `co_scheduled` records how many did.

`differing_elements` counts, against the target's solo run, differing token ids plus differing
logprob values (the top-k entries of every position, the sampled token's included).

    omniserve audit --stage llm --json audit-llm.json [--model embedded:wide-llama] [--tensor-parallel 2]

`tensor_parallel` > 1 runs every engine with that many vLLM workers (`tensor_parallel_size`, one process each); the
scope records then carry the degree (stages.scope.LLM_ENGINE_SETTINGS).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

from contracts.config import LLMStageConfig
from contracts.results import Generation
from evidence.record import scope_entry
from evidence.report import environment, summarize
from stages.llm import LLMEngine
from stages.llm.co_batched import generate_co_batched
from stages.llm.self_audit import SEED as TARGET_SEED
from stages.llm.self_audit import TARGETS, count_differences
from stages.llm.self_check import NEIGHBOURS, CanonicalRequests, generation_digest
from stages.scope import llm_configuration

# The targets (a short enhancement request, and a long one whose KV cache spans several blocks and, with split-KV
# on, gets split across threads) and their seed are the LLM self-audit's (stages/llm/self_audit.py).
# The neighbours are the stage's canonical ones (stages.llm.self_check.NEIGHBOURS): the first n-1 join a batch of n.
ORDERINGS = ("target-first", "target-last", "target-middle", "shuffled")
SAMPLINGS = ("greedy", "seeded")
#: Experiments beside the supported configuration: the kernels on, one engine setting changed.
ABLATIONS: dict[str, dict[str, Any]] = {
    # A token budget small enough that a co-batched target's prefill gets chunked. Greedy only:
    # vLLM 0.32's CPU runner crashes on a seeded request whose prefill is chunked.
    "chunked-prefill": {
        "args": {"enable_chunked_prefill": True, "max_num_batched_tokens": 256},
        "env": {},
        "greedy_only": True,
    },
    # Prefix caching is on anyway; blocks of 32 tokens make the shared system prompt hit it.
    "prefix-caching": {"args": {"enable_prefix_caching": True, "block_size": 32}, "env": {}},
    "split-kv": {"args": {}, "env": {"VLLM_CPU_ATTN_SPLIT_KV": "1"}},
    # vLLM's compiled mode (Dynamo + Inductor) instead of eager.
    "compile": {"args": {"enforce_eager": False}, "env": {}},
}


def batch_orders(batch_size: int, orderings: Iterable[str]) -> list[tuple[str, list[int]]]:
    """Request orders for one batch size: -1 is the target, i >= 0 is NEIGHBOURS[i]; duplicates dropped."""
    neighbours = list(range(batch_size - 1))
    seen, orders = set(), []
    for ordering in orderings:
        if ordering == "target-first":
            order = [-1, *neighbours]
        elif ordering == "target-last":
            order = [*neighbours, -1]
        elif ordering == "target-middle":
            half = len(neighbours) // 2
            order = [*neighbours[:half], -1, *neighbours[half:]]
        elif ordering == "shuffled":
            order = [-1, *neighbours]
            random.Random(batch_size).shuffle(order)
        else:
            raise ValueError(f"unknown ordering {ordering!r}; expected one of {ORDERINGS}")
        if tuple(order) not in seen:
            seen.add(tuple(order))
            orders.append((ordering, order))
    return orders


# --- the audit ------------------------------------------------------------------------------------


def _target(requests: CanonicalRequests, target: str, sampling: str):
    return requests.enhancement(TARGETS[target], sampling, TARGET_SEED)


def _plan(batch_sizes: Sequence[int], orderings: Sequence[str]) -> list[tuple[str, list[int]]]:
    plan = [("solo-repeat", [-1])] if 1 in batch_sizes else []
    for size in batch_sizes:
        if size > 1:
            plan += batch_orders(size, orderings)
    return plan


def _record(base: dict, order: list[int], batch: list, results: list[Generation], reference: Generation) -> dict:
    """One run's row: how the target's co-batched result differs from its solo reference."""
    mine = results[order.index(-1)]
    tokens, logprobs, total = count_differences(reference, mine)
    return {
        **base,
        # The target's bits, to compare one run with the same run at another thread count (evidence/record.py).
        "target_digest": generation_digest(mine),
        "reference_digest": generation_digest(reference),
        "batch_size": len(order),
        "differing_elements": tokens + logprobs,
        "total_elements": total,
        "differing_token_ids": tokens,
        "differing_logprobs": logprobs,
        "target_position": order.index(-1),
        "target_prompt_tokens": len(batch[order.index(-1)][0]),
        "target_cached_tokens": mine.cached_tokens,
        "reference_cached_tokens": reference.cached_tokens,
        "neighbours": [NEIGHBOURS[i][:2] for i in order if i >= 0],
        "co_scheduled": sum(r.scheduled_ts == mine.scheduled_ts for r in results) if mine.scheduled_ts else None,
        "target_tokens": len(mine.token_ids),
        "target_text": mine.text,
    }


async def audit_engine(
    engine,
    *,
    kernels: str,
    targets: Sequence[str],
    batch_sizes: Sequence[int],
    orderings: Sequence[str],
    samplings: Sequence[str],
    max_tokens: int,
    ablation: str | None = None,
    log=print,
) -> list[dict]:
    """All runs for one started engine: per target and sampling, a solo reference, a solo repeat, then co-batched."""
    greedy_only = bool(ablation and ABLATIONS[ablation].get("greedy_only"))
    requests = CanonicalRequests(engine, max_tokens, greedy_only=greedy_only)
    if greedy_only:
        samplings = [s for s in samplings if s == "greedy"]
    runs = []
    worker_threads = sorted({r.get("torch_threads") for r in engine.worker_reports})
    threads = "/".join(map(str, worker_threads))
    label = kernels + (f"/{ablation}" if ablation else "")
    degree = int(engine.settings.args.get("tensor_parallel_size") or 1)
    for target in targets:
        for sampling in samplings:
            (reference,) = await generate_co_batched(engine, [_target(requests, target, sampling)])
            for ordering, order in _plan(batch_sizes, orderings):
                batch = [_target(requests, target, sampling) if i < 0 else requests.neighbour(i) for i in order]
                started = time.monotonic()
                results = await generate_co_batched(engine, batch)
                base = {
                    "stage": "llm",
                    "model": engine.model.name,
                    "kernels": kernels,
                    "dtype": engine.settings.args["dtype"],
                    **({"ablation": ablation} if ablation else {}),
                    # What the evidence table groups by, beside stage, model, dtype and kernels.
                    "detail": f"{target} prompt, {sampling}, {threads} worker thread(s)"
                    + (f", tensor parallel {degree}" if degree > 1 else "")
                    + (f", ablation {ablation}" if ablation else ""),
                    "target": target,
                    "ordering": ordering,
                    "sampling": sampling,
                    "torch_threads": worker_threads[-1],
                    "tensor_parallel_size": degree,
                }
                run = {
                    **_record(base, order, batch, results, reference),
                    "seconds": round(time.monotonic() - started, 2),
                }
                runs.append(run)
                log(
                    f"[llm audit] kernels={label} {target} {sampling} batch={run['batch_size']} {ordering}: "
                    f"{run['differing_elements']}/{run['total_elements']} differ "
                    f"(co-scheduled {run['co_scheduled']}, cached {run['target_cached_tokens']})"
                )
    return runs


def audit_config(
    model: str | None, setting: str, *, dtype: str, torch_threads: int | None, tensor_parallel: int = 1
) -> LLMStageConfig:
    """The engine of one kernel setting: the stage's own config, with log stats on (they time the scheduling), and
    `tensor_parallel` vLLM workers (1: the stage's default, no tensor_parallel_size given)."""
    parallel = {"tensor_parallel_size": tensor_parallel} if tensor_parallel > 1 else {}
    return LLMStageConfig(
        model=model,
        batch_invariant=(setting == "on"),
        dtype=dtype,
        torch_threads=torch_threads,
        engine_args={"disable_log_stats": False, **parallel},
    )


async def _run(
    model: str | None,
    kernels: Sequence[str],
    ablation: str | None,
    engine_config: dict,
    audit: dict,
    log,
    control_threads: int | None = None,
):
    runs, engines, scope = [], {}, []
    # The audited configuration's engines, then (control_threads) the same settings at another thread count: where
    # the control never varies at the audited count, a record may rest on one that varies at another
    # (evidence/record.py), the kernels-on bits being equal at both.
    plan = [(setting, engine_config) for setting in kernels]
    if control_threads is not None:
        plan += [(setting, {**engine_config, "torch_threads": control_threads}) for setting in kernels]
    for index, (setting, config) in enumerate(plan):
        audited = index < len(kernels)
        engine = LLMEngine(audit_config(model, setting, **config))
        if ablation and setting == "on":
            # Deliberately off the supported path: revert one invariance setting after validation.
            engine.settings.args.update(ABLATIONS[ablation]["args"])
            engine.settings.environment.update(ABLATIONS[ablation]["env"])
        await engine.start()
        log(
            f"[llm audit] engine kernels={setting} torch_threads={config['torch_threads']} started in {engine.startup_s} s"
        )
        try:
            if setting == "on" and audited:  # the configuration a record of this audit would verify
                detail = {k: audit[k] for k in ("targets", "samplings", "max_tokens")} | {"ablation": ablation}
                scope.append(scope_entry(engine.model.name, llm_configuration(engine), detail=detail))
            runs += await audit_engine(
                engine, kernels=setting, ablation=ablation if setting == "on" else None, log=log, **audit
            )
            engines[setting if audited else f"{setting}, {config['torch_threads']} threads"] = (
                engine.describe().model_dump(mode="json")
            )
        finally:
            engine.shutdown()
    return runs, engines, scope


def run_llm_audit(
    model: str | None = None,
    *,
    kernels: Sequence[str] = ("off", "on"),
    targets: Sequence[str] = tuple(TARGETS),
    batch_sizes: Sequence[int] = tuple(range(1, 9)),
    orderings: Sequence[str] = ORDERINGS,
    samplings: Sequence[str] = SAMPLINGS,
    max_tokens: int = 16,
    ablation: str | None = None,
    command: Sequence[str] | None = None,
    log=print,
    dtype: str = "float32",
    torch_threads: int | None = None,
    control_threads: int | None = None,
    tensor_parallel: int = 1,
) -> dict:
    """Run the audit (starts one engine per kernel setting; call under `if __name__ == "__main__":`).

    `control_threads`: run every setting again at that thread count too (a control that may vary where the
    audited count's does not; see evidence/record.py). `tensor_parallel`: vLLM workers per engine (threads are
    per worker).

    Returns {"runs": [...], "summary": {...}, "environment": {...}}; `summary["invariant"]` is the verdict.
    """
    if any(size < 1 or size > 1 + len(NEIGHBOURS) for size in batch_sizes):
        raise ValueError(f"batch sizes must be in 1..{1 + len(NEIGHBOURS)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; expected some of {sorted(TARGETS)}")
    if ablation is not None and ablation not in ABLATIONS:
        raise ValueError(f"unknown ablation {ablation!r}; expected one of {sorted(ABLATIONS)}")
    started = time.time()
    env = environment(command)
    audit = {
        "targets": targets,
        "batch_sizes": batch_sizes,
        "orderings": orderings,
        "samplings": samplings,
        "max_tokens": max_tokens,
    }
    if tensor_parallel < 1:
        raise ValueError("tensor_parallel must be at least 1")
    engine_config = {"dtype": dtype, "torch_threads": torch_threads, "tensor_parallel": tensor_parallel}
    if control_threads is not None and (torch_threads is None or control_threads == torch_threads):
        raise ValueError("control_threads needs --torch-threads and must differ from it")
    runs, engines, scope = asyncio.run(_run(model, kernels, ablation, engine_config, audit, log, control_threads))
    # The model runs in vLLM's worker: its engine arguments and kernel reports, per setting.
    env["engines"] = engines
    env["seconds"] = round(time.time() - started, 1)
    summary = summarize(runs)
    summary["all_co_scheduled"] = all(r["co_scheduled"] in (None, r["batch_size"]) for r in runs)
    return {"runs": runs, "summary": summary, "environment": env, "scope": scope}
