"""The LLM benchmark: off vs on paired by repeat, and a tiny real run through the one CLI (two real engines)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench.paired import setting_orders, summarize

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_settings_alternate_which_runs_first():
    assert setting_orders(3) == [["off", "on"], ["on", "off"], ["off", "on"]]


def test_ratios_are_paired_by_repeat_not_taken_between_medians():
    runs = [
        {"repeat": 0, "setting": "off", "concurrency": 4, "tokens_per_s": 100.0, "p50_s": 1.0, "p95_s": 2.0},
        {"repeat": 0, "setting": "on", "concurrency": 4, "tokens_per_s": 50.0, "p50_s": 2.0, "p95_s": 4.0},
        {"repeat": 1, "setting": "on", "concurrency": 4, "tokens_per_s": 90.0, "p50_s": 1.0, "p95_s": 2.0},
        {"repeat": 1, "setting": "off", "concurrency": 4, "tokens_per_s": 200.0, "p50_s": 0.5, "p95_s": 1.0},
        {"repeat": 2, "setting": "off", "concurrency": 4, "tokens_per_s": 80.0, "p50_s": 1.0, "p95_s": 2.0},
        {"repeat": 2, "setting": "on", "concurrency": 4, "tokens_per_s": 72.0, "p50_s": 1.25, "p95_s": 2.0},
    ]
    summary, ratios = summarize(runs, point="concurrency", rate="tokens_per_s")
    assert summary["off"]["4"]["tokens_per_s"] == {"min": 80.0, "median": 100.0, "max": 200.0}
    # Per repeat: 0.5, 0.45, 0.9 -> median 0.5; the ratio of the medians (90 / 100) would say 0.9.
    assert ratios["4"]["tokens_per_s_on_over_off"] == {"min": 0.45, "median": 0.5, "max": 0.9}
    assert ratios["4"]["p50_s_off_over_on"] == {"min": 0.5, "median": 0.5, "max": 0.8}


@pytest.mark.slow
def test_a_tiny_llm_bench_reports_each_setting_and_concurrency(tmp_path):
    paths = {name: tmp_path / f"bench-llm.{name}" for name in ("json", "md", "png")}
    command = [sys.executable, "-m", "cli.main", "bench", "--stage", "llm", "--repeats", "1",
               "--concurrency", "1,2", "--requests", "4", "--max-tokens", "4",
               "--json", str(paths["json"]), "--markdown", str(paths["md"]), "--picture", str(paths["png"])]
    # A process of its own: vLLM spawns processes and edits the environment of the one that starts it.
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(paths["json"].read_text())
    assert set(report) >= {"spec", "engines_alive", "runs", "summary", "ratios", "environment"}
    assert [(r["concurrency"], r["setting"]) for r in report["runs"]] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    engines = report["environment"]["engines"]
    assert engines["off"]["batch_invariant"] is False and engines["on"]["batch_invariant"] is True
    for run in report["runs"]:
        assert run["tokens"] == 4 * 4, "min_tokens = max_tokens: every request makes exactly max_tokens"
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"], rel=1e-3)
        assert 0 < run["p50_s"] <= run["p95_s"] <= run["wall_s"]
    for concurrency in ("1", "2"):
        off, on = (next(r for r in report["runs"] if r["setting"] == s and str(r["concurrency"]) == concurrency)
                   for s in ("off", "on"))
        ratio = report["ratios"][concurrency]["tokens_per_s_on_over_off"]
        assert ratio["min"] == ratio["median"] == ratio["max"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"], abs=1e-3)
    assert "| concurrency | output tokens/s on/off | p50 latency off/on |" in paths["md"].read_text()
    assert Image.open(paths["png"]).format == "PNG"
