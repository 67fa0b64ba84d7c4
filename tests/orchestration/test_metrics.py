"""Prometheus metrics: the table (contracts.metrics), what the ingress and the stages record, and Ray's export of it.

The slow test drives the package's app ("main": both switches on; "off": the diffusion switch off) with 20 requests
and scrapes the session Ray's Prometheus endpoint until every series is there with its labels, from both stages.
The fast tests run without Ray: there, recording goes nowhere, so they spy on `record` to see what would be sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from contracts.metrics import EXPORTED_PREFIX, METRICS, status_class

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "omniserve-dashboard.json"
SCRAPE_DEADLINE_S = 90  # Ray's metrics agent exports every 10 s by default


# --- the table and the recorder (no Ray) ------------------------------------------------------------


def test_every_metric_is_named_omniserve_and_histograms_have_increasing_buckets():
    for name, metric in METRICS.items():
        assert name == metric.name and name.startswith("omniserve_") and metric.exported == EXPORTED_PREFIX + name
        assert metric.kind in ("counter", "histogram", "gauge")
        assert name.endswith("_total") == (metric.kind == "counter"), name
        assert bool(metric.buckets) == (metric.kind == "histogram") and list(metric.buckets) == sorted(set(metric.buckets))


@pytest.mark.parametrize("status, label", [(200, "2xx"), (204, "2xx"), (307, "3xx"), (400, "4xx"), (499, "4xx"),
                                           (503, "5xx"), (504, "5xx"), (600, "5xx")])
def test_status_codes_are_counted_by_class(status, label):
    assert status_class(status) == label


def test_recording_with_a_missing_or_unknown_label_is_refused_naming_the_labels():
    from stages.metrics import record

    with pytest.raises(ValueError, match="route"):
        record("omniserve_requests_total", status_class="2xx")
    with pytest.raises(ValueError, match="status_class"):
        record("omniserve_requests_total", route="/health", status_class="2xx", extra="x")
    record("omniserve_requests_total", route="/health", status_class="2xx")  # outside Ray: recorded nowhere, no error


@pytest.fixture
def recorded(monkeypatch):
    """What would be sent to Ray: (name, value, labels) per call of `stages.metrics.record`."""
    import orchestration.metrics
    import orchestration.retries

    calls: list[tuple[str, float, dict]] = []

    def spy(name, value=1.0, **labels):
        calls.append((name, value, labels))

    monkeypatch.setattr(orchestration.metrics, "record", spy)
    monkeypatch.setattr(orchestration.retries, "record", spy)
    return calls


def test_the_ingress_middleware_counts_each_answer_by_its_route_template_and_status_class(recorded):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from orchestration.metrics import RequestMetrics

    api = FastAPI()
    api.add_middleware(RequestMetrics)

    @api.post("/v1/images/generations")
    async def refused():
        return JSONResponse({"error": {}}, status_code=400)

    @api.get("/health")
    async def fine():
        return {}

    with TestClient(api) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/images/generations").status_code == 400
        assert client.get("/no/such/path/42").status_code == 404
    counted = [(labels["route"], labels["status_class"]) for name, _, labels in recorded if name == "omniserve_requests_total"]
    assert counted == [("/health", "2xx"), ("/v1/images/generations", "4xx"), ("unmatched", "4xx")]
    errors = [labels["route"] for name, _, labels in recorded if name == "omniserve_request_errors_total"]
    assert errors == ["/v1/images/generations", "unmatched"]
    in_flight = [value for name, value, _ in recorded if name == "omniserve_requests_in_flight"]
    assert in_flight == [1, 0, 1, 0, 1, 0]


def test_a_retried_stage_call_is_counted_with_its_call_and_cause(recorded):
    from ray.exceptions import ActorUnavailableError
    from ray.serve.exceptions import ReplicaUnavailableError

    from orchestration.retries import Retrying

    # Serve's ReplicaUnavailableError (its replica died under the call) is no RayActorError: retried all the same.
    failures = iter([ActorUnavailableError("the replica is gone", None), ReplicaUnavailableError("gone too")])

    async def send():
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "rendered"

    assert asyncio.run(Retrying(10.0, 0.0).call("a render", send)) == "rendered"
    assert recorded == [("omniserve_retries_total", 1.0, {"call": "a render", "cause": cause})
                        for cause in ("ActorUnavailableError", "ReplicaUnavailableError")]


# --- the Grafana dashboard ---------------------------------------------------------------------------


def exported_names_in(expression: str) -> set[str]:
    return set(re.findall(r"\b" + EXPORTED_PREFIX + r"omniserve_\w+", expression))


def test_the_grafana_dashboard_parses_and_uses_only_metrics_the_code_defines_and_all_of_them():
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    used = set().union(*map(exported_names_in, expressions))
    defined = {}
    for metric in METRICS.values():
        suffixes = ("_bucket", "_sum", "_count") if metric.kind == "histogram" else ("",)
        defined.update({metric.exported + suffix: metric.name for suffix in suffixes})
    assert used and used <= set(defined), f"not defined by contracts/metrics.py: {sorted(used - set(defined))}"
    assert {defined[name] for name in used} == set(METRICS), "a metric without a panel"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


# --- Ray's export, after real traffic (slow) ---------------------------------------------------------


def scrape(port: int) -> list:
    """Every omniserve sample Ray's endpoint shows now: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(EXPORTED_PREFIX + "omniserve_")]


