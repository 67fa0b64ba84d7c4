"""The LoRA cost benchmark (bench/lora.py): its seeded load, and a short run's report (every way, paired ratios, bytes
per adapter)."""

from bench.lora import ADAPTERS, WAYS, markdown, requests, run


def test_the_load_adapts_every_other_request_by_each_adapter_in_turn():
    load = requests(12)
    assert sorted(lora[0].name for _, lora in load if lora) == sorted(ADAPTERS * 2)
    assert sum(lora is None for _, lora in load) == 6 and requests(12) == load  # seeded


def test_a_short_run_reports_every_way_paired_ratios_and_adapter_bytes():
    report = run(samples=4, steps=1, size=64, repeats=2, max_batch_size=4, threads=1, invariant=True)
    assert sorted({r["way"] for r in report["runs"]}) == sorted(WAYS) and len(report["runs"]) == 6
    assert set(report["ratios"]) == {"mixed_over_none", "mixed_over_merged"}
    assert all(report["ratios"][k]["min"] > 0 for k in report["ratios"])
    assert report["adapter_bytes"] == {name: 528384 for name in ADAPTERS} and report["adapter_layers"] == 100
    assert "mixed / none" in markdown(report)
