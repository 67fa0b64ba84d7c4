"""A diffusion stage scaled down under load: the replica Serve stops hands its samples off at the next step boundary,
the ingress sends each on to the replica that stays, from the step it had reached, and every image keeps its bytes.

Real Ray, real Serve, real HTTP on loopback. The scale-down is what a user's redeploy with fewer replicas does: the
same deployment version with `num_replicas` 2 -> 1 (Serve then stops one replica and keeps the other; `serve run`
from Python gives every deploy a new version and would replace both, so the test pins one). Every request renders
(no result cache here) and is distinct. The bytes compared are those of the same requests rendered by the two
replicas before; that a resumed sample continues its own state, not a fresh one, is tests/stages/test_checkpoint.py's
(with its control).
"""

import asyncio

import httpx
import pytest

from tests.reliability import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "scale-down"
REQUESTS, CONCURRENCY, SCALE_AFTER_DONE = 32, 8, 6


def app_config(replica_count: int) -> dict:
    return {
        "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.1},
                "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
        # 24 steps: a render spans many step boundaries, so the stopped replica has samples part-way through.
        "diffusion": {"batch_invariant": True, "num_replicas": replica_count, "ray_actor_options": {"num_cpus": 0.4},
                      "defaults": {"num_inference_steps": 24}, "max_batch_size": 4},
        "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "request_timeout_s": 300},
    }


def pinned(app, version: str = NAME):
    """The app with every deployment at one version: a redeploy that changes only replica counts then scales."""
    from ray import serve

    deployment = app._bound_deployment
    args = tuple(pinned(a, version) if isinstance(a, serve.Application) else a for a in deployment.init_args)
    return deployment.options(version=version, _internal=True).bind(*args, **deployment.init_kwargs)


def deploy(replica_count: int) -> None:
    from ray import serve

    from orchestration import build_app

    serve.run(pinned(build_app(app_config(replica_count))), name=NAME, route_prefix=f"/{NAME}")


@pytest.fixture(scope="module")
def app(serve_instance):
    from ray import serve

    deploy(2)
    try:
        yield f"{serve_instance}/{NAME}"
    finally:
        serve.delete(NAME)


def body(i: int) -> dict:
    return {"prompt": f"scaled {i}", "seed": 1000 + i, "size": "64x64", "enhance_prompt": False}


async def load(url: str, during=None) -> list[httpx.Response]:
    """REQUESTS distinct requests at CONCURRENCY; `during()` (the scale-down) once SCALE_AFTER_DONE have answered."""
    return await replicas.image_load(url, body, REQUESTS, CONCURRENCY, after=SCALE_AFTER_DONE, during=during)


def served_by_both(responses: list[httpx.Response]) -> bool:
    """Both replicas rendered some of the load: the router knows both, so the one Serve stops has work in flight."""
    return len({r.json()["data"][0]["replica"] for r in responses if r.status_code == 200}) == 2


def test_a_scale_down_under_load_hands_samples_off_at_a_step_boundary_losing_nothing_and_changing_no_byte(app):
    reference = asyncio.run(load(app))
    assert all(r.status_code == 200 for r in reference), [r.text for r in reference if r.status_code != 200][:3]
    expected = [r.json()["data"][0]["sha256"] for r in reference]
    for run in range(1, replicas.runs() + 1):  # each run scales 2 -> 1 under load, then back to 2
        if run > 1:
            deploy(2)
            assert any(served_by_both(asyncio.run(load(app))) for _ in range(5)), "the new replica was never routed to"
        assert len(replicas.replica_pids(NAME, "DiffusionStage")) == 2
        before = health(app)["ingress"]["handed_off"]

        under_scale_down = asyncio.run(load(app, during=lambda: deploy(1)))
        failed = [(i, r.status_code, r.text[:200]) for i, r in enumerate(under_scale_down) if r.status_code != 200]
        assert not failed, (run, failed)
        assert [r.json()["data"][0]["sha256"] for r in under_scale_down] == expected, run
        after = health(app)["ingress"]["handed_off"]
        calls, from_a_step = after["calls"] - before["calls"], after["from_a_step"] - before["from_a_step"]
        assert from_a_step > 0, f"run {run}: no render was handed off part-way: the stopped replica had none in flight"
        assert len(replicas.replica_pids(NAME, "DiffusionStage")) == 1
        print(f"\nrun {run}: scaled 2 -> 1 under load: {REQUESTS} of {REQUESTS} 200 and identical, {calls} renders "
              f"handed off ({from_a_step} from a step they had reached)")


def health(app: str) -> dict:
    return httpx.get(f"{app}/health", timeout=60).json()
