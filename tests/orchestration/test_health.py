"""Fail closed and tell the truth: start-up refusals, replica health checks, and what /health decides and shows.

The state rules (`orchestration.health.judge`) are pure functions of Serve's replica counts and a replica's real
`StageDescription`; the descriptions come from real stages (an LLM engine built but not started, a diffusion stage
on its tiny pipeline). The refusal runs without a C++ compiler, the way tests/stages/test_kernels.py makes one: in
a fresh interpreter, and in a real app whose /health must then say why. The only stand-in: to hold a real compute
thread inside one step long enough to call it stuck, the family's denoiser (or the renderer) waits on an Event.
/health of a whole healthy app is in tests/orchestration/test_app_e2e.py; of an app losing an LLM replica or its
engine core, in tests/reliability/test_llm_faults.py.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from contracts.config import DiffusionStageConfig, LLMStageConfig
from contracts.invariance import Switches
from contracts.results import StageDescription
from orchestration.health import HealthResponse, judge, redact, stage_health, wanted_replicas

TWO_RUNNING = {"configured": 2, "running": 2, "status": "HEALTHY"}


def described(stage="llm", *, replica="r1", running=True, batch_invariant=True, kernels_installed=True, **details,
              ) -> StageDescription:
    return StageDescription(stage=stage, model="m", replica=replica, batch_invariant=batch_invariant, kernel_backend="cpu",
                            kernels={}, kernels_installed=kernels_installed, running=running, details=details)


# --- the state rules -----------------------------------------------------------------------------------


def test_a_stage_with_every_replica_running_and_no_fault_is_running():
    assert judge(True, 2, TWO_RUNNING, [described()]) == ("running", [])


@pytest.mark.parametrize("fault,words", [
    ({"running": False, "problem": "the compute thread is gone"}, "engine is not running (the compute thread is gone)"),
    ({"kernels_installed": False}, "kernels are not installed"),
    ({"batch_invariant": False}, "runs with batch_invariant=False, the app gave it True"),
])
def test_a_replica_fault_degrades_a_stage_that_still_has_another_replica_and_downs_one_without(fault, words):
    problem = fault.pop("problem", None)
    answer = described(**fault, **({"problem": problem} if problem else {}))
    state, reasons = judge(True, 2, TWO_RUNNING, [answer])
    assert state == "degraded" and any(words in r for r in reasons), reasons
    state, reasons = judge(True, 1, {"configured": 1, "running": 1}, [answer])
    assert state == "down" and any(words in r for r in reasons), reasons


def test_every_replica_that_answered_counts_and_a_stage_whose_running_replicas_all_have_faults_is_down():
    dead, alive = described(replica="r1", running=False), described(replica="r2")
    state, reasons = judge(True, 2, TWO_RUNNING, [alive, dead])
    assert state == "degraded" and reasons == ["replica r1: its engine is not running"]
    assert judge(True, 2, TWO_RUNNING, [dead, described(replica="r2", kernels_installed=False)])[0] == "down"


def test_kernels_missing_is_no_fault_when_the_switch_is_off():
    assert judge(False, 1, {"running": 1}, [described(batch_invariant=False, kernels_installed=False)]) == ("running", [])


def test_fewer_replicas_running_than_configured_is_degraded_with_serves_message():
    replicas = {"configured": 2, "running": 1, "status": "UNHEALTHY", "message": "replica failed its health check"}
    state, reasons = judge(True, 2, replicas, [described()])
    assert state == "degraded" and reasons == ["1 of 2 replicas running (UNHEALTHY: replica failed its health check)"]


def test_no_replica_running_is_down_and_says_why_without_asking_one():
    replicas = {"configured": 1, "running": 0, "status": "DEPLOY_FAILED",
                "message": "RuntimeError: diffusion batch invariance is on but its kernels are not installed"}
    state, reasons = judge(True, 1, replicas, None)
    assert state == "down" and "kernels are not installed" in reasons[0] and "DEPLOY_FAILED" in reasons[0]


def test_a_stage_scaled_to_zero_by_its_autoscaling_config_is_running():
    config = LLMStageConfig(autoscaling_config={"min_replicas": 0, "max_replicas": 1})
    state, reasons = judge(True, wanted_replicas(config), {"running": 0}, None)
    assert state == "running" and "scaled to zero" in reasons[0]
    assert wanted_replicas(LLMStageConfig(num_replicas=3)) == 3 and wanted_replicas(LLMStageConfig()) == 1


def test_no_answer_from_describe_is_degraded_while_serve_runs_replicas_and_down_when_nothing_is_known():
    assert judge(True, 2, TWO_RUNNING, TimeoutError())[0] == "degraded"
    assert judge(True, 1, {"status_error": "RayServeException"}, TimeoutError())[0] == "down"


def test_health_answers_503_only_when_a_stage_is_down():
    def response(status):
        return HealthResponse(status=status, batch_invariant=Switches(llm=True, diffusion=True), stages={}, ingress={})

    assert [response(s).http_status for s in ("ok", "degraded", "down")] == [200, 200, 503]


# --- what /health shows: no absolute path, no engine argument ------------------------------------------


def assert_public(shown: dict) -> None:
    text = json.dumps(shown)
    for secret in ('"model_path"', '"engine_args"', '"environment"', '"invariance"', "OMNISERVE_CACHE", "VLLM_PLUGINS"):
        assert secret not in text, (secret, text)
    assert redact(text) == text, text  # no absolute path left anywhere


def test_health_shows_an_llm_replica_without_its_model_path_engine_arguments_or_spawn_environment():
    from stages.llm.engine import LLMEngine

    engine = LLMEngine(LLMStageConfig(batch_invariant=True, engine_args={"max_logprobs": 7}))  # built, not started
    info = engine.describe()
    assert info.details["model_path"].startswith("/") and info.details["engine_args"]["max_logprobs"] == 7
    assert info.details["pid"] > 0 and info.kernels_installed is False and info.running is False
    shown = stage_health(True, 1, {"running": 1}, [info]).model_dump()
    assert_public(shown)
    assert shown["state"] == "down" and shown["describe"]["details"]["device"] == "cpu"


def test_redact_cuts_absolute_paths_to_their_last_part_and_leaves_names_and_urls():
    assert redact({"a": ["failed at /home/me/.cache/x/blocked-1.so: no", "~/models/m"]}) == {
        "a": ["failed at .../blocked-1.so: no", ".../m"]}
    kept = "stabilityai/sd-turbo at http://127.0.0.1:8000/v1/x, 1/2, 64x64"
    assert redact(kept) == kept


# --- fail closed: a diffusion replica with invariance on and no kernels refuses to start ---------------


def test_a_diffusion_replica_with_invariance_on_and_no_kernels_refuses_to_start_naming_why(tmp_path):
    code = ("from contracts.config import DiffusionStageConfig as C; from stages.diffusion import DiffusionStage as S\n"
            "S.func_or_class(C(batch_invariant=True, warm_up=False))")
    missing = tmp_path / "no-such-c++"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMNISERVE_CACHE": str(tmp_path / "cache"), "CXX": str(missing)})
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("RuntimeError: diffusion batch invariance is on but its kernels are not installed"), error
    assert "refuses to start" in error and "could not be built" in error and "no-such-c++" in error, error


@pytest.mark.slow
def test_an_app_whose_diffusion_replica_refuses_to_start_answers_503_down_with_the_reason(serve_instance, tmp_path):
    import httpx
    from ray import serve

    from orchestration import build_app

    no_compiler = {"env_vars": {"CXX": str(tmp_path / "no-such-c++"), "OMNISERVE_CACHE": str(tmp_path / "cache")}}
    app = {"llm": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.1},  # scaled to zero: never started
                   "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}},
           "diffusion": {"batch_invariant": True, "ray_actor_options": {"num_cpus": 0.2, "runtime_env": no_compiler}},
           "ingress": {"ray_actor_options": {"num_cpus": 0.05}}}
    with pytest.raises(RuntimeError, match="DiffusionStage"):
        serve.run(build_app(app), name="refusing", route_prefix="/refusing")
    try:
        response = httpx.get(f"{serve_instance}/refusing/health", timeout=60)
    finally:
        serve.delete("refusing")
    assert response.status_code == 503, response.text
    health = response.json()
    assert health["status"] == "down" and health["stages"]["llm"]["state"] == "running"
    assert health["stages"]["llm"]["replicas"]["running"] == 0  # /health did not wake it
    diffusion = health["stages"]["diffusion"]
    assert diffusion["state"] == "down" and diffusion["replicas"]["status"] == "DEPLOY_FAILED"
    assert "kernels are not installed" in diffusion["reasons"][0] and "no-such-c++" in diffusion["reasons"][0]
    assert_public(health)


# --- check_health: a dead or stuck compute thread fails it (Serve then replaces the replica) ------------


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["step", "request"])
def test_diffusion_check_health_fails_while_a_step_runs_past_its_bound_and_when_the_thread_is_gone(batching):
    from stages.diffusion import DiffusionStage, Job

    config = DiffusionStageConfig(batch_invariant=True, warm_up=False, batching=batching, stuck_after_s=0.5,
                                  defaults={"num_inference_steps": 2})
    stage = DiffusionStage.func_or_class(config)
    asyncio.run(stage.check_health())
    assert_public(stage_health(True, 1, {"running": 1}, [_describe(stage)]).model_dump())
    release = threading.Event()
    if batching == "step":
        family, denoise = stage.renderer.family, stage.renderer.family.denoise
        family.denoise = lambda batch: (release.wait(60), denoise(batch))[1]
        render = threading.Thread(target=stage.batching.engine.render, args=([_sample(stage)],))
    else:
        renderer_render = stage.renderer.render
        stage.renderer.render = lambda jobs: (release.wait(60), renderer_render(jobs))[1]
        job = Job("held", stage.renderer.resolve(_params()))
        render = threading.Thread(target=stage.batching._render, args=([job],))
    render.start()
    time.sleep(1.0)
    with pytest.raises(RuntimeError, match="stuck"):
        asyncio.run(stage.check_health())
    info = _describe(stage)
    assert not info.running and "stuck" in info.details["problem"]
    assert judge(True, 2, TWO_RUNNING, [info])[0] == "degraded"
    release.set()
    render.join(60)
    asyncio.run(stage.check_health())  # the step ended: healthy again
    if batching == "step":
        stage.batching.engine.stop()
    else:
        stage.batching._compute.shutdown()
    with pytest.raises(RuntimeError, match="gone"):
        asyncio.run(stage.check_health())


def _params():
    from contracts.sampling import DiffusionSamplingParams

    return DiffusionSamplingParams(seed=1, num_inference_steps=2, height=64, width=64)


def _sample(stage):
    from stages.diffusion.engine import Sample

    return Sample("held", stage.renderer.resolve(_params(), step_engine=True), on_done=None)


def _describe(stage) -> StageDescription:
    import asyncio

    return asyncio.run(stage.describe())
