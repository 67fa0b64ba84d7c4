"""A diffusion replica of two workers (`parallel: {cfg: 2}`, stages.diffusion.group) gives the bytes one worker gives.

Every served image family and the video family, each request co-batched with unlike neighbours (other prompts, seeds,
step counts, guidance, and for the families that pack sizes another size) on the two-worker replica, against the same
request rendered alone by a one-worker replica, kernels on. The control: the same two deployments with the switch
off, where the rows a worker computes in one call change with the split, differ. Degrees a model cannot take refuse the
replica's start, naming the field. Real Ray and Serve; each worker is its own process (asserted by pid), and each
predicted rows (asserted by its count).
"""

import time

import pytest
from ray import serve

from contracts.config import DiffusionStageConfig, VideoStageConfig
from contracts.jobs import RenderJob
from contracts.sampling import DiffusionSamplingParams
from stages.diffusion import DiffusionStage
from stages.diffusion.video_stage import VideoStage
from stages.embedded import embedded_models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

UNET, DIT, SDXL, FLUX, QWEN = embedded_models("diffusion")
WAN = "omniserve/tiny-wan-video"
TRUE_CFG = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 3.0}
#: The target and its unlike neighbours; the packing families (FLUX, Qwen-Image) also get a neighbour of another size.
REQUESTS = [
    ("a red fox in the snow", 42, {"num_inference_steps": 3, "guidance_scale": 5.0}),
    ("a lighthouse at dusk", 7, {"num_inference_steps": 2, "guidance_scale": 7.5}),
    ("two cats asleep on a windowsill", 99, {"num_inference_steps": 3, "guidance_scale": 3.0}),
]
OTHER_SIZE = ("a bowl of ramen", 1234, {"num_inference_steps": 2, "height": 32, "width": 64})
FAMILIES = {
    UNET: ({}, False),
    DIT: ({}, False),
    FLUX: (TRUE_CFG, True),
    QWEN: (TRUE_CFG, True),
    WAN: ({}, False),
}


def deploy(name: str, model: str | None, cfg: int, batch_invariant: bool = True, sp: int = 1):
    stage, config_type = (VideoStage, VideoStageConfig) if model == WAN else (DiffusionStage, DiffusionStageConfig)
    config = config_type(
        model=model, batch_invariant=batch_invariant, torch_threads=1, ray_actor_options={"num_cpus": 0.2},
        max_batch_size=4, batch_wait_timeout_s=1.0, parallel={"cfg": cfg, "sp": sp}, warm_up=False, self_audit="off",
    )
    return serve.run(stage.options(name=name, **config.deployment_options()).bind(config), name=name, route_prefix=None)


def jobs(model: str) -> list[RenderJob]:
    extra, packs_sizes = FAMILIES[model]
    requests = REQUESTS + ([OTHER_SIZE] if packs_sizes else [])
    size = {"height": 64, "width": 64}
    return [
        RenderJob(prompt=p, params=DiffusionSamplingParams(seed=s, **{**size, **extra, **fields}))
        for p, s, fields in requests
    ]


def rendered(handle, job_list: list[RenderJob], together: bool) -> list:
    """Each job's final item (its RenderedImage or RenderedVideo): sent together (co-batched) or one by one."""
    if together:
        streams = [handle.options(stream=True).render.remote(job) for job in job_list]
        return [list(stream)[-1] for stream in streams]
    return [list(handle.options(stream=True).render.remote(job))[-1] for job in job_list]


#: Each model's one-worker renders, by (model, switch, requests): a reference shared by the grids that render them.
SOLO: dict[tuple, list] = {}


def solo_and_grouped(model: str, batch_invariant: bool, cfg: int = 2, sp: int = 1, job_list: list | None = None):
    name, job_list = f"{model.rsplit('/', 1)[-1]}-{'on' if batch_invariant else 'off'}", job_list or jobs(model)
    key = (model, batch_invariant, tuple(job.model_dump_json() for job in job_list))
    if key not in SOLO:
        try:
            SOLO[key] = rendered(deploy(f"{name}-1", model, 1, batch_invariant), job_list, together=False)
        finally:
            serve.delete(f"{name}-1")
    solo = SOLO[key]
    try:
        handle = deploy(f"{name}-{cfg}x{sp}", model, cfg, batch_invariant, sp)
        grouped = rendered(handle, job_list, together=True)
        group = handle.describe.remote().result(timeout_s=60).details["parallel"]
    finally:
        serve.delete(f"{name}-{cfg}x{sp}")
    return solo, grouped, group


@pytest.mark.parametrize("model", list(FAMILIES))
def test_two_workers_cobatched_give_one_workers_solo_bytes(serve_instance, model):
    solo, grouped, group = solo_and_grouped(model, batch_invariant=True)
    assert [r.sha256 for r in grouped] == [r.sha256 for r in solo]
    assert max(r.batch_size for r in grouped) > 1  # they did meet in one call
    workers = group["workers"]
    assert group["cfg"] == 2 and group["problem"] is None and len(workers) == 2
    assert len({w["pid"] for w in workers}) == 2, workers  # two processes
    assert all(w["rows"] > 0 and w["kernels_installed"] for w in workers), workers  # both predicted, with the kernels


