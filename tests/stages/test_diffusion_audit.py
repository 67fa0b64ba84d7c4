"""The diffusion audit on the real tiny pipelines: kernels on, 0 differing elements; off, the control differs."""

import json

import pytest

from cli.main import main
from evidence.diffusion import audit_model, batches
from stages.embedded import embedded_models
from stages.kernels import current_report

UNET, DIT, SDXL, FLUX, QWEN = embedded_models("diffusion")


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,path",
    # Qwen-Image's requests batch by prompt length (its pipeline pads a batch's prompts), and the pipeline path batches
    # as request batching does: its target, whose neighbours have other lengths, renders alone there, so no control
    # could vary. tests/stages/test_model_directory.py checks the grouping, with its control.
    [(model, path) for model in (UNET, DIT, SDXL, FLUX) for path in ("engine", "pipeline")] + [(QWEN, "engine")],
)
def test_diffusion_audit_kernels_on_bit_identical_and_control_differs(model, path):
    runs, examples = audit_model(
        model, batch_sizes=(1, 2, 5, 8), orderings=("first", "last", "shuffled", "mutated-neighbour"),
        steps=3, path=path, log=lambda line: None,
    )
    on = [r for r in runs if r["kernels"] == "on"]
    off = [r for r in runs if r["kernels"] == "off"]
    assert {r["batch_size"] for r in on} == {1, 2, 5, 8}
    assert all(r["differing_elements"] == 0 for r in on), [r for r in on if r["differing_elements"]]
    varied = [r for r in off if r["differing_elements"] > 0]
    assert varied, "the control never varied: the audit could not fail"
    if path == "pipeline":
        assert varied[0].get("first_divergent_module")  # the audit names where the control diverges
    # Initial latents come from per-sample generators: equal even in the control.
    assert all(r["initial_latents_differing"] == 0 for r in runs)
    assert not current_report().installed  # the audit leaves stock kernels behind


def test_diffusion_audit_arrangements_put_the_target_where_they_say():
    plans = {(ordering, len(order)): (order, target) for ordering, order, target in batches((1, 4), ("first", "last", "reversed"))}
    assert plans[("solo", 1)][1] == 0
    assert plans[("first", 4)][1] == 0 and plans[("last", 4)][1] == 3
    order, target = plans[("reversed", 4)]
    assert order[target][1] == 42 and len(set(seed for _, seed in order)) == 4


@pytest.mark.slow
def test_diffusion_audit_cli_writes_json_markdown_picture_and_exits_zero(tmp_path, capsys):
    paths = {name: tmp_path / name for name in ("audit.json", "audit.md", "audit.png")}
    status = main([
        "audit", "--stage", "diffusion", "--model", DIT, "--batch-sizes", "1,3",
        "--steps", "2", "--json", str(paths["audit.json"]), "--markdown", str(paths["audit.md"]),
        "--picture", str(paths["audit.png"]),
    ])
    assert status == 0
    report = json.loads(paths["audit.json"].read_text())
    assert report["summary"]["invariant"] is True and report["summary"]["control_varies"] is True
    assert {"hardware", "versions", "command"} <= set(report["environment"])
    assert "bit-identical" in paths["audit.md"].read_text()
    assert paths["audit.png"].read_bytes().startswith(b"\x89PNG")
    assert "| diffusion |" in capsys.readouterr().out
