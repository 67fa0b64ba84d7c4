"""bench.real_width_speed: the kernels' first forward packs the weights, the forwards after it reuse them."""

import torch

from bench.real_width_speed import markdown, measure
from evidence.real_width import Component


def _component() -> Component:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32)).eval()

    return Component(
        "tiny", "denoiser", "Sequential", "two linear layers", {"width": 96}, build,
        lambda seed, t: {"x": torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))},
        lambda module, inputs, batch: module(inputs["x"]), 8, 8, "full",
    )  # fmt: skip


def test_the_first_forward_packs_every_weight_and_the_warm_one_reuses_them():
    result = measure(_component(), repeats=2, log=lambda *_: None)
    assert [run["order"] for run in result["runs"]] == [["stock", "kernels"], ["kernels", "stock"]]
    for run in result["runs"]:
        # Removing the kernels empties the cache, so each repeat's first forward packs both weights again.
        assert run["first_packs"] == 2 and run["warm_packs"] == 0 and run["warm_hits"] == 2
        assert run["stock_cpu_s"] > 0 and run["first_cpu_s"] > 0 and run["warm_cpu_s"] > 0
    warm = [run["warm_cpu_s"] / run["stock_cpu_s"] for run in result["runs"]]
    assert result["warm_over_stock"]["min"] == round(min(warm), 3)
    report = {"environment": {"hardware": {"cpu": "a CPU"}}, "kernel_path": "avx2", "command": ["x"],
              "components": [result]}
    assert "| tiny denoiser (Sequential) | 8 | full |" in markdown(report)
