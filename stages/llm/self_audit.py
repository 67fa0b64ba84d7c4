"""An LLM replica proves its own promise where it runs, before it takes traffic (issue 44).

After its engine starts, a replica whose invariance is on runs a target enhancement request solo and co-batched with
the canonical neighbours (`stages.llm.self_check.NEIGHBOURS`: other prompts and lengths, greedy and seeded, other
output lengths; every run enters one scheduling step), greedy and seeded, and compares the target's tokens and
logprobs with its solo run: first with its kernels, then with our kernels out as the control, both inside the
replica's own engine (`stages.kernels.vllm_cpu.audit_kernels`: the rerouted layers' F.linear reaches ATen's stock GEMM;
no second engine starts), the kernels put back after. (vLLM's own stock CPU path, oneDNN, never varies at one thread:
the audits' control needs two, evidence/llm.py; ATen's stock GEMM varies at one, measured: 14 of 14 quick runs on the
avx2 path.) Verdict, record and reuse as the diffusion stage's (`stages.self_audit`).

    quick   batch sizes 2..max_num_seqs (up to 8), the long prompt in the middle
    full    the short prompt too, first, middle and last

CUDA engines take vLLM's own invariance mode when they start and cannot leave it in place: no self-audit runs there
(the records and the golden self-check decide).
"""

from __future__ import annotations

import time

from contracts import envs
from contracts.results import Generation
from contracts.scope import Configuration, Coverage, SelfAudit
from stages.self_audit import Finding, reusable

from .co_batched import generate_co_batched
from .self_check import NEIGHBOURS, CanonicalRequests

TARGETS = {
    "short": "a lighthouse on a cliff at dusk",
    # Long enough for its KV cache to span several blocks: the prompt whose stock control varies (evidence/llm.py).
    "long": (
        "a lighthouse on a cliff at dusk, waves breaking on the rocks below, a narrow path winding up the hill between "
        "wild flowers, a small house with a red door and a warm window, seagulls circling in the wind, a fishing boat "
        "returning to the harbour with its lamps lit, clouds torn open by the last light of the sun, the first stars "
        "over the sea, a dog sitting on the steps and looking at the water, an old keeper climbing the stairs with a "
        "lantern, reflections of the beam on the wet stones, a quiet village in the distance with smoke rising from "
        "the chimneys, moss on the walls, rain drops on the glass, a detailed and calm scene"
    ),
}
SEED = 1234
MAX_TOKENS = 16
SAMPLINGS = ("greedy", "seeded")
PLANS = {"quick": (("long",), ("middle",)), "full": (("short", "long"), ("first", "middle", "last"))}


