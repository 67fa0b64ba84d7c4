"""The LLM stage's canonical requests and the bits they must give: its side of the golden table (contracts/scope.py).

The same functions compute a column for the recorder (`llm_golden_column`) and check a replica against it at
start-up (`llm_self_check`, a few seconds on the embedded model): a replica that reproduces its column computes
the bits of the machine that made it, so that machine's audit records cover it too (`contracts.scope.match`).
The diffusion side, and what a column is keyed by (the kernel path, not every CPU flag), is stages/diffusion/golden.py.

Cases, per sampling (greedy; seeded with a fixed seed): the stage's own enhancement request for a fixed prompt,
solo; the same request co-batched with two of the audit's neighbours (stages/audit/llm.py: a short random-token
prompt, seeded, and another enhancement, greedy) that enter the same scheduling step. Each case's digest is the
sha256 of the canonical JSON of its token ids, logprobs and top logprobs; the co-batched target must give the
solo bits, and the neighbours give theirs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

from contracts.results import Generation
from contracts.scope import Configuration, GoldenColumn, SelfCheck, compare_golden, load_golden

PROMPT = "a red fox in the snow"
SEED = 1234
MAX_TOKENS = 16
SAMPLINGS = ("greedy", "seeded")
#: Indices into stages.audit.llm.NEIGHBOURS: the batch is [neighbour 1, target, neighbour 2].
NEIGHBOUR_INDICES = (0, 1)


def generation_digest(generation: Generation) -> str:
    """sha256 of the canonical JSON of (token ids, logprobs, top logprobs); floats print exactly (repr)."""
    blob = json.dumps(
        {
            "token_ids": list(generation.token_ids),
            "logprobs": list(generation.logprobs),
            "top_logprobs": [[list(entry) for entry in step] for step in generation.top_logprobs],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


async def llm_digests(engine) -> dict[str, str]:
    """The canonical requests run on a started `LLMEngine`: case -> sha256 of its output."""
    from stages.audit.llm import _Requests, generate_co_batched

    requests = _Requests(engine, MAX_TOKENS)  # fresh vLLM requests each time: vLLM may mutate SamplingParams
    digests = {}
    for sampling in SAMPLINGS:
        (solo,) = await generate_co_batched(engine, [requests.enhancement(PROMPT, sampling, SEED)])
        first, second = NEIGHBOUR_INDICES
        batch = await generate_co_batched(
            engine,
            [requests.neighbour(first), requests.enhancement(PROMPT, sampling, SEED), requests.neighbour(second)],
        )
        digests[f"{sampling} solo"] = generation_digest(solo)
        digests[f"{sampling} co-batched target"] = generation_digest(batch[1])
        digests[f"{sampling} co-batched neighbour 1"] = generation_digest(batch[0])
        digests[f"{sampling} co-batched neighbour 2"] = generation_digest(batch[2])
    return digests


async def llm_self_check(
    engine, configuration: Configuration, columns: Sequence[GoldenColumn] | None = None
) -> SelfCheck:
    """Run the canonical requests and compare them with this configuration's golden column (none: run nothing)."""
    columns = load_golden() if columns is None else columns
    if not any(c.configuration == configuration for c in columns):
        return compare_golden(configuration, {}, columns)
    return compare_golden(configuration, await llm_digests(engine), columns)


async def llm_golden_column(engine, configuration: Configuration) -> GoldenColumn:
    """This machine's column for the recorder (`contracts.scope.write_golden`): the digests, when and on what CPU."""
    from stages.audit.report import environment

    digests = await llm_digests(engine)
    made = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": environment([])["hardware"]["cpu"]}
    return GoldenColumn(configuration=configuration, digests=digests, made=made)
