"""The app end to end, shared by the modules of this package: started once, the way the README shows.

  "/"     both switches on, LLM 1 replica, diffusion 2 replicas (co-batching, reproduction, bad inputs,
          the openai client, both replicas serving identical bytes), and the video stage (the tiny Wan, 1 replica)
  "/off"  both switches off, the LLM scaled to zero (enhance_prompt=false only), a one-slot diffusion
          queue (seedless requests served with their seed returned; 503 + Retry-After when full), and the video
          stage with its switch off and no checkpoints (the controls of the videos' co-batching and replica kill)
  "/small" both switches on, limits so small that any valid request renders in about a second (the schema fuzzer
          draws requests at every bound), a short LLM context, and videos of one step; started by the first test that
          asks for it

Every app serves the embedded defaults: the trained shapes model and the trained rewriter (`stages.embedded`).
"""

import time

import httpx
import pytest

from contracts.cpu import cpu_isa, supported_isas

STEPS = 4
TIMEOUT_S = 180
#: The video stages' kernel path: avx512 where the CPU runs it, since there the tiny Wan's control varies (18 of 19
#: co-batched audit runs differ, kernels off); on avx2 it never varied, so the control test would only skip.
VIDEO_PATH = "avx512" if "avx512" in supported_isas() else cpu_isa()
#: A hundredth of a CPU each (a scheduling label: the video stages are idle but for the video tests): the package's
#: apps and a module's own (test_loras_http's two) must fit Ray's 2 CPUs together, and did with 0.04 to spare before.
VIDEO_ACTOR = {"num_cpus": 0.01, "runtime_env": {"env_vars": {"OMNISERVE_CPU_ISA": VIDEO_PATH}}}
MAIN = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.3}, "torch_threads": 1},
    "diffusion": {
        "batch_invariant": True,
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 0.3},
        "max_batch_size": 4,
        "batch_wait_timeout_s": 1.0,  # generous: concurrent requests must meet in one batch on a loaded box
        "defaults": {"num_inference_steps": STEPS},
    },
    # No rewrite cache: a repeated request must reach the LLM stage again, so that these tests keep proving the
    # stage's own invariance (the cache is tested in test_rewrite_cache.py).
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}, "rewrite_cache_entries": 0},
    # A checkpoint every 4 steps (the default, named for test_videos' replica kill): a lost replica's video goes on
    # from its last one.
    "video": {"batch_invariant": True, "ray_actor_options": VIDEO_ACTOR, "defaults": {"num_inference_steps": STEPS},
              "checkpoint_every": 4},
}
OFF = {
    "llm": {"batch_invariant": False, "ray_actor_options": {"num_cpus": 0.3},
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
    "diffusion": {"batch_invariant": False, "ray_actor_options": {"num_cpus": 0.3}, "max_batch_size": 1,
                  "max_queued": 1, "batch_wait_timeout_s": 0.0, "defaults": {"num_inference_steps": STEPS}},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}},
    # No checkpoints: the control of test_videos' replica kill (its video starts again from its first step).
    "video": {"batch_invariant": False, "ray_actor_options": VIDEO_ACTOR, "defaults": {"num_inference_steps": STEPS},
              "checkpoint_every": 0},
}


SMALL = {
    "llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.2},
            "torch_threads": 1, "max_model_len": 256},
    "diffusion": {
        "batch_invariant": True,
        "ray_actor_options": {"num_cpus": 0.2},
        "max_pixels": 64 * 64,
        "max_inference_steps": 8,
        "defaults": {"num_inference_steps": 2},
    },
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}},
    # The fuzzer's videos: one step, at most 9 frames (the tiny Wan's default) at 64x64; every job it creates is kept
    # (a full job table is a 503, which the fuzzer counts as a failure) and renders after its answer.
    "video": {"batch_invariant": True, "ray_actor_options": VIDEO_ACTOR, "max_pixels": 64 * 64,
              "max_inference_steps": 1, "max_frames": 9, "max_jobs": 256, "max_queued": 256,
              "defaults": {"num_inference_steps": 1}},
}


@pytest.fixture(scope="package")
def small_server(serve_instance):
    from ray import serve

    from orchestration import build_app

    serve.run(build_app(SMALL), name="small", route_prefix="/small")
    try:
        yield f"{serve_instance}/small"
    finally:
        serve.delete("small")


@pytest.fixture(scope="package")
def server(serve_instance):
    from ray import serve

    from orchestration import build_app

    started = time.monotonic()
    serve.run(build_app(OFF), name="off", route_prefix="/off")
    serve.run(build_app(MAIN), name="main", route_prefix="/")
    print(f"apps running after {time.monotonic() - started:.1f} s")
    try:
        yield serve_instance
    finally:
        serve.delete("main")
        serve.delete("off")


@pytest.fixture(scope="package")
def http(server):
    with httpx.Client(base_url=server, timeout=TIMEOUT_S) as client:
        yield client
