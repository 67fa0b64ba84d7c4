"""Every image sampling field is declared once (contracts/sampling.py: DiffusionSamplingParams and its `Served`
markers); the HTTP request models, the deployments' defaults, the rendered-image record, the PNG's provenance and
the whole-request batch key are derived from it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from contracts.config import DiffusionDefaults
from contracts.http import ImageEditRequest, ImageGenerationRequest
from contracts.results import RenderedImage
from contracts.sampling import DiffusionSamplingParams, image_fields

ROOT = Path(__file__).resolve().parents[2]


def test_the_derived_declarations_hold_exactly_the_marked_fields():
    requested = set(image_fields(request="all"))
    assert requested <= set(ImageGenerationRequest.model_fields) and "strength" not in ImageGenerationRequest.model_fields
    assert set(image_fields(request="edit")) <= set(ImageEditRequest.model_fields)
    assert set(DiffusionDefaults.model_fields) == set(image_fields(default=True))
    assert set(image_fields(rendered=True)) <= set(RenderedImage.model_fields)
    assert [name for name, _ in DiffusionSamplingParams().batch_parts()] == [
        "num_inference_steps", "guidance_scale", "height", "width", "has_negative_prompt", "true_cfg_scale",
        "generator_device", "has_latents", "sigmas", "num_frames"]


def test_the_http_fields_keep_the_params_own_bounds():
    # Once drifted: the request's generator_device was any short name, the params' a device pattern.
    schema = ImageGenerationRequest.model_json_schema()["properties"]
    params = DiffusionSamplingParams.model_json_schema()["properties"]
    for name in image_fields(request="all"):
        assert schema[name] == params[name], name


PROBE = """
import json
from contracts.config import DiffusionDefaults
from contracts.http import ImageGenerationRequest
from contracts.provenance import ImageRecord
from contracts.results import RenderedImage
from contracts.sampling import DiffusionSamplingParams
request = ImageGenerationRequest.model_validate({"prompt": "a fox", "size": "64x64", "dummy": 3})
try:
    ImageGenerationRequest.model_validate({"prompt": "a fox", "dummy": 501})
    bounded = False
except ValueError as err:
    bounded = "dummy" in str(err)
params = request.diffusion_params(7)
print(json.dumps({
    "schema": "dummy" in ImageGenerationRequest.model_json_schema()["properties"],
    "bounded": bounded,
    "params": params.dummy,
    "defaults": DiffusionDefaults(dummy=4).dummy,
    "rendered": "dummy" in RenderedImage.model_fields,
    "record": ImageRecord.model_fields["params"].annotation is DiffusionSamplingParams
              and "dummy" in DiffusionSamplingParams.model_fields,
    "batch": dict(params.batch_parts()).get("dummy"),
}))
"""


def test_adding_a_sampling_field_is_one_line_that_reaches_the_request_defaults_record_and_batch_key(tmp_path):
    # The repository's contracts with one line added, imported in a fresh interpreter.
    shutil.copytree(ROOT / "contracts", tmp_path / "contracts", ignore=shutil.ignore_patterns("__pycache__"))
    sampling = tmp_path / "contracts" / "sampling.py"
    anchor = '    sigmas: Annotated[Sigmas | None, Served(batch="value")] = None\n'
    source = sampling.read_text()
    assert source.count(anchor) == 1
    line = '    dummy: Annotated[Steps | None, Served(default=True, rendered=True, batch="value")] = None\n'
    sampling.write_text(source.replace(anchor, anchor + line))
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"schema": True, "bounded": True, "params": 3, "defaults": 4, "rendered": True,
                                       "record": True, "batch": 3}
