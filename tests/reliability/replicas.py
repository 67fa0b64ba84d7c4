"""Which processes serve a deployment, read from Ray's own actor table.

Not by calling the replicas: sampling `describe` through a handle sees only the replicas its router picks (seen: right
after a repair, twelve calls all went to the new replica, so the survivor looked replaced), and a busy or starting
replica answers late. The table in Ray's control store lists every live replica actor with its pid. (Ray's public
state API reads it through the dashboard, which the tests' instances do not start, so this reads it directly.)
"""

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from ray._private import state


@contextmanager
def deployed(serve_url: str, name: str, config: dict) -> Iterator[str]:
    """The app built from `config`, running as `name` under `/name` for the block (its URL), deleted after it."""
    from ray import serve

    from orchestration import build_app

    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    try:
        yield f"{serve_url}/{name}"
    finally:
        serve.delete(name)


def actor_pids(class_name: str) -> set[int]:
    """The pids of the live actors of `class_name` in this Ray instance (starting ones included: their actor is up)."""
    alive = state.actors(actor_state_name="ALIVE").values()
    return {actor["Pid"] for actor in alive if actor["ActorClassName"] == class_name}


def replica_pids(app_name: str, deployment: str) -> set[int]:
    """The pids of the deployment's live replica actors."""
    return actor_pids(f"ServeReplica:{app_name}:{deployment}")  # ray.serve._private.common.DeploymentID


def runs() -> int:
    """How many times a fault test repeats its fault on one app: OMNISERVE_FAULT_RUNS (default 1; docs/reliability.md's
    loops set 20), each run on a fresh victim once the last one was replaced."""
    return int(os.environ.get("OMNISERVE_FAULT_RUNS", "1"))


def kill_when_busy(app_name: str, deployment: str, candidates: set[int], timeout_s: float = 30) -> tuple[int, float]:
    """SIGKILL the first of `candidates` (replica pids) that reports calls in flight; its pid and the monotonic time
    of the kill. Whichever replica answers busy is the victim: asked through a handle, whose router sends each call to
    the less loaded replica, so a victim chosen beforehand can go unheard while it is the busier one (seen in the
    suite: the chosen diffusion replica never answered within 30 s, it was killed after the load and nothing was
    retried). None answering busy within `timeout_s` fails here: a kill of an idle replica would prove nothing."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        details = handle.describe.remote().result(timeout_s=60).details
        in_flight = details["in_flight"] if "in_flight" in details else details["batching"]["in_flight"]  # LLM, diffusion
        if details["pid"] in candidates and in_flight > 0:
            os.kill(details["pid"], signal.SIGKILL)
            return details["pid"], time.monotonic()
    raise AssertionError(f"no replica of {deployment} among {sorted(candidates)} reported a call in flight within "
                         f"{timeout_s:.0f} s of the load")


async def image_load(
    url: str, body: Callable[[int], dict], requests: int, concurrency: int, *, after: int = 0, during=None
) -> list[httpx.Response]:
    """`requests` image requests (`body(i)`) at `concurrency`; `during()` runs (in a thread, the load going on) once
    `after` of them have answered.

    Counted, not timed: on a fast machine the whole load can finish within any fixed delay, and the fault then
    proves nothing. After `after` answers, `concurrency` requests are in flight (asserted)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(i):
            async with gate:
                return await client.post("/v1/images/generations", json=body(i))

        tasks = [asyncio.ensure_future(one(i)) for i in range(requests)]
        if during is not None:
            answered = asyncio.as_completed(tasks)
            for _ in range(after):
                await next(answered)
            pending = sum(not t.done() for t in tasks)
            assert pending >= concurrency, f"only {pending} requests left when the fault was to come"
            await asyncio.to_thread(during)
        return await asyncio.gather(*tasks)
