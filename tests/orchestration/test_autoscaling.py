"""Autoscaling the diffusion stage under a stepped load: the replica count rises and falls, no request is lost, every
response's bytes are the reference run's, and every image is verified (a new replica renders the golden requests in
its constructor, so it is verified, or says why not, before Serve routes it anything).

An app of its own ("/autoscale": its LLM scaled to zero, the requests skip the rewrite) with Serve's
`autoscaling_config` on the diffusion stage, min 1, max 3, two ongoing requests per replica as the target. The load
steps 1 -> 12 -> 3 -> 0 concurrent clients (wanted replicas: 1, 3, 2, 1), each client sending the same 12 requests
round after round; the reference is those 12 sent one at a time to the single replica first. Scale-down starts while
the load still runs (the 3-client step): a replica that Serve stops finishes what it holds (its graceful shutdown), and anything cut would be retried
by the ingress on another replica with the same bytes (orchestration/retries.py)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.scope_facts import record_gap

from .conftest import TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "autoscale"
CONFIG = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.05},
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
    "diffusion": {
        "batch_invariant": True,
        "ray_actor_options": {"num_cpus": 0.1},
        "max_batch_size": 4,
        "autoscaling_config": {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 3,
                               "target_ongoing_requests": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2,
                               "upscale_delay_s": 1, "downscale_delay_s": 4},
    },
    "ingress": {"ray_actor_options": {"num_cpus": 0.02}},
}
# Long enough that 12 clients keep the replicas busy (measured: at 4 steps each request ended so fast that the
# ongoing count stayed under the target and nothing scaled); 64x64, the audited size, so each image is verifiable.
BODIES = [{"prompt": f"a {colour} {shape} on a black background", "seed": 40 + i, "size": "64x64",
           "num_inference_steps": 40, "enhance_prompt": False}
          for i, (colour, shape) in enumerate((c, s) for c in ("red", "green", "yellow", "white")
                                               for s in ("circle", "square", "star"))]


@pytest.fixture(scope="module")
def autoscaled(serve_instance):
    from ray import serve

    from orchestration import build_app

    serve.run(build_app(CONFIG), name=NAME, route_prefix=f"/{NAME}")
    try:
        yield f"{serve_instance}/{NAME}"
    finally:
        serve.delete(NAME)


def diffusion_replicas() -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    deployment = serve.status().applications[NAME].deployments["DiffusionStage"]
    return deployment.replica_states.get(ReplicaState.RUNNING, 0)


def render(base: str, body: dict) -> dict:
    """The image, with its diffusion stage's verdict (`verified`: its replica's scope covered it)."""
    response = httpx.post(f"{base}/v1/images/generations", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return {**response.json()["data"][0], "verified": response.json()["invariance"]["diffusion"]["verified"]}


def load(base: str, clients: int, seconds: float) -> list[tuple[int, dict]]:
    """`clients` threads, each sending BODIES round after round for `seconds`: (body index, image) per response."""
    deadline, answers = time.monotonic() + seconds, []

    def client(offset: int) -> None:
        i = offset
        while time.monotonic() < deadline:
            answers.append((i % len(BODIES), render(base, BODIES[i % len(BODIES)])))
            i += 1

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client, k) for k in range(clients)]:
            future.result()
    return answers


def test_a_stepped_load_scales_the_diffusion_stage_up_and_down_losing_nothing_and_changing_no_byte(autoscaled):
    reference = [render(autoscaled, body) for body in BODIES]  # one at a time, the single replica
    assert diffusion_replicas() == 1
    counts, sampling = [], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            counts.append(diffusion_replicas())
            time.sleep(0.5)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers = load(autoscaled, 12, 25) + load(autoscaled, 3, 15)
        deadline = time.monotonic() + 120
        while (final := diffusion_replicas()) > 1 and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        sampling.set()
        sampler.join()
    peak = max(counts)
    assert peak >= 2 and final == 1, (counts, final)  # rose under 12 clients, back to the minimum after
    changed = [(BODIES[i]["seed"], image["replica"]) for i, image in answers
               if image["sha256"] != reference[i]["sha256"]]
    assert not changed, changed
    replicas = {image["replica"] for _, image in answers}
    assert len(replicas) >= 2, replicas  # the new replicas served
    if gap := record_gap("diffusion"):
        pytest.skip(f"every byte equal over {len(answers)} responses on up to {peak} replicas; verification: {gap}")
    assert all(image["verified"] for image in reference + [image for _, image in answers]), "an unverified image"
    print(f"{len(answers)} responses, replicas over time {counts}")
