"""A worker of a diffusion replica's parallel group (`parallel: {cfg: 2}` on the default UNet, `{sp: 2}` on the tiny
SD3 DiT) killed (SIGKILL) under load: no request is lost, every image keeps its bytes, and no process of the broken
group is left.

The replica's calls that needed the dead worker fail with its ActorDiedError (under sequence parallelism the
replica's own collective fails first, at once, and the worker's error is the one raised), an infrastructure failure
the ingress sends again (orchestration.retries); the replica's health check finds its group broken and Serve replaces
the replica, which starts a new group; the old group's worker ends with its owner. Real Ray, Serve and HTTP on
loopback.
"""

import asyncio
import os
import signal
import time

import httpx
import pytest

from stages.embedded import embedded_models
from tests.reliability import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REQUESTS, CONCURRENCY, KILL_AFTER_DONE = 32, 8, 8
APP = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.1},
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
    "diffusion": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.3}, "self_audit": "off", "defaults": {"num_inference_steps": 2},
                  "health_check_period_s": 1, "health_check_timeout_s": 10},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "request_timeout_s": 240},
}


#: Each group's app: its name and the diffusion section's model and degrees.
GROUPS = {
    "group-faults-cfg": {"parallel": {"cfg": 2}},
    "group-faults-sp": {"model": embedded_models("diffusion")[1], "parallel": {"sp": 2}},  # the tiny SD3 DiT
}


@pytest.fixture(scope="module", params=list(GROUPS))
def app(serve_instance, request):
    config = {**APP, "diffusion": {**APP["diffusion"], **GROUPS[request.param]}}
    with replicas.deployed(serve_instance, request.param, config) as url:
        yield url, request.param


def body(i: int) -> dict:
    return {"prompt": f"request {i}", "seed": i, "size": "64x64", "enhance_prompt": False}


def group(name: str) -> dict:
    from ray import serve

    handle = serve.get_deployment_handle("DiffusionStage", app_name=name)
    return handle.describe.remote().result(timeout_s=60).details


def worker_pids() -> set[int]:
    """Every live group worker in this Ray instance, from Ray's actor table (not from the replicas' own word)."""
    return replicas.actor_pids("DenoiserWorker")


def kill_the_worker_when_busy(name: str, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        details = group(name)
        if details["batching"]["in_flight"] > 0:
            pid = details["parallel"]["workers"][1]["pid"]
            os.kill(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"the replica reported no call in flight within {timeout_s:.0f} s of the load")


def test_a_group_worker_killed_under_load_loses_no_request_changes_no_byte_and_leaves_no_orphan(app):
    app, name = app
    reference = asyncio.run(replicas.image_load(app, body, REQUESTS, CONCURRENCY))
    assert all(r.status_code == 200 for r in reference), [r.text for r in reference if r.status_code != 200][:3]
    expected = [r.json()["data"][0]["sha256"] for r in reference]
    for run in range(1, replicas.runs() + 1):
        before = group(name)
        replica, old_worker = (w["pid"] for w in before["parallel"]["workers"])
        retried_before = httpx.get(f"{app}/health", timeout=60).json()["ingress"]["retried_calls"]
        killed: list[int] = []
        started = time.monotonic()
        under_fault = asyncio.run(replicas.image_load(
            app, body, REQUESTS, CONCURRENCY, after=KILL_AFTER_DONE, during=lambda: killed.append(kill_the_worker_when_busy(name)),  # noqa: B023
        ))
        assert killed == [old_worker]
        failed = [(i, r.status_code, r.text[:200]) for i, r in enumerate(under_fault) if r.status_code != 200]
        assert not failed, (run, failed)
        assert [r.json()["data"][0]["sha256"] for r in under_fault] == expected, run
        assert all(r.json()["data"][0].get("cache") is None for r in under_fault)  # every request rendered
        retried = httpx.get(f"{app}/health", timeout=60).json()["ingress"]["retried_calls"] - retried_before
        assert retried > 0, f"run {run}: no call was retried: the worker died after the load"
        after = group(name)
        workers = [w["pid"] for w in after["parallel"]["workers"]]
        assert after["parallel"]["problem"] is None and replica not in workers and old_worker not in workers
        # No orphan: the live group workers are exactly the new replica's (the old replica's ended with it).
        deadline = time.monotonic() + 60
        while worker_pids() != set(workers[1:]):
            assert time.monotonic() < deadline, (worker_pids(), workers)
            time.sleep(1)
        assert replica not in replicas.replica_pids(name, "DiffusionStage")
        shown = httpx.get(f"{app}/health", timeout=60).json()["stages"]["diffusion"]["describe"]["details"]["parallel"]
        assert shown["cfg"] * shown["sp"] == 2 == len(shown["workers"]) and shown["problem"] is None  # /health shows the group
        print(f"\nrun {run}: group worker {old_worker} SIGKILLed under load: {REQUESTS} of {REQUESTS} 200 and identical, "
              f"{retried} calls retried, a new group {workers} in place, load {time.monotonic() - started:.1f} s")
