"""The CLI's client side (`cli.client`) without a server: the reproducing request, the comparison with
/health, the progress bar and the health table."""

import io

from cli.client import Progress, health_table, reproduction, server_differences
from contracts.provenance import ImageOrigin, ImageRecord
from contracts.results import Provenance
from contracts.sampling import DiffusionSamplingParams

PARAMS = DiffusionSamplingParams(seed=11, num_inference_steps=4, guidance_scale=3.5, height=32, width=64,
                                 negative_prompt="fog", scheduler="ddim")
DIFFUSION = Provenance(model="omniserve/tiny-sd-unet", batch_invariant=True, kernel_backend="cpu")
RECORD = ImageRecord.of("a fox", PARAMS, DIFFUSION, ImageOrigin(prompt="a fox", enhance=False))


def test_the_reproducing_request_is_n1_with_the_files_seed_and_every_parameter():
    assert reproduction(RECORD) == {
        "prompt": "a fox", "n": 1, "seed": 11, "size": "64x32", "enhance_prompt": False, "num_inference_steps": 4,
        "guidance_scale": 3.5, "negative_prompt": "fog", "scheduler": "ddim"}


def test_the_reproducing_request_carries_true_cfg_and_each_adapter_with_its_weights_sha256():
    from contracts.sampling import LoraChoice

    sha = "ab" * 32
    params = PARAMS.model_copy(update={"true_cfg_scale": 3.0, "lora": [LoraChoice(name="ink", scale=0.5, sha256=sha)]})
    body = reproduction(ImageRecord.of("a fox", params, DIFFUSION, None))
    assert body["true_cfg_scale"] == 3.0 and body["lora"] == [{"name": "ink", "scale": 0.5, "sha256": sha}]
    from contracts.http import ImageGenerationRequest

    ImageGenerationRequest.model_validate(body)  # a body the API takes


def test_a_server_whose_switch_or_model_differs_is_named_field_by_field():
    same = {"stages": {"diffusion": {"model": "omniserve/tiny-sd-unet", "batch_invariant": True, "kernel_backend": "cpu"}}}
    assert server_differences(RECORD, same) == []
    off = {"stages": {"diffusion": {"model": "other", "batch_invariant": False, "kernel_backend": "none"}}}
    assert server_differences(RECORD, off) == [
        "diffusion.model: the file says 'omniserve/tiny-sd-unet', the server has 'other'",
        "diffusion.batch_invariant: the file says True, the server has False",
        "diffusion.kernel_backend: the file says 'cpu', the server has 'none'"]


def test_the_progress_bar_counts_previews_and_fills_when_every_image_is_done():
    out = io.StringIO()
    progress = Progress(images=2, previews=2, out=out, width=12)
    progress.update({"type": "image_generation.partial_image", "image_index": 0})
    assert out.getvalue().endswith("[##          ] 0/2 images")
    for index in (0, 1):
        progress.update({"type": "image_generation.completed", "image_index": index})
    assert out.getvalue().endswith("[############] 2/2 images\n")


def test_the_health_table_has_a_row_per_stage():
    report = {"status": "ok", "stages": {
        "llm": {"state": "running", "model": "tiny", "batch_invariant": True, "kernel_backend": "cpu",
                "replicas": {"configured": 1, "running": 1}},
        "diffusion": {"state": "degraded", "model": "unet", "batch_invariant": False, "replicas": {"configured": 2, "running": 1},
                      "verified": False, "reasons": ["1 of 2 replicas running"]}}}
    lines = health_table(report).splitlines()
    assert lines[0] == "status: ok" and lines[1].split()[:3] == ["stage", "state", "model"]
    assert lines[3].split() == ["diffusion", "degraded", "unet", "False", "-", "-", "1/2", "False"]
    assert lines[-1] == "diffusion: 1 of 2 replicas running"
