"""The real-width audit's driver (evidence/real_width.py) on one family at a tiny image and one block: the report's
shape, 0 differing elements with the kernels on, the control varying. Not the real run (docs/evidence/real-width-audit.*):
the same widths, at a size and depth that take seconds."""

import json

import pytest
import torch

from cli.main import main
from evidence.real_width import FAMILIES, components, differing, first_divergent_module, run_real_width_audit
from stages.kernels import current_report


@pytest.mark.slow
def test_the_cli_audits_a_family_at_real_widths_bit_identical_with_the_kernels(tmp_path):
    report_path, table_path = tmp_path / "real.json", tmp_path / "real.md"
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's count: the audit runs at 1 (its default) and gives 2 back
    try:
        code = main([
            "audit", "--real-width", "--families", "wan21", "--size", "16", "--blocks", "1",
            "--arrangements", "first:2,last:3", "--json", str(report_path), "--markdown", str(table_path),
        ])  # fmt: skip
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert code == 0
    report = json.loads(report_path.read_text())
    assert [(c["family"], c["role"], c["class"]) for c in report["components"]] == [
        ("wan21", "denoiser", "WanTransformer3DModel"),
        ("wan21", "vae decoder", "AutoencoderKLWan"),
    ]
    denoiser, decoder = report["components"]
    assert denoiser["depth"] == "1 of 30 blocks" and decoder["depth"] == "full"
    assert denoiser["widths"]["hidden"] == 1536 and denoiser["widths"]["ffn_dim"] == 8960  # the public widths
    for component in report["components"]:
        assert component["size"] == 16 and component["differing_with_kernels_on"] == 0
        assert component["control_differing"] > 0, "the control never varied: the audit could not fail"
        assert component["warm_up_equal"] == {"off": True, "on": True}
        assert component["output_std"] > 0  # a zero output would make every comparison equal
        timing = component["timing"]
        assert set(timing["ratio_on_over_off"]) == {"solo:1", "first:2", "last:3"}
        assert timing["min"] <= timing["median"] <= timing["max"]
    runs = report["runs"]
    assert {(r["kernels"], r["ordering"], r["batch_size"]) for r in runs} == {
        (k, o, b) for k in ("off", "on") for o, b in (("solo", 1), ("first", 2), ("last", 3))
    }
    assert [r["target_position"] for r in runs if r["ordering"] == "last"] == [2] * 4
    assert report["summary"]["invariant"] and report["summary"]["control_varies"]
    assert report["environment"]["command"].startswith("omniserve ")  # the CLI records its process's arguments
    assert report["environment"]["hardware"]["torch_threads"] == 1  # the audit's, not the caller's restored after it
    assert "not a checkpoint" in table_path.read_text() and "| wan21 | denoiser |" in table_path.read_text()
    assert not current_report().installed  # stock kernels left behind


def test_every_family_is_listed_with_its_decoder_and_a_shared_decoder_once():
    listed = components(list(FAMILIES), 32, 1)
    roles = [(c.family, c.role) for c in listed]
    assert roles.count(("sd15", "vae decoder")) == 1 and ("sdxl", "vae decoder") not in roles  # SD1.5's, shared
    assert [c.shared_with for c in listed if c.role == "vae decoder"] == [["sdxl"], ["flux1"], [], []]
    assert {c.family for c in listed if c.role == "denoiser"} == set(FAMILIES)
    with pytest.raises(ValueError, match="multiple of 16"):
        components(["sd15"], 40, None)
    with pytest.raises(ValueError, match="unknown families"):
        run_real_width_audit(["sd4"])


@pytest.mark.slow
def test_the_first_divergent_module_is_named_where_stock_kernels_let_the_batch_in():
    denoiser = components(["wan21"], 16, 1)[0]
    module = denoiser.build()
    neighbour_first = [(7, 0.9), (42, 0.5)]  # the target second, after a neighbour
    assert first_divergent_module(denoiser, module, neighbour_first, "off")  # the control: some module differs
    assert first_divergent_module(denoiser, module, neighbour_first, "on") is None
    assert not current_report().installed


def test_differing_compares_bits():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert differing(a, a.clone())[0] == 0  # a NaN equals itself bit for bit
    assert differing(a, torch.tensor([-0.0, float("nan"), 1.0]))[0] == 1  # -0.0 is other bytes
