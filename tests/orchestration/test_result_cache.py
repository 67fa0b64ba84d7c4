"""The ingress's exact result caches (orchestration/result_cache.py): unit tests of what they keep (exact results only,
within their bytes, least recently used out, never across a change of the stages that made them), then an app of its
own over HTTP (marked slow): a repeated image request or chat completion is answered from it with identical bytes and
says so, any change to the request misses, an app whose switches are off keeps nothing, and an exact image response
carries an ETag and Cache-Control."""

import hashlib
import time

import pytest

from contracts.results import RenderedImage, RevisedPrompt
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams, StepCache
from orchestration.result_cache import ResultCache, exact, image_key
from tests.scope_facts import record_gap

from .conftest import TIMEOUT_S


def image(seed: int, *, size: int = 100, model: str = "m", invariant: bool = True, verified: bool = True) -> RenderedImage:
    return RenderedImage(png=bytes([seed % 256]) * size, sha256="0" * 64, seed=seed, num_inference_steps=4,
                         guidance_scale=7.5, height=64, width=64, batch_size=1, steps_co_batched=0, steps_computed=4,
                         replica="r", model=model, batch_invariant=invariant, kernel_backend="cpu", verified=verified,
                         verified_by="record" if verified else "")


def key(seed: int, prompt: str = "a fox", **fields) -> str:
    return image_key(prompt, None, DiffusionSamplingParams(seed=seed, **fields), None)


def put(cache: ResultCache, seed: int, made: RenderedImage, rewrite: RevisedPrompt | None = None) -> None:
    cache.put(key(seed), made, made_by=made, size=len(made.png), exact=exact(made) and exact(rewrite))


def test_a_kept_image_is_answered_and_the_least_recently_used_leaves_past_the_bytes_bound():
    cache: ResultCache[RenderedImage] = ResultCache("image", 250)
    for seed in (1, 2):
        put(cache, seed, image(seed))
    assert cache.get(key(1)).seed == 1  # 1 is now the most recently used
    put(cache, 3, image(3))  # 300 bytes > 250: 2 leaves
    assert cache.get(key(2)) is None and cache.get(key(1)) is not None and cache.get(key(3)) is not None
    assert cache.stats | {"hits": 0, "misses": 0} == {"max_bytes": 250, "bytes": 200, "entries": 2, "hits": 0,
                                                      "misses": 0, "not_kept": 0}


def test_every_field_decides_the_key():
    base = key(1)
    others = [key(2), key(1, "a fox "), key(1, num_inference_steps=5), key(1, height=128),
              key(1, cache=StepCache(method="teacache", threshold=0.1)), key(1, negative_prompt="blur"),
              image_key("a fox", LLMSamplingParams(seed=1), DiffusionSamplingParams(seed=1), None),
              image_key("a fox", None, DiffusionSamplingParams(seed=1), b"an input image")]
    assert len({base, *others}) == len(others) + 1


def test_only_exact_images_are_kept_and_a_rewrite_must_be_exact_too():
    cache: ResultCache[RenderedImage] = ResultCache("image", 1 << 20)
    put(cache, 1, image(1, invariant=False, verified=False))
    put(cache, 2, image(2, verified=False))
    loose = RevisedPrompt(revised_prompt="x", prompt="a fox", completion="x", token_ids=[1], logprobs=[0.0],
                          top_logprobs=None, finish_reason="stop", prompt_tokens=1, seed=3,
                          params=LLMSamplingParams(seed=3), structured_output=True, model="llm", batch_invariant=True,
                          kernel_backend="cpu", verified=False)
    put(cache, 3, image(3), loose)
    assert [cache.get(key(s)) for s in (1, 2, 3)] == [None] * 3 and cache.stats["not_kept"] == 3


def test_an_image_from_other_stages_empties_the_cache_it_never_answers_across_a_model_change():
    cache: ResultCache[RenderedImage] = ResultCache("image", 1 << 20)
    put(cache, 1, image(1))
    put(cache, 2, image(2, model="another model"))
    assert cache.get(key(1)) is None and cache.get(key(2)) is not None


def test_a_cache_of_zero_bytes_keeps_nothing_and_counts_nothing():
    cache: ResultCache[RenderedImage] = ResultCache("image", 0)
    put(cache, 1, image(1))
    assert cache.get(key(1)) is None and cache.stats["hits"] == cache.stats["misses"] == 0


# --- over HTTP ------------------------------------------------------------------------------------------------------


def app_config(invariant: bool) -> dict:
    """One diffusion replica (16 steps by default) and, switch on, one LLM replica; both caching 4 MiB."""
    llm = ({"num_replicas": 1, "torch_threads": 1} if invariant else
           {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}})
    return {
        "llm": {"batch_invariant": invariant, "ray_actor_options": {"num_cpus": 0.1}, **llm},
        "diffusion": {"batch_invariant": invariant, "ray_actor_options": {"num_cpus": 0.2}, "torch_threads": 1,
                      "defaults": {"num_inference_steps": 16}},
        "ingress": {"ray_actor_options": {"num_cpus": 0.02}, "result_cache_mib": 4},
    }


@pytest.fixture(scope="module")
def cache_http(server):
    import httpx
    from ray import serve

    from orchestration import build_app

    serve.run(build_app(app_config(True)), name="cached", route_prefix="/cached")
    serve.run(build_app(app_config(False)), name="cached-off", route_prefix="/cached-off")
    try:
        with httpx.Client(base_url=server, timeout=TIMEOUT_S) as client:
            yield client
    finally:
        serve.delete("cached")
        serve.delete("cached-off")


BODY = {"prompt": "a yellow star on a black background", "size": "64x64", "enhance_prompt": False, "seed": 3}