class _Plan:
    """One setting's runs: per target and sampling, the solo reference, then each co-batched arrangement."""

    def __init__(self, engine, mode: str):
        self.engine = engine
        self.targets, self.orderings = PLANS[mode]
        self.batch_sizes = list(range(2, min(engine.config.max_num_seqs, 1 + len(NEIGHBOURS)) + 1))

    def arrangements(self) -> list[tuple[str, str, int, int]]:
        """(target, sampling, batch size, the target's position)."""
        return [
            (target, sampling, size, {"first": 0, "middle": size // 2, "last": size - 1}[ordering])
            for target in self.targets
            for sampling in SAMPLINGS
            for size in self.batch_sizes
            for ordering in self.orderings
        ]

    async def run(self, *, until_varied: bool = False) -> tuple[int, list[str], int]:
        """(arrangements run, the cases whose target differed from solo with their counts, the differing elements in
        all). `until_varied` (the control): the largest batches first, stopping at the first that differs, which is all
        a control must show."""
        requests = CanonicalRequests(self.engine, MAX_TOKENS)  # fresh vLLM requests: vLLM may mutate them
        target = lambda name, sampling: requests.enhancement(TARGETS[name], sampling, SEED)  # noqa: E731
        solos: dict[tuple[str, str], Generation] = {}
        ran, cases, elements = 0, [], 0
        arrangements = self.arrangements()
        for name, sampling, size, at in reversed(arrangements) if until_varied else arrangements:
            if (name, sampling) not in solos:
                (solos[name, sampling],) = await generate_co_batched(self.engine, [target(name, sampling)])
            batch = [requests.neighbour(i) for i in range(size - 1)]
            results = await generate_co_batched(self.engine, [*batch[:at], target(name, sampling), *batch[at:]])
            tokens, logprobs, _ = count_differences(solos[name, sampling], results[at])
            count = tokens + logprobs
            if count:
                cases.append(f"{name} prompt {sampling}, batch {size} at {at} ({count} elements)")
            ran += 1
            elements += count
            if until_varied and cases:
                break
        return ran, cases, elements


def count_differences(reference: Generation, result: Generation) -> tuple[int, int, int]:
    """(differing token ids, differing logprob values, total elements of the reference): the top-k entries of every
    position, the sampled token's included."""
    ref_ids, ids = reference.token_ids, result.token_ids
    tokens = sum(a != b for a, b in zip(ref_ids, ids, strict=False)) + abs(len(ref_ids) - len(ids))
    ref_top, top = reference.top_logprobs, result.top_logprobs
    logprobs = 0
    for i in range(max(len(ref_top), len(top))):
        a = dict(ref_top[i]) if i < len(ref_top) else {}
        b = dict(top[i]) if i < len(top) else {}
        logprobs += sum(a.get(k) != b.get(k) for k in a.keys() | b.keys())
    total = len(ref_ids) + sum(len(step) for step in ref_top)
    return tokens, logprobs, total


async def _kernels(engine, on: bool) -> None:
    """Our kernels in or out of the engine's workers, and its prefix cache emptied: KV blocks the other kernels computed
    (the shared system prompt's) must serve neither the control nor, after it, a single request."""
    await engine.async_llm.collective_rpc("omniserve_self_audit_kernels", args=(on,))
    if not await engine.async_llm.reset_prefix_cache():
        raise RuntimeError("the LLM self-audit could not empty the prefix cache after switching kernels")


async def llm_self_audit(engine, configuration: Configuration, *, replica: str) -> SelfAudit | None:
    """Audit this replica's configuration here, or reuse an earlier start's record of it (nothing run); None where
    there is nothing to audit: invariance off, `self_audit: off`, or a CUDA engine."""
    mode = engine.config.self_audit
    if not engine.batch_invariant or mode == "off" or engine.device != "cpu":
        return None
    plan = _Plan(engine, mode)
    if not plan.batch_sizes:  # one sequence per step: nothing ever shares a batch
        return None
    batch_size = max(plan.batch_sizes)  # above 8 (the canonical neighbours), the verdict names what is not audited
    reused = reusable(configuration, plan.orderings, batch_size)
    if reused is not None:
        return SelfAudit(mode=mode, control_varied=reused.valid, record=reused.name, reused=True)
    started = time.monotonic()
    runs, differing, elements = await plan.run()
    try:
        await _kernels(engine, False)
        control_runs, varied, _ = await plan.run(until_varied=True)
    finally:
        await _kernels(engine, True)  # the replica serves as it started
    coverage = Coverage(
        batch_sizes=list(range(1, batch_size + 1)),
        orderings=list(plan.orderings),
        detail={"targets": list(plan.targets), "samplings": list(SAMPLINGS), "max_tokens": MAX_TOKENS},
    )
    finding = Finding(runs, differing, elements, control_runs, len(varied))
    return finding.kept(configuration, coverage, mode=mode, replica=replica, started=started)


async def leave_kernels_out_under_test_fault(engine) -> None:
    """Test-only fault (OMNISERVE_TEST_FAULT=kernels-uninstalled): the switch says on and the workers report their
    kernels installed (checked at start), but stock kernels answer from here on. The self-audit must catch it
    (tests/stages/test_llm_self_audit.py); `audit_kernels` keeps them out."""
    if engine.batch_invariant and engine.device == "cpu" and envs.read("OMNISERVE_TEST_FAULT") == "kernels-uninstalled":
        await _kernels(engine, False)
