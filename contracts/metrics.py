"""Every Prometheus metric omniserve records: name, kind, labels, buckets and meaning, in one table.

The stages and the ingress record them through `ray.serve.metrics` (`stages.metrics`), so Ray adds its own
labels (`deployment`, `replica`, `application`) and exports them with its metrics: Ray's exporter puts its
namespace in front, so `omniserve_requests_total` is scraped as `ray_omniserve_requests_total`. The Grafana
dashboard in `examples/grafana/` uses these names only (a test checks it).

`make serve` fixes Ray's Prometheus endpoint at `METRICS_EXPORT_PORT` on the loopback (`cli.run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Where `make serve` exports Prometheus metrics: http://127.0.0.1:9464/metrics (OpenTelemetry's Prometheus port).
METRICS_EXPORT_PORT = 9464
#: What Ray's exporter puts before every application metric's name.
EXPORTED_PREFIX = "ray_"
#: How often a replica sets its gauges again: Ray exports a gauge only in a report interval (10 s by default) in
#: which it was set, and its agent forgets it two intervals later.
GAUGE_REFRESH_S = 5.0
#: The HTTP status classes requests are counted by.
STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
#: The route label of a request that matched none of the app's routes (its path would be unbounded).
UNMATCHED_ROUTE = "unmatched"

# Seconds: from a cached rewrite (milliseconds) to a long request on a loaded 2-core box.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["counter", "histogram", "gauge"]
    labels: tuple[str, ...]  # ours; Ray adds deployment, replica and application
    meaning: str
    buckets: tuple[float, ...] = ()  # histograms only

    @property
    def exported(self) -> str:
        """The name a Prometheus scrape of Ray's endpoint shows (a histogram adds _bucket, _sum and _count)."""
        return EXPORTED_PREFIX + self.name


#: The table, by name. `route` is the matched route's path (`UNMATCHED_ROUTE` for none), `status_class` one of
#: STATUS_CLASSES, `stage` "llm" or "diffusion", `method` the stage call (enhance, chat, generation, edit).
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "omniserve_requests_total",
            "counter",
            ("route", "status_class"),
            "HTTP requests the ingress answered, by route and status class",
        ),
        Metric(
            "omniserve_request_errors_total",
            "counter",
            ("route", "status_class"),
            "HTTP requests answered with a 4xx or 5xx, by route and status class",
        ),
        Metric(
            "omniserve_request_latency_seconds",
            "histogram",
            ("route", "status_class"),
            "end-to-end latency at the ingress, from the request's arrival to its response's last byte",
            LATENCY_BUCKETS_S,
        ),
        Metric("omniserve_requests_in_flight", "gauge", (), "HTTP requests the ingress replica is answering now"),
        Metric(
            "omniserve_stage_latency_seconds",
            "histogram",
            ("stage", "method"),
            "one stage call inside its replica, queueing there included",
            LATENCY_BUCKETS_S,
        ),
        Metric(
            "omniserve_diffusion_batch_size",
            "histogram",
            (),
            "per image: the most samples that shared one of its denoiser calls (the response's batch_size)",
            BATCH_SIZE_BUCKETS,
        ),
        Metric(
            "omniserve_diffusion_queue_wait_seconds",
            "histogram",
            (),
            "per image: from its arrival at the replica to joining the step engine's running batch",
            LATENCY_BUCKETS_S,
        ),
        Metric("omniserve_images_total", "counter", ("method",), "images the diffusion stage rendered"),
        Metric(
            "omniserve_llm_tokens_total", "counter", ("method",), "tokens the LLM stage generated (prompt excluded)"
        ),
        Metric(
            "omniserve_retries_total",
            "counter",
            ("call", "cause"),
            "stage calls the ingress sent again after an infrastructure failure (orchestration.retries)",
        ),
        Metric(
            "omniserve_result_cache_total",
            "counter",
            ("kind", "result"),
            "images (kind image) and chat completions (chat) looked up in the ingress's exact result cache: hit "
            "(answered from it) or miss (run)",
        ),
        Metric(
            "omniserve_diffusion_steps_computed_total",
            "counter",
            (),
            "denoising steps whose denoiser call held an image's rows (fewer than its steps with step caching)",
        ),
        Metric("omniserve_batch_invariant", "gauge", ("stage",), "the replica's batch-invariance switch: 1 on, 0 off"),
        Metric(
            "omniserve_kernel_backend",
            "gauge",
            ("stage", "backend"),
            "1 for the kernel backend the replica runs (cpu, vllm-cuda, none, ...)",
        ),
    )
}


def status_class(status: int) -> str:
    """200 -> "2xx"; anything outside 200-599 counts as a server error."""
    label = f"{status // 100}xx"
    return label if label in STATUS_CLASSES else "5xx"
