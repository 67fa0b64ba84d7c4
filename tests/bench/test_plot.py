"""The benchmarks' pictures: one ratio chart for every stage, the latency bars on the same frame."""

from PIL import Image

from bench import diffusion as bench
from bench import load as bench_load
from bench.plot import Chart, ratio_picture


def _ratio(low, mid, high):
    return {"min": low, "median": mid, "max": high}


def test_the_chart_maps_its_range_onto_the_axis():
    chart = Chart(400, 300, "t", low=0.5, high=1.5)
    assert chart.y(0.5) == chart.base and chart.y(1.5) == chart.top
    assert chart.y(1.0) == (chart.base + chart.top) / 2


def test_ratio_picture_draws_every_series_with_a_parity_line(tmp_path):
    path = tmp_path / "ratio.png"
    ratio_picture(str(path), title="on / off", x_label="concurrency",
                  series={"a": [(1, _ratio(0.4, 0.5, 0.6)), (16, _ratio(0.8, 0.9, 1.2))], "b": [(4, _ratio(1.0, 1.0, 1.0))]})
    image = Image.open(path)
    assert image.format == "PNG" and image.size[0] >= 420
    colours = {colour for _, colour in image.getcolors(1 << 16)}
    assert {(46, 117, 182), (214, 96, 77), (120, 120, 120)} <= colours  # both series, the dashed 1.0 line


def test_the_diffusion_kernel_bench_draws_its_paired_ratios(tmp_path):
    rows = [{"model": "omniserve/tiny-sd-unet", "size": size, "batch_size": batch, "repeats": 3,
             "on_over_off_paired": _ratio(0.8, 0.9, 0.95)} for size in (64, 256) for batch in (1, 4, 8)]
    bench.picture({"rows": rows}, str(tmp_path / "kernels.png"))
    assert Image.open(tmp_path / "kernels.png").format == "PNG"


def test_the_mixed_load_bars_still_draw_on_the_shared_frame(tmp_path):
    cells = {f"{k}_{q}_s": _ratio(0.1, 0.2, 0.3) for k in ("short", "long") for q in ("p50", "p95")}
    summary = {mode: {**cells, "images_per_s": _ratio(1.0, 2.0, 3.0)} for mode in ("step", "request")}
    load = {"rate": 3.0, "short_fraction": 0.5, "short_steps": 4, "long_steps": 32, "size": 64, "repeats": 2}
    bench_load.picture({"summary": summary, "load": load}, str(tmp_path / "load.png"))
    assert Image.open(tmp_path / "load.png").size == (120 + 150 * 4, 360)