def test_control_switch_off_the_two_workers_bytes_differ(serve_instance):
    """With stock kernels a row's bits follow the rows beside it in its call, which co-batching and the split both
    change: the check above can fail. (The tiny SD3 DiT's co-batched control differs on the avx2 path too:
    test_diffusion_stage.)"""
    solo, grouped, _ = solo_and_grouped(DIT, batch_invariant=False)
    differing = [i for i, (a, b) in enumerate(zip(solo, grouped, strict=True)) if a.sha256 != b.sha256]
    assert differing, "stock kernels gave the one worker's bytes for every request: the check could not fail here"


def test_lora_rows_cobatched_on_two_workers_give_one_workers_solo_bytes(serve_instance):
    """The embedded default's own adapter ("twins") at two scales, co-batched with a request without it: each row's
    adapters travel with its rows to the worker that predicts them."""
    from contracts.sampling import LoraChoice

    size = {"height": 64, "width": 64, "num_inference_steps": 3}
    lora_jobs = [
        RenderJob(prompt=p, params=DiffusionSamplingParams(seed=s, **size, lora=lora))
        for p, s, lora in [
            ("a red circle on a blue background", 7, [LoraChoice(name="twins", scale=1.0)]),
            ("a yellow square on a black background", 3, None),
            ("a small green star on a white background", 11, [LoraChoice(name="twins", scale=0.5)]),
            ("a red circle on a blue background", 7, None),  # the first without its adapter
        ]
    ]
    try:
        solo = rendered(deploy("lora-1", None, 1), lora_jobs, together=False)
    finally:
        serve.delete("lora-1")
    try:
        handle = deploy("lora-2", None, 2)
        grouped = rendered(handle, lora_jobs, together=True)
        workers = handle.describe.remote().result(timeout_s=60).details["parallel"]["workers"]
    finally:
        serve.delete("lora-2")
    assert [r.sha256 for r in grouped] == [r.sha256 for r in solo]
    assert max(r.batch_size for r in grouped) > 1 and all(w["rows"] > 0 for w in workers)
    assert solo[0].sha256 != solo[3].sha256  # the adapter changed the image: it was applied


def test_a_worker_busy_predicting_answers_its_health_check(serve_instance):
    """The group's health check (`member` in the HEALTH concurrency group) is answered while a prediction runs, not
    after it: with real models a prediction can outlast the ping's timeout."""
    import ray
    import torch

    from stages.diffusion.group import HEALTH, remote_worker

    config = DiffusionStageConfig(model=DIT, batch_invariant=True, torch_threads=1, parallel={"cfg": 2}, self_audit="off")
    worker = remote_worker().options(num_cpus=0.2).remote(config, 1, None)
    try:
        ray.get(worker.member.options(concurrency_group=HEALTH).remote(), timeout=120)  # loaded
        rows = 16  # 16 rows of 512x512 latents (1,024 tokens each): a prediction of a second or more here
        inputs = {
            "hidden_states": torch.randn(rows, 16, 64, 64), "timestep": torch.full((rows,), 500.0),
            "encoder_hidden_states": torch.randn(rows, 77, 64), "pooled_projections": torch.randn(rows, 64),
        }
        predicting = worker.predict.remote(inputs, [[] for _ in range(rows)], False)
        time.sleep(0.2)  # the prediction has started
        asked = time.monotonic()
        answer = ray.get(worker.member.options(concurrency_group=HEALTH).remote(), timeout=60)
        answered_s = time.monotonic() - asked
        done, _ = ray.wait([predicting], timeout=0)
        assert not done, "the health check was answered only after the prediction (or it ended too soon to tell)"
        assert answer.rows == 0 and answered_s < 1.0, answered_s  # answered mid-prediction, promptly
        assert ray.get(predicting, timeout=300).shape[0] == rows
    finally:
        ray.kill(worker)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"parallel": {"sp": 2}}, "parallel.sp"),  # the default model is a UNet: no sequence parallelism
        ({"model": FLUX, "parallel": {"sp": 4}}, "parallel.sp"),  # the tiny FLUX's 2 heads do not split in 4
        ({"model": DIT, "parallel": {"sp": 3}}, "parallel.sp"),  # the tiny DiT's 4 heads do not split in 3
        ({"model": DIT, "parallel": {"sp": 2}, "batching": "request"}, "parallel.sp"),
        ({"parallel": {"cfg": 2}, "batching": "request"}, "parallel.cfg"),
    ],
)
def test_a_degree_the_replica_cannot_take_refuses_its_start_naming_the_field(fields, named):
    config = DiffusionStageConfig(batch_invariant=True, warm_up=False, self_audit="off", **fields)
    with pytest.raises(ValueError, match=named):
        DiffusionStage.func_or_class(config)


def test_the_group_is_placed_whole_one_bundle_per_worker():
    options = DiffusionStageConfig(ray_actor_options={"num_cpus": 0.5}, parallel={"cfg": 2}).deployment_options()
    assert options["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in DiffusionStageConfig().deployment_options()
