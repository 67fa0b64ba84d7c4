"""The ingress's cache of prompt rewrites: bounded, least recently used first out, on by default only under LLM
invariance, and a hit is the miss's bytes (unit tests here; the app end to end over HTTP below, marked slow)."""

import asyncio
import time

import httpx
import pytest

from contracts.config import DEFAULT_REWRITE_CACHE_ENTRIES
from contracts.results import RevisedPrompt
from contracts.sampling import LLMSamplingParams
from orchestration.config import AppConfig
from orchestration.pipeline import ImagePipeline, RewriteCache
from orchestration.retries import Retrying


def rewrite(prompt: str, seed: int) -> RevisedPrompt:
    params = LLMSamplingParams(seed=seed, max_tokens=8)
    return RevisedPrompt(revised_prompt=f"{prompt}, watercolor", prompt=prompt, completion="watercolor", token_ids=[1],
                         logprobs=[-0.5], top_logprobs=None, finish_reason="stop", prompt_tokens=3, seed=seed,
                         params=params, structured_output=True, model="m", batch_invariant=True, kernel_backend="cpu")


def params(seed: int, **fields) -> LLMSamplingParams:
    return LLMSamplingParams(seed=seed, **fields)


def test_the_cache_keeps_at_most_its_bound_and_drops_the_least_recently_used():
    cache = RewriteCache(2)
    for seed in (1, 2):
        cache.put("a fox", params(seed), rewrite("a fox", seed))
    assert cache.get("a fox", params(1)) is not None  # 1 is now the most recently used
    cache.put("a fox", params(3), rewrite("a fox", 3))
    assert cache.get("a fox", params(2)) is None and cache.get("a fox", params(1)) is not None
    assert cache.get("a fox", params(3)) is not None
    assert cache.stats == {"max_entries": 2, "entries": 2, "hits": 3, "misses": 1}


def test_every_field_of_the_seeded_params_and_the_prompt_are_part_of_the_key():
    cache = RewriteCache(8)
    cache.put("a fox", params(1), rewrite("a fox", 1))
    assert cache.get("a fox", params(1)) is not None
    assert cache.get("a fox", params(2)) is None
    assert cache.get("a fox", params(1, temperature=0.5)) is None
    assert cache.get("a fox ", params(1)) is None


def test_a_cache_of_zero_entries_keeps_and_counts_nothing():
    cache = RewriteCache(0)
    cache.put("a fox", params(1), rewrite("a fox", 1))
    assert cache.get("a fox", params(1)) is None
    assert cache.stats == {"max_entries": 0, "entries": 0, "hits": 0, "misses": 0}


def test_the_cache_is_on_by_default_only_when_the_llm_stage_is_batch_invariant(clean_switches):
    def entries(**config) -> int:
        return AppConfig.model_validate(config).with_resolved_switches().rewrite_cache_entries

    assert entries(llm={"batch_invariant": True}) == DEFAULT_REWRITE_CACHE_ENTRIES
    assert entries(llm={"batch_invariant": False}) == 0
    assert entries(llm={"batch_invariant": False}, ingress={"rewrite_cache_entries": 5}) == 5
    assert entries(llm={"batch_invariant": True}, ingress={"rewrite_cache_entries": 0}) == 0
    with pytest.raises(ValueError):
        AppConfig.model_validate({"ingress": {"rewrite_cache_entries": -1}})


class FakeLLM:
    """A DeploymentHandle's shape: `enhance.remote(...)` is awaitable; counts calls, fails when told to."""

    def __init__(self, failures: int = 0):
        self.calls, self.failures = 0, failures
        self.enhance = self

    def remote(self, prompt, llm_params):
        self.calls += 1

        async def answer():
            if self.failures:
                self.failures -= 1
                raise ValueError("a refusal: not retried, not kept")
            return rewrite(prompt, llm_params.seed)

        return answer()


def test_the_pipeline_asks_the_llm_stage_once_per_distinct_rewrite_and_never_keeps_a_failure():
    llm = FakeLLM(failures=1)
    pipeline = ImagePipeline(llm, None, Retrying(1, 0.0), RewriteCache(4))
    with pytest.raises(ValueError):
        asyncio.run(pipeline.rewrite("a fox", params(1)))
    first = asyncio.run(pipeline.rewrite("a fox", params(1)))
    again = asyncio.run(pipeline.rewrite("a fox", params(1)))
    other = asyncio.run(pipeline.rewrite("a fox", params(2)))
    assert again is first and other.seed == 2 and llm.calls == 3
    assert pipeline.rewrites.stats == {"max_entries": 4, "entries": 2, "hits": 1, "misses": 3}


# --- the app end to end ----------------------------------------------------------------------------

NAME = "rewrite-cache"
APP = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.05}},
    "diffusion": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.05},
                  "defaults": {"num_inference_steps": 2}},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "rewrite_cache_entries": 2},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hit_answers_the_misses_bytes_over_http_and_health_counts_it(serve_instance):
    from ray import serve

    from orchestration import build_app

    serve.run(build_app(APP), name=NAME, route_prefix=f"/{NAME}")
    try:
        with httpx.Client(base_url=f"{serve_instance}/{NAME}", timeout=300) as http:
            def image(prompt: str, seed: int) -> dict:
                body = {"prompt": prompt, "seed": seed, "size": "64x64", "enhance_prompt": True}
                response = http.post("/v1/images/generations", json=body)
                assert response.status_code == 200, response.text
                answer = response.json()
                return {"data": answer["data"], "invariance": answer["invariance"]}

            miss = image("a lighthouse at dusk", 11)
            hit = image("a lighthouse at dusk", 11)
            assert hit == miss  # every byte of the image, its revised prompt, seed and provenance
            for seed in (12, 13):  # two more distinct rewrites: the bound (2) drops seed 11's
                image("a lighthouse at dusk", seed)
            assert image("a lighthouse at dusk", 11) == miss  # a miss again, computed again: the same bytes
            time.sleep(0.1)
            cache = http.get("/health").json()["ingress"]["rewrite_cache"]
        assert cache == {"max_entries": 2, "entries": 2, "hits": 1, "misses": 4}
    finally:
        serve.delete(NAME)
