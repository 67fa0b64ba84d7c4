"""`diffusion.model` pointed at a directory: what save_pretrained wrote serves as is; anything else fails at start-up
with a message naming what was found (stages/diffusion/renderer.py `check_model_directory`)."""

import json

import pytest

from contracts.config import DiffusionStageConfig
from stages.diffusion import DiffusionRenderer
from stages.diffusion.renderer import ModelDirectoryError, check_model_directory
from stages.embedded.diffusion import tiny_pipeline_path


def start(model: str) -> DiffusionRenderer:
    return DiffusionRenderer(DiffusionStageConfig(model=model, batch_invariant=False, torch_threads=1))


def test_a_directory_without_model_index_fails_at_start_up_naming_what_it_holds(tmp_path):
    (tmp_path / "unet.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirectoryError, match=r"no model_index.json \(found: unet.safetensors\)"):
        start(str(tmp_path))


def test_a_missing_directory_and_a_file_are_refused_by_name(tmp_path):
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        start(str(tmp_path / "nowhere"))
    (tmp_path / "model.ckpt").write_bytes(b"")
    with pytest.raises(ModelDirectoryError, match="a file, not a directory"):
        check_model_directory(str(tmp_path / "model.ckpt"))


def test_a_pipeline_class_diffusers_lacks_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "MadeUpPipeline"}))
    with pytest.raises(ModelDirectoryError, match="names the pipeline class 'MadeUpPipeline'"):
        start(str(tmp_path))
    (tmp_path / "model_index.json").write_text("[1, 2]")
    with pytest.raises(ModelDirectoryError, match="not a JSON object"):
        check_model_directory(str(tmp_path))


@pytest.mark.parametrize("kind", ["unet", "sdxl", "dit", "flux"])
def test_a_saved_pipeline_directory_loads_into_its_step_engine_family(kind):
    renderer = start(str(tiny_pipeline_path(kind)))
    assert renderer.family is not None, f"{kind}: the step engine does not drive {type(renderer.pipe).__name__}"
    check_model_directory("org/some-model")  # a hub id: diffusers' to resolve, not refused here


def test_true_cfg_scale_is_for_flux_only_and_flux_takes_no_latents_and_whole_tokens_only():
    from contracts.errors import InvalidRequestError
    from contracts.sampling import DiffusionSamplingParams

    unet = start(str(tiny_pipeline_path("unet")))
    with pytest.raises(InvalidRequestError, match="FLUX") as refused:
        unet.resolve(DiffusionSamplingParams(seed=1, height=64, width=64, true_cfg_scale=2.0))
    assert refused.value.param == "true_cfg_scale"
    flux = start(str(tiny_pipeline_path("flux")))
    assert flux.resolve(DiffusionSamplingParams(seed=1, height=64, width=64, true_cfg_scale=2.0)).true_cfg_scale == 2.0
    with pytest.raises(InvalidRequestError, match="does not take initial latents") as refused:
        flux.resolve(DiffusionSamplingParams(seed=1, height=64, width=64, latents=[[[0.0]]]))
    assert refused.value.param == "latents"
    with pytest.raises(InvalidRequestError, match="multiple of 16") as refused:  # 8x VAE, 2x2 packing
        flux.resolve(DiffusionSamplingParams(seed=1, height=72, width=64))
    assert refused.value.param == "height"
