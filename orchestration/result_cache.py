"""The ingress's exact result caches: images already rendered and chat completions already made, answered again
without a stage call.

Under batch invariance an image's bytes are a pure function of what decides them: the prompt, whether and how it was
rewritten (the LLM params, seed included), the diffusion params (seed, steps, size, adapters, step caching, ...),
an edit's input image, and the stages that rendered it (model, weights, switches, kernels); a completion's tokens, of
its messages and seeded params (adapter included) and the LLM stage. So a repeated request is answered from here,
byte for byte, and says so (`cache: "hit"`, `omniserve_result_cache_total{kind, result}`).

What is kept, and when:
- only a result whose replica was batch-invariant and verified (an audit record covers it; for images, its
  self-check reproduced the golden table), an image's rewrite, if any, from an invariant and verified LLM replica:
  any other result depends on what it was batched with, and a kept copy would answer for a run that could differ;
- keyed by the canonical JSON of the above (`key`), tagged with the rendering stages' identity as the image's own
  provenance reports it (`identity`: model, switch, kernel backend, the audit record that verified it, which names
  weights and kernels); a result from another identity empties the cache, and an entry answers only while its
  identity is the one last seen: a cache never crosses a model, weights or switch change;
- within `max_bytes` (an image's PNG bytes, a completion's text and tokens), the least recently used dropped first. Each ingress replica keeps its own (a hit
  costs no Ray call at all); a new app config starts new replicas, with empty caches.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from contracts.results import Provenance
from contracts.sampling import ChatMessage, DiffusionSamplingParams, LLMSamplingParams
from stages.metrics import record


def exact(result: Provenance | None) -> bool:
    """A result whose bytes are a pure function of its request: an invariant, verified stage made it (or none ran)."""
    return result is None or (result.batch_invariant and result.verified)


def identity(made_by: Provenance) -> tuple[str, ...]:
    """What made a result, from its own provenance (the record that verified it names weights and kernels)."""
    return (made_by.model, str(made_by.batch_invariant), made_by.kernel_backend, made_by.verified_by)


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def image_key(
    prompt: str, llm_params: LLMSamplingParams | None, params: DiffusionSamplingParams, image: bytes | None
) -> str:
    """sha256 of the canonical JSON of everything a request decides an image's bytes with."""
    return _digest(
        {
            "prompt": prompt,
            "rewrite": None if llm_params is None else llm_params.model_dump(mode="json"),
            "params": params.model_dump(mode="json"),
            "image": None if image is None else hashlib.sha256(image).hexdigest(),
        }
    )


def chat_key(messages: list[ChatMessage], params: LLMSamplingParams) -> str:
    """sha256 of the canonical JSON of a completion's messages and seeded params (its adapter among them)."""
    return _digest(
        {"messages": [m.model_dump(mode="json") for m in messages], "params": params.model_dump(mode="json")}
    )


V = TypeVar("V")


@dataclass(frozen=True)
class Kept(Generic[V]):
    value: V
    size: int
    identity: tuple[str, ...]


class ResultCache(Generic[V]):
    """One kind of result ("image", "chat"), exact ones only, least recently used out past `max_bytes`."""

    def __init__(self, kind: str, max_bytes: int):
        self.kind, self.max_bytes = kind, max_bytes
        self._entries: OrderedDict[str, Kept[V]] = OrderedDict()
        self._identity: tuple[str, ...] | None = None
        self.bytes = 0
        self.hits = self.misses = self.refused = 0

    def get(self, key: str, *, fresh: bool = False) -> V | None:
        """The kept result for `key`, if any; `fresh` (a request's `Cache-Control: no-cache`): none, a miss, so that
        the result is made again (and its `put` refreshes the entry)."""
        if not self.max_bytes:
            return None
        kept = None if fresh else self._entries.get(key)
        if kept is None or kept.identity != self._identity:
            self.misses += 1
            record("omniserve_result_cache_total", kind=self.kind, result="miss")
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        record("omniserve_result_cache_total", kind=self.kind, result="hit")
        return kept.value

    def put(self, key: str, value: V, *, made_by: Provenance, size: int, exact: bool) -> None:
        """Keep an exact result (`exact`: every stage that made it was invariant and verified) of `size` bytes; a
        result from stages of another identity (`made_by`) empties the cache first."""
        if not self.max_bytes:
            return
        seen = identity(made_by)
        if seen != self._identity:
            self._entries.clear()
            self.bytes, self._identity = 0, seen
        if not exact or size > self.max_bytes:
            self.refused += 1
            return
        if key in self._entries:
            self.bytes -= self._entries.pop(key).size
        self._entries[key] = Kept(value, size, seen)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1].size

    @property
    def stats(self) -> dict[str, int]:
        return {
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "entries": len(self._entries),
            "hits": self.hits,
            "misses": self.misses,
            "not_kept": self.refused,  # results that were not exact (switch off, or unverified)
        }
