"""The LLM stage's canonical requests and the bits they must give: its side of the golden table (contracts/scope.py).

A replica checks itself against its column at start-up (`llm_self_check`, a few seconds on the embedded model): a
replica that reproduces its column computes the bits of the machine that made it, so that machine's audit records
cover it too (`contracts.scope.match`). The recorder that writes the columns is evidence/golden.py; the diffusion side,
and what a column is keyed by (the kernel path, not every CPU flag), is stages/diffusion/self_check.py.

Cases, per sampling (greedy; seeded with a fixed seed): the stage's own enhancement request for a fixed prompt,
solo; the same request co-batched with two of the canonical neighbours (NEIGHBOURS below, which the audit,
evidence/llm.py, co-batches too: a short random-token prompt, seeded, and another enhancement, greedy) that enter the
same scheduling step. Each case's digest is the sha256 of the canonical JSON of its token ids, logprobs and top
logprobs; the co-batched target must give the solo bits, and the neighbours give theirs.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from contracts.results import Generation
from contracts.sampling import LLMSamplingParams
from contracts.scope import Configuration, GoldenColumn, SelfCheck, load_golden

from .co_batched import generate_co_batched
from .engine import LLMRequests

PROMPT = "a red fox in the snow"
SEED = 1234
MAX_TOKENS = 16
SAMPLINGS = ("greedy", "seeded")
TOP_LOGPROBS = 5
# The neighbours: (kind, prompt length or user prompt, sampling, max_tokens); the audit's first n-1 join a batch of n.
# Enhancements ("enhance", max_tokens 0) take the caller's max_tokens, as the target does.
NEIGHBOURS: tuple[tuple[str, Any, str, int], ...] = (
    ("tokens", 5, "seeded", 40),
    ("enhance", "a small village in the snow", "greedy", 0),
    ("tokens", 113, "greedy", 8),
    ("tokens", 13, "seeded", 60),
    ("enhance", "portrait of an old fisherman, detailed, warm colors, close up", "seeded", 0),
    ("tokens", 71, "seeded", 3),
    ("tokens", 29, "greedy", 24),
)
#: Indices into NEIGHBOURS: the self-check's batch is [neighbour 1, target, neighbour 2].
NEIGHBOUR_INDICES = (0, 1)


class CanonicalRequests:
    """Builds fresh vLLM requests (vLLM may mutate SamplingParams, so never reuse one): enhancements of a prompt and
    the NEIGHBOURS, each random-token prompt drawn once from a fixed seed."""

    def __init__(self, engine, max_tokens: int, greedy_only: bool = False):
        self.requests = LLMRequests(engine)
        self.max_tokens = max_tokens
        self.greedy_only = greedy_only
        vocab = len(engine.tokenizer)
        # Ids past the embedded tokenizer's special tokens.
        rng = random.Random(7)
        self.token_prompts = {
            length: [rng.randrange(7, vocab) for _ in range(length)]
            for kind, length, _, _ in NEIGHBOURS
            if kind == "tokens"
        }

    def _params(self, sampling: str, seed: int, max_tokens: int) -> LLMSamplingParams:
        if sampling == "greedy" or self.greedy_only:
            return LLMSamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS)
        return LLMSamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=max_tokens, logprobs=TOP_LOGPROBS)

    def enhancement(self, prompt: str, sampling: str, seed: int):
        ids, _, vllm_sampling = self.requests.enhancement(prompt, self._params(sampling, seed, self.max_tokens))
        return ids, vllm_sampling

    def neighbour(self, index: int):
        kind, what, sampling, max_tokens = NEIGHBOURS[index]
        if kind == "enhance":
            return self.enhancement(what, sampling, seed=100 + index)
        ids = self.token_prompts[what]
        return ids, self.requests.sampling(self._params(sampling, 100 + index, max_tokens), len(ids), field="prompt")


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
    requests = CanonicalRequests(engine, MAX_TOKENS)  # fresh vLLM requests each time: vLLM may mutate SamplingParams
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
        return configuration.compare_golden({}, columns)
    return configuration.compare_golden(await llm_digests(engine), columns)
