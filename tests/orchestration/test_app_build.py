"""The app's configuration, construction and admission, without starting Ray.

`build_app` only binds deployments; these tests read what it bound: the switches each stage receives,
replica counts, resource requests, and what the ingress is told.
"""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from contracts.config import DiffusionStageConfig, LLMStageConfig, VideoStageConfig
from contracts.errors import InvalidRequestError
from contracts.http import ChatCompletionRequest, ImageGenerationRequest
from contracts.invariance import SeedContractError, Switches
from contracts.sampling import MAX_SAFE_SEED, seeds_for_request
from orchestration.app import app_builder, build_app
from orchestration.config import DEPLOYMENT_NAMES, VIDEO_JOBS_NAME, AppConfig
from orchestration.pipeline import admit_chat, admit_images

ROOT = Path(__file__).resolve().parents[2]


def bound(app):
    """(ingress deployment, llm deployment, diffusion deployment, the ingress's AppConfig) of a built app."""
    ingress = app._bound_deployment
    llm_app, diffusion_app, config, files, _videos = ingress.init_args
    assert files._bound_deployment.init_args == (config.ingress.image_url_store_mib << 20, config.ingress.image_url_ttl_s)
    return ingress, llm_app._bound_deployment, diffusion_app._bound_deployment, config


def stage_config(deployment):
    """The one typed config a stage deployment was bound with."""
    (config,) = deployment.init_args
    assert not deployment.init_kwargs
    return config


# --- build_app ----------------------------------------------------------------------------------------


def test_example_app_imports_and_builds_on_embedded_defaults(clean_switches):
    import examples.omni_app as example

    ingress, llm, diffusion, settings = bound(example.app)
    assert (ingress.name, llm.name, diffusion.name) == tuple(DEPLOYMENT_NAMES[k] for k in ("ingress", "llm", "diffusion"))
    assert isinstance(stage_config(llm), LLMStageConfig) and isinstance(stage_config(diffusion), DiffusionStageConfig)
    assert stage_config(llm).model is None and stage_config(diffusion).model is None  # None: the embedded models
    assert callable(example.app_builder)
    # The example serves videos too: the jobs deployment, bound with the LLM and the video stage (the tiny Wan).
    jobs = ingress.init_args[-1]._bound_deployment
    _, video, config = jobs.init_args
    assert (jobs.name, video._bound_deployment.name) == (VIDEO_JOBS_NAME, DEPLOYMENT_NAMES["video"])
    assert isinstance(stage_config(video._bound_deployment), VideoStageConfig) and config.video.model == "omniserve/tiny-wan-video"


def test_an_app_without_video_binds_no_video_deployments():
    assert build_app()._bound_deployment.init_args[-1] is None


def test_default_resource_requests_fit_a_two_cpu_box():
    _, llm, diffusion, _ = bound(build_app())
    ingress = build_app()._bound_deployment
    total = sum(d.ray_actor_options["num_cpus"] * d.num_replicas for d in (ingress, llm, diffusion))
    assert total <= 1.2, total
    assert "num_gpus" not in llm.ray_actor_options and "num_gpus" not in diffusion.ray_actor_options


@pytest.mark.parametrize("environ,expected", [
    ({}, {"llm": False, "diffusion": False}),
    ({"VLLM_BATCH_INVARIANT": "1"}, {"llm": True, "diffusion": True}),
    ({"VLLM_BATCH_INVARIANT": "1", "OMNI_LLM_BATCH_INVARIANT": "0"}, {"llm": False, "diffusion": True}),
    ({"OMNI_DIFFUSION_BATCH_INVARIANT": "on"}, {"llm": False, "diffusion": True}),
])
def test_null_switches_are_resolved_from_the_environment_once_at_build_and_passed_explicitly(clean_switches, environ, expected):
    for name, value in environ.items():
        clean_switches.setenv(name, value)
    _, llm, diffusion, settings = bound(build_app())
    for name, value in environ.items():
        clean_switches.delenv(name)  # the replicas must not need the builder's environment
    assert stage_config(llm).batch_invariant is expected["llm"]
    assert stage_config(diffusion).batch_invariant is expected["diffusion"]
    assert settings.switches == Switches(**expected)