def post(http, path: str, **fields):
    started = time.monotonic()
    response = http.post(f"{path}/v1/images/generations", json={**BODY, **fields})
    assert response.status_code == 200, response.text
    return response, time.monotonic() - started


@pytest.mark.slow
def test_a_repeated_request_is_answered_from_the_cache_with_identical_bytes_and_says_so(cache_http):
    if gap := record_gap("diffusion"):
        pytest.skip(f"only verified images are kept, and {gap}")
    first, rendered_s = post(cache_http, "/cached")
    again, hit_s = post(cache_http, "/cached")
    (a,), (b,) = first.json()["data"], again.json()["data"]
    assert (a["cache"], b["cache"]) == ("miss", "hit")
    assert b["b64_json"] == a["b64_json"] and b["sha256"] == a["sha256"]
    print(f"render {rendered_s * 1000:.0f} ms, hit {hit_s * 1000:.1f} ms ({hit_s / rendered_s:.1%})")
    stats = cache_http.get("/cached/health").json()["ingress"]["result_cache"]["image"]
    assert stats["hits"] >= 1 and stats["entries"] >= 1
    # An exact response: HTTP caches may keep it, by an ETag naming its images.
    assert again.headers["ETag"] == f'"{hashlib.sha256(a["sha256"].encode()).hexdigest()}"'
    assert "immutable" in again.headers["Cache-Control"]


def forwards(http) -> int:
    """The denoiser forwards the cached app's one diffusion replica has run: they move only when it renders."""
    stage = http.get("/cached/health").json()["stages"]["diffusion"]
    return stage["describe"]["details"]["batching"]["forwards"]


@pytest.mark.slow
def test_cache_control_no_cache_renders_again_says_miss_and_gives_the_kept_bytes(cache_http):
    if gap := record_gap("diffusion"):
        pytest.skip(f"only verified images are kept, and {gap}")
    kept, _ = post(cache_http, "/cached")
    stats = cache_http.get("/cached/health").json()["ingress"]["result_cache"]["image"]
    before = forwards(cache_http)
    for header in ({"Cache-Control": "no-cache"}, {"Cache-Control": "max-age=0, No-Cache"}, {"Pragma": "no-cache"}):
        fresh = cache_http.post("/cached/v1/images/generations", json=BODY, headers=header)
        assert fresh.status_code == 200, fresh.text
        (a,), (b,) = kept.json()["data"], fresh.json()["data"]
        assert b["cache"] == "miss", header
        assert (b["sha256"], b["b64_json"]) == (a["sha256"], a["b64_json"])
        assert forwards(cache_http) >= before + 16, header  # rendered: 16 steps' forwards, not an answer kept
        before = forwards(cache_http)
    after = cache_http.get("/cached/health").json()["ingress"]["result_cache"]["image"]
    assert after["hits"] == stats["hits"] and after["misses"] == stats["misses"] + 3
    # Without the header the same request is a hit again: the entry was refreshed, not dropped.
    again, _ = post(cache_http, "/cached")
    assert again.json()["data"][0]["cache"] == "hit" and forwards(cache_http) == before


@pytest.mark.slow
def test_a_chat_completion_asked_with_no_cache_is_made_again_with_the_same_tokens(cache_http):
    if gap := record_gap("llm"):
        pytest.skip(f"only verified completions are kept, and {gap}")
    body = {"messages": [{"role": "user", "content": "a cat"}], "max_tokens": 8, "seed": 9, "temperature": 0.8}
    first = cache_http.post("/cached/v1/chat/completions", json=body).json()
    fresh = cache_http.post("/cached/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"}).json()
    assert (first["cache"], fresh["cache"]) == ("miss", "miss")
    assert fresh["token_ids"] == first["token_ids"] and fresh["choices"] == first["choices"]


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"seed": 4}, {"prompt": "a yellow star on a black background, left"},
                                    {"num_inference_steps": 15}, {"guidance_scale": 6.0}, {"size": "128x128"},
                                    {"negative_prompt": "blurry"}, {"cache": {"method": "teacache", "threshold": 0.2}}])
def test_any_change_to_the_request_misses(cache_http, change):
    if gap := record_gap("diffusion"):
        pytest.skip(f"only verified images are kept, and {gap}")
    post(cache_http, "/cached")
    response, _ = post(cache_http, "/cached", **change)
    assert response.json()["data"][0]["cache"] == "miss"


@pytest.mark.slow
def test_an_app_whose_switch_is_off_keeps_nothing_and_tells_http_caches_not_to_store(cache_http):
    first, _ = post(cache_http, "/cached-off")
    again, _ = post(cache_http, "/cached-off")
    assert [r.json()["data"][0]["cache"] for r in (first, again)] == ["miss", "miss"]
    assert again.headers["Cache-Control"] == "no-store" and "ETag" not in again.headers
    assert cache_http.get("/cached-off/health").json()["ingress"]["result_cache"]["image"]["not_kept"] >= 2


@pytest.mark.slow
def test_a_repeated_chat_completion_is_answered_from_the_cache_token_for_token_and_another_seed_misses(cache_http):
    if gap := record_gap("llm"):
        pytest.skip(f"only verified completions are kept, and {gap}")
    body = {"messages": [{"role": "user", "content": "a fox"}], "max_tokens": 8, "seed": 5, "temperature": 0.8}
    answers = [cache_http.post("/cached/v1/chat/completions", json=fields).json()
               for fields in (body, body, {**body, "seed": 6})]
    assert [a["cache"] for a in answers] == ["miss", "hit", "miss"]
    assert answers[1]["token_ids"] == answers[0]["token_ids"]
    assert answers[1]["choices"] == answers[0]["choices"]
