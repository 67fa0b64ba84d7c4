"""The mixed-load benchmark: a seeded, reproducible Poisson schedule, and the report a run writes."""

import json
import statistics

import pytest

from bench.load import LoadSpec, mode_orders, percentile, poisson_schedule


def test_poisson_schedule_is_reproducible_from_its_seed():
    spec = LoadSpec(rate=5.0, requests=50, seed=3)
    assert poisson_schedule(spec) == poisson_schedule(spec)
    assert poisson_schedule(spec, seed=4) == poisson_schedule(LoadSpec(rate=5.0, requests=50, seed=4))
    assert poisson_schedule(spec, seed=4) != poisson_schedule(spec)


def test_poisson_schedule_has_the_asked_rate_mix_and_step_counts():
    spec = LoadSpec(rate=4.0, requests=20_000, short_fraction=0.25, short_steps=4, long_steps=32, seed=1)
    schedule = poisson_schedule(spec)
    times = [a.at for a in schedule]
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert all(gap >= 0 for gap in gaps) and times == sorted(times)
    assert statistics.mean(gaps) == pytest.approx(1 / spec.rate, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / spec.rate, rel=0.05)  # exponential: sd = mean
    shorts = [a for a in schedule if a.kind == "short"]
    assert len(shorts) / len(schedule) == pytest.approx(0.25, abs=0.015)
    assert {a.steps for a in shorts} == {4} and {a.steps for a in schedule if a.kind == "long"} == {32}
    assert len({a.seed for a in schedule}) > 0.99 * len(schedule)  # each request its own seed


def test_modes_alternate_which_runs_first():
    assert mode_orders(["step", "request"], 3) == [["step", "request"], ["request", "step"], ["step", "request"]]


def test_percentile_interpolates_between_ranks_like_numpy():
    numpy = pytest.importorskip("numpy")
    values = [0.3, 0.1, 2.0, 0.7, 0.2, 1.1, 0.05]
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


@pytest.mark.slow
def test_a_tiny_mixed_run_writes_json_markdown_and_a_png(tmp_path):
    from cli.main import main

    paths = {name: tmp_path / f"load.{name}" for name in ("json", "md", "png")}
    code = main(["bench", "--load", "mixed", "--requests", "6", "--rate", "30", "--short-steps", "1", "--long-steps", "2",
                 "--repeats", "2", "--json", str(paths["json"]), "--markdown", str(paths["md"]), "--picture", str(paths["png"])])
    assert code == 0
    report = json.loads(paths["json"].read_text())
    assert set(report) >= {"load", "stage", "runs", "summary", "ratios", "targets", "bytes", "environment"}
    assert [(r["repeat"], r["mode"]) for r in report["runs"]] == [(0, "step"), (0, "request"), (1, "request"), (1, "step")]
    for mode in ("step", "request"):
        assert set(report["summary"][mode]["images_per_s"]) == {"min", "median", "max"}
    assert set(report["ratios"]) >= {"short_p95_request_over_step", "images_per_s_step_over_request"}
    # Invariance on: the same request renders to the same bytes whichever batching served it.
    assert report["bytes"] == {"compared": 12, "differing": 0}
    table = paths["md"].read_text()
    assert "| mode | short p50 s | short p95 s | long p50 s | long p95 s | images/s |" in table
    assert "| step |" in table and "| request |" in table
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_requests_take_their_own_size_when_one_is_given():
    schedule = poisson_schedule(LoadSpec(requests=200, size=64, long_size=128, seed=2))
    assert {a.size for a in schedule if a.kind == "short"} == {64} and {a.size for a in schedule if a.kind == "long"} == {128}
    assert {a.size for a in poisson_schedule(LoadSpec(requests=50, size=96))} == {96}


@pytest.mark.slow
def test_a_mixed_size_run_weighs_flux_size_packing_against_one_shape_per_forward(tmp_path):
    from cli.main import main
    from stages.embedded import embedded_models

    flux = embedded_models("diffusion")[3]
    path = tmp_path / "sizes.json"
    code = main(["bench", "--load", "mixed", "--model", flux, "--modes", "step,step-by-shape", "--requests", "6",
                 "--rate", "30", "--short-steps", "1", "--long-steps", "2", "--size", "64", "--long-size", "128",
                 "--repeats", "2", "--torch-threads", "1", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert report["stage"]["model"] == flux and report["load"]["long_size"] == 128
    assert set(report["packing"]) >= {"short_p95_step-by-shape_over_step", "images_per_s_step_over_step-by-shape"}
    # Packed or not, the same request renders to the same bytes.
    assert report["bytes"] == {"compared": 12, "differing": 0}
