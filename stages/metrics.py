"""Recording the metrics of `contracts.metrics` through `ray.serve.metrics`, from any replica of the app.

Each process builds a metric on its first use, inside its replica, so that Serve adds the replica's
`deployment`, `replica` and `application` labels. Outside Ray (tests, the audit) recording costs nothing
and goes nowhere. Labels are checked against the table: a missing or unknown one is a bug, raised at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from contracts.metrics import GAUGE_REFRESH_S, METRICS

if TYPE_CHECKING:
    from contracts.results import RenderedImage

RenderedT = TypeVar("RenderedT", bound="RenderedImage")
_built: dict[str, Any] = {}
_lock = threading.Lock()  # the step engine's thread and the event loop may build one at the same time
# Every gauge's latest value by (name, labels), set again every GAUGE_REFRESH_S: Ray exports a gauge only in the
# report interval in which it was set, and its agent drops it two intervals later.
_gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
_gauges_lock = threading.Lock()
_refresher: threading.Thread | None = None


def _metric(name: str):
    metric = _built.get(name)
    if metric is None:
        from ray.serve import metrics

        spec = METRICS[name]
        with _lock:
            metric = _built.get(name)
            if metric is None:
                if spec.kind == "histogram":
                    metric = metrics.Histogram(
                        name,
                        description=spec.meaning,
                        boundaries=list(spec.buckets),
                        tag_keys=spec.labels,  # type: ignore[arg-type]  # Ray annotates tuple[str]; takes any number
                    )
                else:
                    kind = metrics.Counter if spec.kind == "counter" else metrics.Gauge
                    # Ray annotates tag_keys as tuple[str]; it takes any number of keys.
                    metric = kind(name, description=spec.meaning, tag_keys=spec.labels)  # type: ignore[arg-type]
                _built[name] = metric
    return metric


def record(name: str, value: float = 1.0, **labels: Any) -> None:
    """Add to a counter, observe into a histogram or set a gauge, by the table's kind for `name`."""
    spec = METRICS[name]
    if set(labels) != set(spec.labels):
        raise ValueError(f"{name} takes labels {spec.labels}, got {tuple(labels)}")
    metric, tags = _metric(name), {key: str(text) for key, text in labels.items()} or None
    if spec.kind == "counter":
        metric.inc(value, tags=tags)
    elif spec.kind == "histogram":
        metric.observe(value, tags=tags)
    else:
        metric.set(value, tags=tags)
        _keep(name, value, tags)


def _keep(name: str, value: float, tags: dict[str, str] | None) -> None:
    global _refresher
    import ray

    with _gauges_lock:
        _gauges[(name, tuple(sorted((tags or {}).items())))] = value
        if _refresher is None and ray.is_initialized():  # outside Ray there is nothing to export to
            _refresher = threading.Thread(target=_refresh_gauges, name="omniserve-gauges", daemon=True)
            _refresher.start()


def _refresh_gauges() -> None:
    while True:
        time.sleep(GAUGE_REFRESH_S)
        with _gauges_lock:
            kept = list(_gauges.items())
        for (name, labels), value in kept:
            _metric(name).set(value, tags=dict(labels) or None)


@contextlib.contextmanager
def timed_stage_call(stage: str, method: str) -> Iterator[None]:
    """Observe one stage call's seconds into `omniserve_stage_latency_seconds`, failed calls included."""
    started = time.monotonic()
    try:
        yield
    finally:
        record("omniserve_stage_latency_seconds", time.monotonic() - started, stage=stage, method=method)


def record_switch_state(stage: str, batch_invariant: bool, kernel_backend: str) -> None:
    """This replica's switch (1/0) and kernel backend, set once at start-up: Ray exports them for as long as it lives."""
    record("omniserve_batch_invariant", float(bool(batch_invariant)), stage=stage)
    record("omniserve_kernel_backend", 1.0, stage=stage, backend=kernel_backend)


def image_counted(method: str, image: RenderedT) -> RenderedT:
    """A rendered image, counted into `omniserve_images_total` and its batch size observed."""
    record("omniserve_images_total", method=method)
    record("omniserve_diffusion_batch_size", image.batch_size)
    record("omniserve_diffusion_steps_computed_total", image.steps_computed)
    return image


def record_queue_wait(sample: Any) -> None:
    """A step-engine sample's wait from its arrival to joining the running batch (none when it never joined)."""
    if sample.joined_at is not None:
        record("omniserve_diffusion_queue_wait_seconds", sample.joined_at - sample.created_at)
