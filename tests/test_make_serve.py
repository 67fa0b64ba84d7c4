"""`make serve`, the README's first command, really serves the example app over HTTP, and stops cleanly.

It binds http://127.0.0.1:8000 (serve run's fixed port) and Prometheus metrics at the README's
http://127.0.0.1:9464/metrics, in a Ray instance of its own, runs in a process session of its own, and is stopped by
that session's process group: exactly what it started.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from contracts.metrics import METRICS_EXPORT_PORT
from tests.orchestration.test_metrics import find, scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000"
START_TIMEOUT_S = 420
METRICS_DEADLINE_S = 60  # Ray's metrics agent exports every 10 s


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group we started (serve run ignores SIGINT as a background job), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(process: subprocess.Popen, log: Path) -> httpx.Response:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"make serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"
        try:
            response = httpx.get(f"{URL}/health", timeout=10)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise AssertionError(f"/health did not answer 200 within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def assert_metrics_exported() -> None:
    """The README's metrics URL shows the request, both stages' latency and switch, and the batch size."""
    expected = {
        "requests": ("omniserve_requests_total", {"route": "/v1/images/generations", "status_class": "2xx"}),
        "llm latency": ("omniserve_stage_latency_seconds_count", {"stage": "llm", "deployment": "LLMStage"}),
        "diffusion latency": ("omniserve_stage_latency_seconds_count", {"stage": "diffusion", "deployment": "DiffusionStage"}),
        "batch size": ("omniserve_diffusion_batch_size_count", {"deployment": "DiffusionStage"}),
        "llm switch": ("omniserve_batch_invariant", {"stage": "llm", "deployment": "LLMStage"}),
        "diffusion switch": ("omniserve_batch_invariant", {"stage": "diffusion", "deployment": "DiffusionStage"}),
    }
    deadline = time.monotonic() + METRICS_DEADLINE_S
    while True:
        samples = scrape(METRICS_EXPORT_PORT)
        missing = [what for what, (name, labels) in expected.items() if not find(samples, name, **labels)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"http://127.0.0.1:{METRICS_EXPORT_PORT}/metrics lacks {missing}"
    assert {s[2] for s in find(samples, "omniserve_batch_invariant")} == {1.0}


def test_make_serve_serves_the_example_app_with_both_switches_on(tmp_path):
    for port in (8000, METRICS_EXPORT_PORT):
        if port_in_use(port):
            pytest.skip(f"port {port} is taken on this machine: make serve binds it")
    log = tmp_path / "make-serve.log"
    # A Ray instance of its own, on the loopback address (Ray's single-machine mode, as on macOS and Windows).
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    for name in ("OMNI_LLM_BATCH_INVARIANT", "OMNI_DIFFUSION_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):
        env.pop(name, None)  # the Makefile's defaults: both on
    with log.open("w") as out:
        process = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        health = wait_healthy(process, log).json()
        assert health["batch_invariant"] == {"llm": True, "diffusion": True}
        body = {"prompt": "a red fox in the snow", "seed": 7, "n": 2, "size": "64x64", "num_inference_steps": 2}
        response = httpx.post(f"{URL}/v1/images/generations", json=body, timeout=300)
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        assert [item["seed"] for item in data][0] == 7 and all(item["revised_prompt"].startswith("a red fox") for item in data)
        assert response.headers["X-Omni-Batch-Invariant-Diffusion"] == "true"
        assert_metrics_exported()
    finally:
        stop(process)
    assert process.returncode is not None
    deadline = time.monotonic() + 30
    while (port_in_use(8000) or port_in_use(METRICS_EXPORT_PORT)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not port_in_use(8000), "the app still answers after make serve was stopped"
    assert not port_in_use(METRICS_EXPORT_PORT), "the Ray instance make serve started still runs"
