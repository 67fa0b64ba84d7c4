"""The LLM stage under faults: a replica SIGKILLed under load, and vLLM's engine core dying inside a replica.

One app of this module's own (2 LLM replicas, 1 diffusion replica, both switches on, 1 s health checks) and one
set of requests, half chats and half enhanced images (both stages), sent at CONCURRENCY. Their responses before
any fault are the reference: a request's bytes are a pure function of its params and seed, so a call the ingress
sends again to the other replica (orchestration.retries) must return exactly them. Real Ray, Serve, vLLM and
diffusers over loopback HTTP; processes are killed by their own pid (the replica's from describe().details, the
engine core's among that replica's child processes). The measured times are printed (run with -s to see them).
"""

import asyncio
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.reliability import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "llm-faults"
# The fault comes once FAULT_AFTER responses are in, with CONCURRENCY calls in flight and most of the load to come
# (160 before: fewer keep the fault amid the load, at less of the suite's time).
REQUESTS, CONCURRENCY, FAULT_AFTER = 96, 12, 24
HEALTH_CHECK = {"health_check_period_s": 1, "health_check_timeout_s": 10}
APP = {
    "llm": {"batch_invariant": True, "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.3}, "torch_threads": 1,
            **HEALTH_CHECK},
    "diffusion": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.3}, "defaults": {"num_inference_steps": 2},
                  **HEALTH_CHECK},
    # No rewrite cache: the second pass repeats the reference's requests, and a cached rewrite never reaches the
    # LLM stage, so the fault would meet fewer calls in flight than the load sends.
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "request_timeout_s": 120, "rewrite_cache_entries": 0},
}


@pytest.fixture(scope="module")
def app(serve_instance):
    with replicas.deployed(serve_instance, NAME, APP) as url:
        yield url


def request(i: int) -> tuple[str, dict]:
    if i % 2:
        return "/v1/images/generations", {"prompt": f"a lighthouse, take {i}", "seed": i, "size": "64x64"}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"a fox, take {i}"}], "max_tokens": 8, "seed": i}


def fingerprint(response: httpx.Response) -> tuple:
    """What must not change: the chat's tokens and text; the image's bytes (sha256) and its revised prompt."""
    body = response.json()
    if "choices" in body:
        return body["choices"][0]["message"]["content"], tuple(body["token_ids"])
    return body["data"][0]["sha256"], body["data"][0]["revised_prompt"]


async def load(url: str, fault=None) -> list[httpx.Response]:
    """Every request at CONCURRENCY; `fault()` runs (in a thread) once FAULT_AFTER responses are in."""
    gate, enough, finished = asyncio.Semaphore(CONCURRENCY), asyncio.Event(), [0]
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:

        async def one(i):
            path, body = request(i)
            async with gate:
                response = await client.post(path, json=body)
            finished[0] += 1
            if finished[0] == FAULT_AFTER:
                enough.set()
            return response

        tasks = [asyncio.ensure_future(one(i)) for i in range(REQUESTS)]
        if fault is not None:
            await enough.wait()
            await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def replica_pids() -> set[int]:
    return replicas.replica_pids(NAME, "LLMStage")


