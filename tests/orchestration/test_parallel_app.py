"""The served app with a parallel group (`parallel: {cfg: 2}`, `{sp: 2}` and `{cfg: 2, sp: 2}` on the diffusion or
video stage) answers over HTTP with the bytes the one-worker app gives: SD3, FLUX and Qwen-Image images, the Wan video.

Each family's requests are sent together (so they co-batch: other prompts, seeds, step counts, guidance; FLUX and
Qwen-Image with true CFG and another size, so their calls are packed; a 48x48 one whose tokens do not split in two)
to an app whose stage renders on a grid, and one by one to the same app with one worker. The response names the grid
(`invariance.diffusion.parallel` for images; the video job's sha256 is of its MP4). Real Ray, Serve and HTTP on
loopback; the exact result cache is off (`result_cache_mib: 0`, the default), so every request renders. The controls
(switch off differs) are the stage-level tests' (tests/stages/test_parallel_group.py, test_sequence_parallel_group.py).
"""

import asyncio
import time

import httpx
import pytest

from stages.embedded import embedded_models
from tests.reliability import replicas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_, DIT, _, FLUX, QWEN = embedded_models("diffusion")
TIMEOUT_S = 240
STAGE = {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.2}, "self_audit": "off", "warm_up": False,
         "max_batch_size": 4, "batch_wait_timeout_s": 1.0}
#: A stage these tests never call: no replica until a request comes (none does).
UNCALLED = {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}}
APP = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.05}, **UNCALLED},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "request_timeout_s": TIMEOUT_S},
}
TRUE_CFG = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 3.0}
BODIES = [
    {"prompt": "a red fox in the snow", "seed": 42, "num_inference_steps": 3, "guidance_scale": 5.0},
    {"prompt": "a lighthouse at dusk", "seed": 7, "num_inference_steps": 2, "guidance_scale": 7.5},
    {"prompt": "a kite over the sea", "seed": 5, "num_inference_steps": 3, "size": "48x48"},  # 9 tokens: not split
]
OTHER_SIZE = {"prompt": "a bowl of ramen", "seed": 1234, "num_inference_steps": 2, "size": "64x32"}
FAMILIES = {DIT: ([], {}), FLUX: ([OTHER_SIZE], TRUE_CFG), QWEN: ([OTHER_SIZE], TRUE_CFG)}
GRIDS = [{"cfg": 2}, {"sp": 2}, {"cfg": 2, "sp": 2}]


def bodies(model: str) -> list[dict]:
    more, extra = FAMILIES[model]
    return [{"size": "64x64", "enhance_prompt": False, **extra, **body} for body in BODIES + more]


async def images(url: str, requests: list[dict], together: bool) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
        send = [client.post("/v1/images/generations", json=body) for body in requests]
        if together:
            return list(await asyncio.gather(*send))
        return [await one for one in send]


def rendered(url: str, requests: list[dict], together: bool) -> tuple[list[str], list]:
    """Each image's sha256 and the grid its response names; sent together, some met in one denoiser call."""
    answers = asyncio.run(images(url, requests, together))
    assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers if a.status_code != 200]
    payloads = [a.json() for a in answers]
    batches = [p["data"][0]["batch_size"] for p in payloads]
    assert max(batches) > 1 if together else max(batches) == 1, batches
    return [p["data"][0]["sha256"] for p in payloads], [p["invariance"]["diffusion"]["parallel"] for p in payloads]


def app(model: str, parallel: dict) -> dict:
    return {**APP, "diffusion": {**STAGE, "model": model, "parallel": parallel}}


@pytest.fixture(scope="module")
def one_worker(serve_instance):
    """Each family's requests rendered one by one on the one-worker app (computed once per family)."""
    solo: dict[str, list[str]] = {}

    def of(model: str) -> list[str]:
        if model not in solo:
            with replicas.deployed(serve_instance, "one-worker", app(model, {})) as url:
                solo[model], grids = rendered(url, bodies(model), together=False)
                assert grids == [None] * len(grids)  # one worker: no grid named
        return solo[model]

    return of


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(str(g.get(k, 1)) for k in ("cfg", "sp")))
@pytest.mark.parametrize("model", list(FAMILIES))
def test_images_on_a_grid_over_http_are_the_one_worker_apps_bytes(serve_instance, one_worker, model, grid):
    expected = one_worker(model)
    with replicas.deployed(serve_instance, "grid", app(model, grid)) as url:
        sha256, grids = rendered(url, bodies(model), together=True)
        group = httpx.get(f"{url}/health", timeout=60).json()["stages"]["diffusion"]["describe"]["details"]["parallel"]
    assert sha256 == expected
    assert grids == [{"cfg": grid.get("cfg", 1), "sp": grid.get("sp", 1)}] * len(grids)
    assert group["problem"] is None and all(w["rows"] > 0 for w in group["workers"]), group


VIDEOS = [
    {"prompt": "a red ball bouncing on a wooden floor", "seed": 7},
    {"prompt": "waves on a beach", "seed": 3, "num_inference_steps": 3},
    {"prompt": "a paper boat", "seed": 9, "size": "48x48"},  # 27 tokens over its 3 latent frames: not split
]


def videos(url: str, together: bool) -> list[str]:
    """Each video's sha256 (of its MP4): the jobs created together (co-batched) or each after the last finished."""
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:

        def create(body: dict) -> str:
            answer = http.post("/v1/videos", json={"size": "64x64", "enhance_prompt": False, **body})
            assert answer.status_code == 200, answer.text
            return answer.json()["id"]

        def finished(video_id: str) -> dict:
            deadline = time.monotonic() + TIMEOUT_S
            while (video := http.get(f"/v1/videos/{video_id}").json())["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline, video
                time.sleep(0.1)
            assert video["status"] == "completed", video
            return video

        if together:
            return [finished(i)["sha256"] for i in [create(body) for body in VIDEOS]]
        return [finished(create(body))["sha256"] for body in VIDEOS]


def test_videos_on_a_grid_over_http_are_the_one_worker_apps_bytes(serve_instance):
    video = {**STAGE, "defaults": {"num_inference_steps": 2}}
    # The image stage at no replicas (the videos never call it): four apps start no idle diffusion replica, each a
    # process importing torch and diffusers for nothing (about 7 s of CPU each on this 2-core box).
    images = {"diffusion": {**STAGE, **UNCALLED}}
    with replicas.deployed(serve_instance, "one-worker", {**APP, **images, "video": video}) as url:
        expected = videos(url, together=False)
    for grid in GRIDS:
        with replicas.deployed(serve_instance, "grid", {**APP, **images, "video": {**video, "parallel": grid}}) as url:
            assert videos(url, together=True) == expected, grid
