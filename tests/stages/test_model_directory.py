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


@pytest.mark.parametrize("kind", ["unet", "sdxl", "dit", "flux", "qwen"])
def test_a_saved_pipeline_directory_loads_into_its_step_engine_family(kind):
    renderer = start(str(tiny_pipeline_path(kind)))
    assert renderer.family is not None, f"{kind}: the step engine does not drive {type(renderer.pipe).__name__}"
    check_model_directory("org/some-model")  # a hub id: diffusers' to resolve, not refused here


def test_true_cfg_scale_is_refused_by_pipelines_without_it_and_flux_takes_no_latents_and_whole_tokens_only():
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


@pytest.mark.parametrize(
    ("pipeline", "named"),
    [
        ("StableDiffusionLatentUpscalePipeline", "its call takes no height, width"),  # an upscaler
        ("DDPMPipeline", "its call takes no prompt, height, width, guidance_scale"),  # unconditional
        ("WanPipeline", "a video pipeline"),
    ],
)
def test_a_pipeline_this_stage_cannot_call_fails_at_start_up_before_its_weights_load(tmp_path, pipeline, named):
    # Only the index: the refusal comes from the class, before any component is looked for.
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    with pytest.raises(ModelDirectoryError, match=f"is a {pipeline}, .*{named}"):
        start(str(tmp_path))


def test_the_video_stage_takes_video_pipelines_only_and_the_image_stage_image_ones(tmp_path):
    from stages.diffusion.renderer import check_model_directory, check_serves
    from stages.diffusion.video_stage import VideoStage

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ModelDirectoryError, match="an image pipeline: the video stage serves videos"):
        check_model_directory(str(tmp_path), video=True)
    import diffusers

    check_serves(diffusers.WanPipeline, "wan", video=True)  # a video pipeline, for the video stage: taken
    with pytest.raises(ModelDirectoryError, match="an image pipeline: the video stage serves videos"):
        VideoStage.func_or_class({"model": "omniserve/tiny-shapes-sd", "warm_up": False})  # embedded ones too


def test_a_pipeline_without_a_family_serves_whole_requests_at_its_requested_size_and_prompt_invariantly():
    """PixArt-Sigma: no step-engine family, so whole-request batches through the pipeline itself. Its bytes are a
    function of the request: with the kernels on, a request's float image is the same alone and in a batch of four;
    the control (kernels off) differs. Rendered at the size asked (no aspect-ratio binning) from the prompt given
    (no caption cleaning)."""
    import numpy as np

    from contracts.sampling import DiffusionSamplingParams
    from stages.diffusion.renderer import Job

    from stages.kernels import disable_batch_invariant_kernels

    images = {}
    for batch_invariant in (False, True):
        disable_batch_invariant_kernels()  # the kernels are process-wide: the control runs on stock ones
        renderer = DiffusionRenderer(
            DiffusionStageConfig(model=str(tiny_pipeline_path("pixart")), batch_invariant=batch_invariant, torch_threads=1)
        )
        assert renderer.family is None and renderer.prompt_and_size_rewrites == ["use_resolution_binning", "clean_caption"]
        jobs = [
            Job(f"a red fox number {i} in the snow", renderer.resolve(DiffusionSamplingParams(seed=i, num_inference_steps=3, width=128)))
            for i in range(4)
        ]
        images[batch_invariant] = (renderer.render(jobs[:1])[0], renderer.render(jobs)[0])
    disable_batch_invariant_kernels()
    alone, batched = images[True]
    assert alone.shape == (64, 128, 3)  # the size asked, not a trained bin's
    assert np.array_equal(alone, batched)
    assert not np.array_equal(*images[False]), "the control did not vary: this check could not fail"


def test_a_models_own_default_size_past_the_servers_limit_becomes_the_largest_square_within_it():
    """FluxPipeline's own default is 1024x1024: past the default limit (512 x 512 pixels), so a request naming no size,
    and the replica's warm-up, would be refused."""
    flux = str(tiny_pipeline_path("flux"))
    assert (start(flux).defaults["height"], start(flux).defaults["width"]) == (512, 512)
    roomy = DiffusionRenderer(DiffusionStageConfig(model=flux, batch_invariant=False, torch_threads=1, max_pixels=1024 * 1024))
    assert roomy.defaults["height"] == 1024
    tight = DiffusionRenderer(DiffusionStageConfig(model=flux, batch_invariant=False, torch_threads=1, max_pixels=300 * 300))
    assert tight.defaults["height"] == 288  # a multiple of 16 (VAE 8 x FLUX's 2x2 packing), within the limit


def test_qwen_image_takes_true_cfg_and_whole_tokens_and_refuses_one_step_naming_the_field():
    from contracts.errors import InvalidRequestError
    from contracts.sampling import DiffusionSamplingParams

    qwen = start(str(tiny_pipeline_path("qwen")))
    resolved = qwen.resolve(DiffusionSamplingParams(seed=1, height=48, width=80, num_inference_steps=2, true_cfg_scale=2.0))
    assert (resolved.height, resolved.width, resolved.true_cfg_scale) == (48, 80, 2.0)  # 2x2 tokens of 8x latents: 16
    with pytest.raises(InvalidRequestError, match="multiple of 16") as refused:
        qwen.resolve(DiffusionSamplingParams(seed=1, height=64, width=40))
    assert refused.value.param == "width"
    # Its scheduler stretches the schedule to a terminal sigma: one step divides 0 by 0 in diffusers (a NaN image).
    with pytest.raises(InvalidRequestError, match="at least 2") as refused:
        qwen.resolve(DiffusionSamplingParams(seed=1, height=64, width=64, num_inference_steps=1))
    assert refused.value.param == "num_inference_steps"


def test_qwen_image_whole_request_batches_hold_prompts_of_one_length_which_keeps_their_bits():
    """diffusers' QwenImagePipeline pads a batch's prompts to the longest and masks the padding; the masked attention
    then gives a prompt other bits than alone, even with the kernels on (that is the control here: a batch mixing
    lengths differs). Request batching therefore groups requests by their prompts' token counts
    (`DiffusionRenderer.request_group`), and a batch of one length gives each request its solo bits."""
    import numpy as np

    from contracts.sampling import DiffusionSamplingParams
    from stages.diffusion.renderer import Job
    from stages.kernels import disable_batch_invariant_kernels

    renderer = DiffusionRenderer(
        DiffusionStageConfig(model=str(tiny_pipeline_path("qwen")), batch_invariant=True, torch_threads=1)
    )
    try:
        def job(prompt, seed):
            return Job(prompt, renderer.resolve(DiffusionSamplingParams(seed=seed, num_inference_steps=3)))

        target, same_length, longer = job("a red fox", 1), job("a tin box", 2), job("a red fox in deep snow at dusk", 3)
        assert renderer.request_group(target) == renderer.request_group(same_length) != renderer.request_group(longer)
        alone = renderer.render([target])[0]
        assert np.array_equal(renderer.render([target, same_length])[0], alone)
        assert not np.array_equal(renderer.render([target, longer])[0], alone), "the control did not vary"
    finally:
        disable_batch_invariant_kernels()
