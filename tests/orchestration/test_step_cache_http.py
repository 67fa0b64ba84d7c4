"""Step caching over HTTP on the package's "/" app (tests/orchestration/conftest.py: both switches on, two diffusion
replicas): a request's `cache` runs fewer denoiser steps and says how many (`steps_computed`), gives the same bytes
from either replica, is written into the PNG's record (a threshold left out: the measured default, recorded), and
`omniserve verify` reproduces the image from its PNG alone; the same pixels with the cache left out of the record fail.
A malformed `cache` is a 400 naming it."""

import base64

import pytest

from cli.main import main
from contracts.provenance import read_record

from .test_stream_and_cli import edited

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 12
BODY = {"prompt": "a red circle on a blue background", "size": "64x64", "enhance_prompt": False,
        "num_inference_steps": STEPS, "cache": {"method": "teacache", "threshold": 0.3}}


def generate(http, **body) -> dict:
    response = http.post("/v1/images/generations", json={**BODY, **body})
    assert response.status_code == 200, response.text
    return response.json()["data"][0]


def test_a_cached_request_skips_steps_says_so_and_gives_one_set_of_bytes_from_every_replica(http):
    cached = [generate(http, seed=5) for _ in range(4)]  # two replicas: the router spreads them
    uncached = generate(http, seed=5, cache={"method": "off"})
    assert len({item["sha256"] for item in cached}) == 1
    assert all(item["steps_computed"] < STEPS for item in cached), [item["steps_computed"] for item in cached]
    assert uncached["steps_computed"] == STEPS and uncached["sha256"] != cached[0]["sha256"]


def test_omniserve_verify_reproduces_a_cached_image_from_its_png_alone(server, http, tmp_path, capsys):
    path = tmp_path / "cached.png"
    path.write_bytes(base64.b64decode(generate(http, seed=6)["b64_json"]))
    record = read_record(path.read_bytes())
    assert record.params.cache is not None and record.params.cache.threshold == 0.3
    assert main(["verify", str(path), "--url", server]) == 0
    assert "OK " in capsys.readouterr().out
    # The same pixels with a record that lost the cache setting: rendered again with every step, the bytes differ.
    assert main(["verify", edited(path, tmp_path, params=record.params.model_copy(update={"cache": None})),
                 "--url", server]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_teacache_without_a_threshold_runs_the_measured_default_and_its_png_records_it(http):
    left_out = generate(http, seed=7, cache={"method": "teacache"})
    record = read_record(base64.b64decode(left_out["b64_json"]))
    assert record.params.cache is not None and record.params.cache.threshold == 0.2  # the default UNet's, measured
    assert left_out["sha256"] == generate(http, seed=7, cache={"method": "teacache", "threshold": 0.2})["sha256"]
    assert left_out["steps_computed"] < STEPS


@pytest.mark.parametrize("cache", [{"method": "off", "threshold": 0.1}, {"method": "teacache", "threshold": -1},
                                   {"method": "fbcache", "threshold": 0.1}, "on"])
def test_a_malformed_cache_is_a_400_naming_it(http, cache):
    response = http.post("/v1/images/generations", json={**BODY, "seed": 1, "cache": cache})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("cache"), response.json()