def engine_core(replica_pid: int, timeout_s: float = 60) -> psutil.Process:
    """vLLM's engine core: the replica's child process titled VLLM::EngineCore. Its title can lag its start on a
    loaded box (seen under a parallel suite: a healthy replica whose core still read `spawn_main`), so wait for it,
    bounded; then the replica's one spawned child is the core (the other child is multiprocessing's tracker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        children = psutil.Process(replica_pid).children(recursive=True)
        cores = [c for c in children if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]
        if len(cores) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if len(cores) != 1:
        cores = [c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())]
    assert len(cores) == 1, [(c.pid, c.name(), c.cmdline()) for c in children]
    return cores[0]


def health(url: str) -> tuple[int, dict]:
    response = httpx.get(f"{url}/health", timeout=60)
    return response.status_code, response.json()


def wait_until(what: str, condition, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not {what} after {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - started


def healthy_with_two_llm_replicas(url: str, avoid: int | None = None) -> bool:
    code, body = health(url)
    llm = body["stages"]["llm"]
    return code == 200 and body["status"] == "ok" and llm["replicas"]["running"] == 2 and (
        avoid is None or avoid not in replica_pids())


@pytest.fixture(scope="module")
def reference(app) -> list[tuple]:
    responses = asyncio.run(load(app))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:3]
    return [fingerprint(r) for r in responses]


def test_killing_one_of_two_llm_replicas_under_load_loses_no_request_and_changes_no_byte(app, reference):
    for run in range(1, replicas.runs() + 1):  # each run kills a replica; the next waits for its replacement
        wait_until("two LLM replicas", lambda: healthy_with_two_llm_replicas(app), 180)
        pids = replica_pids()
        assert len(pids) == 2, pids
        children = {pid: psutil.Process(pid).children(recursive=True) for pid in pids}
        retried_before, killed = health(app)[1]["ingress"]["retried_calls"], []
        under_fault = asyncio.run(
            load(app, fault=lambda: killed.append(replicas.kill_when_busy(NAME, "LLMStage", pids)))  # noqa: B023
        )
        ((victim, killed_at),) = killed
        (survivor,) = pids - {victim}
        failed = [(i, r.status_code, r.text[:200]) for i, r in enumerate(under_fault) if r.status_code != 200]
        assert not failed, (run, failed)
        assert [fingerprint(r) for r in under_fault] == reference, run
        retried = health(app)[1]["ingress"]["retried_calls"] - retried_before
        assert retried > 0, f"run {run}: no call was retried: the replica died after the load"
        load_done = time.monotonic() - killed_at
        wait_until("two LLM replicas again", lambda: healthy_with_two_llm_replicas(app, avoid=victim), 180)  # noqa: B023
        assert survivor in replica_pids()  # the replica was replaced; the app was not restarted
        left = [p.pid for p in children[victim] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for pid in left:  # what the killed replica started and left behind: reported, then stopped by pid
            os.kill(pid, signal.SIGKILL)
        print(f"\nrun {run}: LLM replica {victim} SIGKILLed under load: {REQUESTS} of {REQUESTS} requests 200 and "
              f"identical, {retried} calls retried; load done {load_done:.1f} s after the kill; healthy with two "
              f"replicas {time.monotonic() - killed_at:.1f} s after the kill; its child processes left: {left}")


def test_engine_core_death_inside_an_llm_replica_is_reported_retried_and_repaired(app, reference):
    wait_until("healthy", lambda: healthy_with_two_llm_replicas(app), 180)
    victim, survivor = sorted(replica_pids())
    core = engine_core(victim)
    retried_before = health(app)[1]["ingress"]["retried_calls"]
    timeline: list[tuple] = []  # (s after the kill, HTTP status, app status, llm state, llm reasons)
    killed_at, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if killed_at:
                code, body = health(app)
                llm = body["stages"]["llm"]
                timeline.append((round(time.monotonic() - killed_at[0], 1), code, body["status"], llm["state"], llm["reasons"]))
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        during = asyncio.run(load(app, fault=lambda: (core.kill(), killed_at.append(time.monotonic()))))
        wait_until("repaired", lambda: healthy_with_two_llm_replicas(app, avoid=victim), 180)
        repaired = time.monotonic() - killed_at[0]
    finally:
        stop.set()
        watcher.join(60)
    statuses = [r.status_code for r in during]
    degraded = next((t for t, _, _, state, _ in timeline if state != "running"), None)
    changes = [entry for i, entry in enumerate(timeline) if i == 0 or entry[1:4] != timeline[i - 1][1:4]]
    print(f"\nengine core {core.pid} of LLM replica {victim} killed under load: /health said llm not running after "
          f"{degraded} s; requests {statuses.count(200)} x 200, {statuses.count(503)} x 503; healthy with two replicas "
          f"{repaired:.1f} s after the kill. /health over time:", *changes, sep="\n  ")
    assert set(statuses) <= {200, 503}, [(r.status_code, r.text[:200]) for r in during if r.status_code not in (200, 503)]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in during if r.status_code == 503)
    assert all(fingerprint(r) == ref for r, ref in zip(during, reference) if r.status_code == 200)
    assert degraded is not None and degraded <= 15, timeline
    assert survivor in replica_pids() and health(app)[1]["ingress"]["retried_calls"] > retried_before
    # 200 while the stage still serves (degraded), 503 only when one is down: HealthResponse.http_status.
    assert all(code == (503 if status == "down" else 200) for _, code, status, _, _ in timeline), changes