def test_config_switches_override_the_environment(clean_switches):
    clean_switches.setenv("VLLM_BATCH_INVARIANT", "1")
    _, llm, diffusion, settings = bound(build_app({"llm": {"batch_invariant": False}, "diffusion": {"batch_invariant": True}}))
    assert (stage_config(llm).batch_invariant, stage_config(diffusion).batch_invariant) == (False, True)
    assert settings.switches == Switches(llm=False, diffusion=True)


def test_each_stage_receives_its_config_whole_and_serve_options_come_from_it():
    config = {
        "llm": {"model": "/models/llm", "device": "cuda", "dtype": "bfloat16", "torch_threads": 4, "max_ongoing_requests": 7,
                "ray_actor_options": {"num_gpus": 1}, "engine_args": {"tensor_parallel_size": 1}},
        "diffusion": {"model": "/models/sd", "max_batch_size": 4, "batch_wait_timeout_s": 0.2, "max_queued": 16,
                      "defaults": {"num_inference_steps": 4}, "num_replicas": 3, "health_check_period_s": 2},
    }
    app = build_app(config)
    ingress, llm, diffusion, settings = bound(app)
    expected = AppConfig.model_validate(config)
    for deployment, part in ((llm, "llm"), (diffusion, "diffusion")):
        given = stage_config(deployment)
        assert given.model_dump(exclude={"batch_invariant"}) == getattr(expected, part).model_dump(exclude={"batch_invariant"})
    assert stage_config(llm).engine_args == {"tensor_parallel_size": 1} and llm.ray_actor_options["num_gpus"] == 1
    # Serve's options are the config's, not a decorator's: nothing the config says is overridden.
    assert llm.max_ongoing_requests == 7 and ingress.max_ongoing_requests == expected.ingress.max_ongoing_requests
    assert diffusion.num_replicas == 3 and diffusion._deployment_config.health_check_period_s == 2
    assert settings.diffusion.defaults.num_inference_steps == 4
    assert {part: settings.deployment(part).configured_replicas for part in settings.parts} == {
        "ingress": 1, "llm": 1, "diffusion": 3}


def test_autoscaling_config_replaces_num_replicas():
    app = build_app({"diffusion": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}})
    _, _, diffusion, settings = bound(app)
    assert diffusion._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(ValidationError, match="not both"):
        AppConfig.model_validate({"diffusion": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}})


@pytest.mark.parametrize("bad", [
    {"diffusion": {"num_replicas": 0}},
    {"llm": {"batch_invariant": "yes"}},
    {"llm": {"device": "tpu"}},
    {"llm": {"enhance": {"seed": 1}}},
    {"llm": {"enhance": {"temperature": 9}}},
    {"diffusion": {"colour": 1}},
    {"stages": {}},
])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValidationError):
        AppConfig.model_validate(bad)


def test_app_builder_accepts_dotted_command_line_arguments():
    # `serve run examples.omni_app:app_builder diffusion.num_replicas=2 diffusion.batch_invariant=true`
    config = AppConfig.from_args({"diffusion.num_replicas": "2", "diffusion.batch_invariant": "true", "llm.batch_invariant": "null"})
    assert config.diffusion.num_replicas == 2 and config.diffusion.batch_invariant is True and config.llm.batch_invariant is None
    _, llm, diffusion, _ = bound(app_builder({"diffusion.num_replicas": "2", "llm.num_replicas": "1"}))
    assert (diffusion.num_replicas, llm.num_replicas) == (2, 1)


def test_a_bare_off_from_yaml_or_the_command_line_means_the_word():
    # YAML 1.1 reads `off` and `on` as booleans; `serve run ... llm.self_audit=off` exited with a validation error.
    config = AppConfig.from_args({"llm.self_audit": "off", "diffusion.self_audit": "on", "video.self_audit": "full"})
    assert (config.llm.self_audit, config.diffusion.self_audit, config.video.self_audit) == ("off", "quick", "full")
    with pytest.raises(ValidationError, match="self_audit"):
        AppConfig.from_args({"llm.self_audit": "3"})


