"""The app benchmark: two real apps (invariance off, on) side by side, driven alternately over HTTP."""

import pytest
from PIL import Image

from bench.app import AppBenchSpec, app_config, reserved_cpus

# Small CPU reservations (scheduling labels only): both apps fit beside the package's own apps on 2 CPUs.
APP = {
    "llm": {"ray_actor_options": {"num_cpus": 0.05}},
    "diffusion": {"ray_actor_options": {"num_cpus": 0.05}},
    "ingress": {"ray_actor_options": {"num_cpus": 0.05}},
}


def test_each_app_sets_both_switches_and_leaves_the_shared_config_alone():
    spec = AppBenchSpec(app=APP)
    on, off = app_config(spec, "on"), app_config(spec, "off")
    assert on["llm"]["batch_invariant"] is on["diffusion"]["batch_invariant"] is True
    assert off["llm"]["batch_invariant"] is off["diffusion"]["batch_invariant"] is False
    assert "batch_invariant" not in APP["llm"] and on["ingress"] == APP["ingress"]


def test_reserved_cpus_count_every_replica_at_its_maximum():
    assert reserved_cpus({}) == pytest.approx(0.5 + 0.5 + 0.1)  # the defaults: one replica each
    config = {"diffusion": {"num_replicas": 2}, "llm": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 3}}}
    assert reserved_cpus(config) == pytest.approx(3 * 0.5 + 2 * 0.5 + 0.1)


@pytest.mark.slow
def test_a_tiny_app_bench_reports_images_per_second_with_and_without_rewriting(serve_instance, tmp_path):
    from bench import app as bench_app
    from orchestration import build_app

    # Two requests a point: at concurrency 2 both are in flight at once, and every point still has a p50 and a p95.
    spec = AppBenchSpec(requests=2, concurrency=(1, 2), steps=1, repeats=1, app=APP, timeout_s=120)
    report = bench_app.run_app_bench(build_app, spec, command=["test"], log=print)
    assert report["stages"]["on"]["llm"]["batch_invariant"] and not report["stages"]["off"]["diffusion"]["batch_invariant"]
    runs = report["runs"]
    assert [(r["rewrite"], r["concurrency"], r["setting"]) for r in runs] == [
        (rewrite, c, s) for rewrite in ("off", "on") for c in (1, 2) for s in ("off", "on")]
    for run in runs:
        assert run["images"] == 2 and run["images_per_s"] == pytest.approx(2 / run["wall_s"], rel=1e-3)
        assert 0 < run["p50_s"] <= run["p95_s"] <= run["wall_s"]
    for rewrite in ("off", "on"):
        for c in ("1", "2"):
            off, on = (next(r for r in runs if (r["rewrite"], str(r["concurrency"]), r["setting"]) == (rewrite, c, s))
                       for s in ("off", "on"))
            ratio = report["ratios"][rewrite][c]["images_per_s_on_over_off"]
            assert ratio["median"] == pytest.approx(on["images_per_s"] / off["images_per_s"], abs=1e-3)
            assert report["summary"][rewrite]["on"][c]["images_per_s"]["median"] == on["images_per_s"]
    assert "Prompt rewriting (`enhance_prompt`) on:" in bench_app.markdown(report)
    bench_app.picture(report, str(tmp_path / "app.png"))
    assert Image.open(tmp_path / "app.png").format == "PNG"