def find(samples, name: str, **labels) -> list:
    return [s for s in samples if s[0] == EXPORTED_PREFIX + name and labels.items() <= s[1].items()]


def traffic(server: str) -> list[int]:
    """20 requests, 4 at a time: 8 images with a rewrite, 8 without, 3 chats, 1 refused."""
    bodies = [("/v1/images/generations", {"prompt": f"a fox {i}", "seed": i, "size": "64x64",
                                          "enhance_prompt": i % 2 == 0}) for i in range(16)]
    bodies += [("/v1/chat/completions", {"messages": [{"role": "user", "content": "a fox"}], "max_tokens": 4, "seed": i})
               for i in range(3)]
    bodies += [("/v1/images/generations", {"prompt": "no seed under invariance", "size": "64x64"})]
    with httpx.Client(base_url=server, timeout=180) as client, ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda pair: client.post(pair[0], json=pair[1]).status_code, bodies))


def images_of_main(samples) -> float:
    return sum(s[2] for s in find(samples, "omniserve_images_total", method="generation", application="main"))


def missing_series(samples, images_before: float) -> list[str]:
    """What the scrape lacks of what the traffic must have produced, app "main" ("off" for one switch at 0)."""
    main, ingress = {"application": "main"}, {"application": "main", "deployment": "Ingress"}
    llm, diffusion = {**main, "deployment": "LLMStage"}, {**main, "deployment": "DiffusionStage"}
    expected = {
        "requests 2xx": find(samples, "omniserve_requests_total", route="/v1/images/generations", status_class="2xx", **ingress),
        "chat 2xx": find(samples, "omniserve_requests_total", route="/v1/chat/completions", status_class="2xx", **ingress),
        "errors 4xx": find(samples, "omniserve_request_errors_total", route="/v1/images/generations", status_class="4xx", **ingress),
        "latency": find(samples, "omniserve_request_latency_seconds_bucket", route="/v1/images/generations", **ingress),
        "in flight": find(samples, "omniserve_requests_in_flight", **ingress),
        "llm latency": find(samples, "omniserve_stage_latency_seconds_count", stage="llm", method="enhance", **llm),
        "chat latency": find(samples, "omniserve_stage_latency_seconds_count", stage="llm", method="chat", **llm),
        "diffusion latency": find(samples, "omniserve_stage_latency_seconds_count", stage="diffusion", method="generation", **diffusion),
        "batch size": find(samples, "omniserve_diffusion_batch_size_bucket", **diffusion),
        "queue wait": find(samples, "omniserve_diffusion_queue_wait_seconds_bucket", **diffusion),
        "tokens": [s for s in find(samples, "omniserve_llm_tokens_total", method="enhance", **llm) if s[2] > 0],
        "llm switch on": find(samples, "omniserve_batch_invariant", stage="llm", **llm),
        "diffusion switch on": find(samples, "omniserve_batch_invariant", stage="diffusion", **diffusion),
        "diffusion switch off": find(samples, "omniserve_batch_invariant", stage="diffusion", application="off"),
        "llm kernels": find(samples, "omniserve_kernel_backend", stage="llm", **llm),
        "diffusion kernels": find(samples, "omniserve_kernel_backend", stage="diffusion", **diffusion),
    }
    counted = images_of_main(samples) >= images_before + 16  # earlier tests' images may be in `images_before` or not yet
    return [what for what, found in expected.items() if not found] + ([] if counted else ["16 more images"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_after_20_requests_rays_prometheus_endpoint_has_every_series_with_its_labels_from_both_stages(server):
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    images_before = images_of_main(scrape(port))
    statuses = traffic(server)
    assert statuses.count(200) == 19 and statuses[-1] == 400, statuses
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while (missing := missing_series(samples := scrape(port), images_before)) and time.monotonic() < deadline:
        time.sleep(2)
    assert not missing, f"not exported after {SCRAPE_DEADLINE_S} s: {missing}"
    assert {s[2] for s in find(samples, "omniserve_batch_invariant", application="main")} == {1.0}
    assert {s[2] for s in find(samples, "omniserve_batch_invariant", application="off", stage="diffusion")} == {0.0}
    backends = {s[1]["backend"] for s in find(samples, "omniserve_kernel_backend", application="main", stage="diffusion")}
    assert backends and "none" not in backends  # invariance on: a real kernel backend
    replicas = {s[1]["replica"] for s in find(samples, "omniserve_batch_invariant", application="main", stage="diffusion")}
    assert len(replicas) >= 2, "one switch gauge per diffusion replica (a replaced one's lingers for two report intervals)"


def test_make_serves_launcher_refuses_a_taken_metrics_port_at_once_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "cli.run", "--metrics-port", str(port), "examples.omni_app:app"],
                              capture_output=True, text=True, timeout=60, cwd=DASHBOARD.parents[2])
    assert done.returncode == 2 and f"port {port} is in use" in done.stderr and "METRICS_PORT" in done.stderr