def test_example_yaml_is_a_valid_serve_config_scaling_the_stages_independently():
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "examples" / "omni_app.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (application,) = schema.applications
    config = AppConfig.from_args(application.args)
    assert config.diffusion.num_replicas == 2 and config.llm.num_replicas == 1
    # The import path is an installed module, so Serve's controller can import it on any node.
    module, attr = application.import_path.split(":")
    import importlib

    builder = getattr(importlib.import_module(module), attr)
    _, llm, diffusion, _ = bound(builder(application.args))
    assert (llm.num_replicas, diffusion.num_replicas) == (1, 2)


# --- admission: decided before any replica is called ----------------------------------------------


def settings(llm=True, diffusion=True, **overrides) -> AppConfig:
    overrides.setdefault("llm", {})["batch_invariant"] = llm
    overrides.setdefault("diffusion", {})["batch_invariant"] = diffusion
    return AppConfig.model_validate(overrides).with_resolved_switches()


def image_request(**fields) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a red fox", **fields})


def test_admission_refuses_a_seedless_image_request_under_diffusion_invariance():
    with pytest.raises(SeedContractError) as caught:
        admit_images(image_request(), settings(diffusion=True))
    assert caught.value.param == "seed"


def test_admission_picks_and_reports_a_seed_without_diffusion_invariance():
    plan = admit_images(image_request(n=3), settings(diffusion=False))
    assert 0 <= plan.seed <= MAX_SAFE_SEED
    assert [p.seed for p in plan.diffusion_params] == seeds_for_request(plan.seed, 3)


def test_admission_gives_every_image_its_own_seed_in_both_stages():
    plan = admit_images(image_request(seed=42, n=4, num_inference_steps=4), settings())
    expected = seeds_for_request(42, 4)
    assert [p.seed for p in plan.diffusion_params] == expected
    assert [p.seed for p in plan.llm_params] == expected
    assert all(p.num_inference_steps == 4 for p in plan.diffusion_params)


def test_admission_without_enhancement_plans_no_llm_call():
    plan = admit_images(image_request(seed=1, enhance_prompt=False), settings())
    assert not plan.enhance and plan.llm_params == []


@pytest.mark.parametrize("field", ["generator_device", "latents", "sigmas"])
def test_admission_refuses_seed_overrides_under_diffusion_invariance(field):
    value = {"generator_device": "cpu", "latents": [[[0.0]]], "sigmas": [1.0, 0.5]}[field]
    with pytest.raises(SeedContractError) as caught:
        admit_images(image_request(seed=1, **{field: value}), settings(diffusion=True))
    assert caught.value.param == field
    admit_images(image_request(seed=1, **{field: value}), settings(diffusion=False))  # off: the stage decides


def test_admission_applies_the_serving_limits():
    with pytest.raises(InvalidRequestError) as caught:
        admit_images(image_request(seed=1, num_inference_steps=51), settings())
    assert caught.value.param == "num_inference_steps"
    with pytest.raises(InvalidRequestError) as caught:
        admit_images(image_request(seed=1, size="1024x1024"), settings())
    assert caught.value.param == "size"


def test_chat_admission_follows_the_llm_switch():
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(SeedContractError):
        admit_chat(chat, settings(llm=True))
    assert admit_chat(chat, settings(llm=False)).seed is not None  # picked, so it can be reported
    greedy = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert admit_chat(greedy, settings(llm=True)).seed is None  # greedy draws no random numbers


def capped(**diffusion) -> AppConfig:
    return AppConfig.model_validate({"diffusion": {"batch_invariant": True, **diffusion}}).with_resolved_switches()


def test_admission_caps_one_requests_work_images_x_steps_x_pixels():
    capped_64 = capped(max_request_work=4 * 8 * 64 * 64, defaults={"num_inference_steps": 8})
    admit_images(image_request(seed=1, n=4, size="64x64"), capped_64)  # exactly the cap
    with pytest.raises(InvalidRequestError) as caught:
        admit_images(image_request(seed=1, n=5, size="64x64"), capped_64)
    assert caught.value.param == "n" and "pixel-steps" in caught.value.message
    with pytest.raises(InvalidRequestError):  # a left-out size counts at the limit when no default is configured
        admit_images(image_request(seed=1, n=1), capped(max_request_work=100))
    admit_images(image_request(seed=1, n=8, size="512x512", num_inference_steps=50), settings())  # the default cap
