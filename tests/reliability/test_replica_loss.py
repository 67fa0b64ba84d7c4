"""A diffusion replica killed (SIGKILL) under load: no request is lost, every image keeps its bytes.

The ingress sends a call that failed because its replica died to another replica (orchestration.retries);
the bytes are a pure function of params and seed, so the retried image equals the one the client would have
got. Real Ray, real Serve, real HTTP on loopback; the replica's process is killed by its own pid.
"""

import asyncio
import base64
import time

import httpx
import pytest

from tests.reliability import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The kill comes with CONCURRENCY calls in flight and 72 to come (160 before: as many in flight, more of the suite's time).
REQUESTS, CONCURRENCY, KILL_AFTER_DONE = 96, 16, 24
APP = {
    # The LLM stage is not used here (enhance_prompt false): scaled to zero, it costs nothing.
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.1},
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
    "diffusion": {"batch_invariant": True, "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.4},
                  "defaults": {"num_inference_steps": 2}, "health_check_period_s": 1, "health_check_timeout_s": 10},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "request_timeout_s": 120},
}


@pytest.fixture(scope="module")
def app(serve_instance):
    with replicas.deployed(serve_instance, "replica-loss", APP) as url:
        yield url


def body(i: int) -> dict:
    return {"prompt": f"request {i}", "seed": i, "size": "64x64", "enhance_prompt": False}


async def load(url: str, during=None) -> list[httpx.Response]:
    """REQUESTS requests at CONCURRENCY; `during()` (the kill) once KILL_AFTER_DONE of them have answered, with
    CONCURRENCY in flight on both replicas."""
    return await replicas.image_load(url, body, REQUESTS, CONCURRENCY, after=KILL_AFTER_DONE, during=during)


def replica_pids() -> set[int]:
    return replicas.replica_pids("replica-loss", "DiffusionStage")


def test_killing_one_of_two_diffusion_replicas_under_load_loses_no_request_and_changes_no_byte(app):
    reference = asyncio.run(load(app))
    assert all(r.status_code == 200 for r in reference), [r.text for r in reference if r.status_code != 200][:3]
    expected = [r.json()["data"][0]["sha256"] for r in reference]
    for run in range(1, replicas.runs() + 1):  # each run kills a replica; the next waits for its replacement
        wait_for_two_replicas(app)
        pids, killed = replica_pids(), []
        retried_before = health(app)["ingress"]["retried_calls"]
        started = time.monotonic()
        under_fault = asyncio.run(
            load(app, during=lambda: killed.append(replicas.kill_when_busy("replica-loss", "DiffusionStage", pids)))  # noqa: B023
        )
        ((victim, _),) = killed
        failed = [(i, r.status_code, r.text[:200]) for i, r in enumerate(under_fault) if r.status_code != 200]
        assert not failed, (run, failed)
        got = [r.json()["data"][0] for r in under_fault]
        assert [item["sha256"] for item in got] == expected, run
        assert all(base64.b64decode(item["b64_json"]).startswith(b"\x89PNG") for item in got)
        assert all(item.get("cache") is None for item in got)  # no result cache here: every request rendered
        retried = health(app)["ingress"]["retried_calls"] - retried_before
        assert retried > 0, f"run {run}: no call was retried: the replica died after the load"
        print(f"\nrun {run}: diffusion replica {victim} SIGKILLed under load: {REQUESTS} of {REQUESTS} 200 and "
              f"identical, {retried} calls retried, load {time.monotonic() - started:.1f} s")
        assert victim not in replica_pids()
    # Serve replaces the dead replica: two live replica processes again, both serving.
    wait_for_two_replicas(app)


def health(app: str) -> dict:
    return httpx.get(f"{app}/health", timeout=60).json()


def wait_for_two_replicas(app: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(pids := replica_pids()) < 2 or running_replicas(app) < 2:
        assert time.monotonic() < deadline, pids
        time.sleep(1)


def running_replicas(app: str) -> int:
    return httpx.get(f"{app}/health", timeout=60).json()["stages"]["diffusion"]["replicas"]["running"]
