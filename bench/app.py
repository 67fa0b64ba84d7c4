"""The whole app with batch invariance off vs on, over real HTTP: images/s and latency, with and without rewriting.

Two apps run side by side on one Serve instance, built by `build_app` from the same config: one with both
stages' `batch_invariant` on, one with both off (`/bench-on`, `/bench-off`). They are driven alternately
(per repeat and rewrite setting, off and on back to back, the order flipping per repeat), each point a closed
loop of `requests` image requests (n=1, seeded) at `concurrency`, `enhance_prompt` true (LLM rewrite, then
diffusion) or false (diffusion only). Only one app works at a time; the other sits idle.

Ray: when none is connected, a local one of our own on the loopback (a free port), stopped at the end;
its CPU count, a scheduling label, is raised when needed so that both apps place with the reservations each
would get alone. When Ray is already connected, its Serve instance is used and left running.

    omniserve bench --stage app --json bench-app.json --markdown bench-app.md --picture bench-app.png
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from bench import paired as bench_paired
from bench.abandon import image_body
from bench.load import all_cores
from bench.local_serve import local_serve
from bench.paired import SETTINGS, closed_loop, setting_orders
from bench.plot import ratio_picture
from evidence.report import environment
from orchestration.config import AppConfig

if TYPE_CHECKING:
    from ray.serve import Application


@dataclass(frozen=True)
class AppBenchSpec:
    requests: int = 96  # per point (one setting, one rewrite setting, one concurrency, one repeat)
    concurrency: Sequence[int] = (16,)
    size: int = 64
    steps: int = 8
    repeats: int = 3
    rewrites: Sequence[bool] = (False, True)  # enhance_prompt values measured
    app: dict = field(default_factory=dict)  # the app config both apps share (each sets both stages' switch)
    timeout_s: float = 600.0  # bound on one HTTP request


def app_config(spec: AppBenchSpec, setting: str) -> dict:
    """The shared app config with both stages' switch set to `setting`."""
    config = copy.deepcopy(spec.app)
    for stage in ("llm", "diffusion"):
        config.setdefault(stage, {})["batch_invariant"] = setting == "on"
    return config


def reserved_cpus(config: Mapping[str, Any]) -> float:
    """The CPUs one app's replicas reserve in Ray (autoscaling: at its maximum)."""
    app = AppConfig.model_validate(config)
    total = 0.0
    for part in app.parts:
        deployment = app.deployment(part)
        scaling = deployment.autoscaling_config or {}
        replicas = (
            scaling.get("max_replicas", deployment.num_replicas or 1) if scaling else deployment.num_replicas or 1
        )
        total += replicas * float(deployment.ray_actor_options.get("num_cpus", 1))
    return total


@contextlib.contextmanager
def serving(num_cpus: float) -> Iterator[str]:
    """The base URL of a Serve HTTP proxy: the connected Ray's, else a local Ray of ours (stopped at the end)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        from ray.serve.context import _get_global_client

        serve.start()  # the running instance, if any
        client = _get_global_client()  # raises rather than answer None when no controller runs
        assert client is not None
        http = client.http_config  # Serve has no public getter for its proxy's address
        yield f"http://{http.host}:{http.port}"
        return
    with local_serve(max(all_cores(), math.ceil(num_cpus)), "omniserve-bench") as base:
        yield base


def image_call(client: httpx.AsyncClient, spec: AppBenchSpec, rewrite: bool, seed_base: int) -> Callable:
    """call(i) -> images in the answer to request i (seed seed_base + i)."""

    async def call(index: int) -> int:
        body = {
            **image_body(
                f"a benchmark image, number {index}", n=1, size=spec.size, steps=spec.steps, seed=seed_base + index
            ),
            "enhance_prompt": rewrite,
        }
        response = await client.post("/v1/images/generations", json=body)
        response.raise_for_status()
        return len(response.json()["data"])

    return call


async def _point(
    base: str, setting: str, spec: AppBenchSpec, rewrite: bool, concurrency: int, *, seed_base: int, requests: int
) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"{base}/bench-{setting}", timeout=spec.timeout_s, limits=limits) as client:
        return await closed_loop(
            image_call(client, spec, rewrite, seed_base), requests=requests, concurrency=concurrency
        )


async def _measure(base: str, spec: AppBenchSpec, log: Callable[[str], None]) -> list[dict]:
    top = max(spec.concurrency)
    for setting in SETTINGS:  # untimed: first calls, both stages, every batch size up to the top concurrency
        for rewrite in spec.rewrites:
            await _point(base, setting, spec, rewrite, top, seed_base=10**6, requests=min(spec.requests, 2 * top))
    runs = []
    for repeat, order in enumerate(setting_orders(spec.repeats)):
        for rewrite in spec.rewrites:
            for concurrency in spec.concurrency:
                for setting in order:
                    point = await _point(
                        base, setting, spec, rewrite, concurrency, seed_base=1000 * repeat, requests=spec.requests
                    )
                    runs.append(_run(repeat, setting, rewrite, point))
                    log(
                        f"[bench app] repeat {repeat} rewrite {runs[-1]['rewrite']} concurrency {concurrency} "
                        f"invariance {setting}: {runs[-1]['images_per_s']} images/s, p50 {point['p50_s']} s, "
                        f"p95 {point['p95_s']} s"
                    )
    return runs


def _run(repeat: int, setting: str, rewrite: bool, point: dict) -> dict:
    images = point.pop("units")
    point.pop("units_per_s")
    return {
        "repeat": repeat,
        "setting": setting,
        "rewrite": "on" if rewrite else "off",
        **point,
        "images": images,
        "images_per_s": round(images / point["wall_s"], 3),
    }


async def _switches(base: str, setting: str) -> dict:
    """What the app itself reports of each stage's switch (/health), checked against the setting."""
    async with httpx.AsyncClient(base_url=f"{base}/bench-{setting}", timeout=60) as client:
        health = (await client.get("/health")).json()
    found = {stage: health["stages"][stage]["batch_invariant"] for stage in ("llm", "diffusion")}
    if set(found.values()) != {setting == "on"}:
        raise RuntimeError(f"the {setting} app reports switches {found}")
    return {
        stage: {"batch_invariant": s["batch_invariant"], "state": s.get("state")}
        for stage, s in health["stages"].items()
    }


def run_app_bench(
    build_app: Callable[[dict], Application],
    spec: AppBenchSpec,
    *,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Deploy both apps, measure every point and repeat, delete them -> the report (`markdown`, `picture`)."""
    from ray import serve

    started = time.time()
    env = environment(command)
    with serving(sum(reserved_cpus(app_config(spec, s)) for s in SETTINGS) + 0.5) as base:
        try:
            began = time.perf_counter()  # both at once: their replicas start side by side
            serve.run_many(
                [
                    serve.RunTarget(
                        build_app(app_config(spec, s)), name=f"omniserve-bench-{s}", route_prefix=f"/bench-{s}"
                    )
                    for s in SETTINGS
                ]
            )
            log(f"[bench app] both apps running after {time.perf_counter() - began:.0f} s")
            stages = {setting: asyncio.run(_switches(base, setting)) for setting in SETTINGS}
            runs = asyncio.run(_measure(base, spec, log))
        finally:
            for setting in SETTINGS:
                with contextlib.suppress(Exception):  # not deployed when the other one failed to start
                    serve.delete(f"omniserve-bench-{setting}")
    env["seconds"] = round(time.time() - started, 1)
    report: dict[str, Any] = {
        "kind": "app",
        "spec": {**asdict(spec), "rewrites": list(spec.rewrites), "concurrency": list(spec.concurrency)},
        "stages": stages,
        "runs": runs,
        "summary": {},
        "ratios": {},
        "environment": env,
    }
    for rewrite in ("off", "on"):  # per rewrite setting: figures per invariance setting and concurrency
        mine = [r for r in runs if r["rewrite"] == rewrite]
        if mine:
            report["summary"][rewrite], report["ratios"][rewrite] = bench_paired.summarize(
                mine, point="concurrency", rate="images_per_s"
            )
    with_rewriting = report["ratios"].get("on", {})
    if with_rewriting:
        report["targets"] = {
            "images_per_s_on_over_off_with_rewriting_at_least_0.9": all(
                r["images_per_s_on_over_off"]["median"] >= 0.9 for r in with_rewriting.values()
            )
        }
    return report


def markdown(report: dict) -> str:
    spec, env = report["spec"], report["environment"]
    lines = [
        f"The app over HTTP (local Serve, loopback), two apps side by side: both stages' invariance off vs both on. "
        f"{spec['requests']} requests per point (n=1, {spec['size']}x{spec['size']}, {spec['steps']} steps, seeded) at "
        f"concurrency {', '.join(map(str, spec['concurrency']))}; {spec['repeats']} repeats alternating off/on.",
        f"App config beside the switches: `{spec['app'] or 'defaults'}`.",
        *bench_paired.environment_lines(env),
    ]
    for rewrite, ratios in report["ratios"].items():
        lines += [
            "",
            f"Prompt rewriting (`enhance_prompt`) {rewrite}:",
            "",
            *bench_paired.markdown_rows(
                report["summary"][rewrite], ratios, point="concurrency", rate="images_per_s", rate_label="images/s"
            ),
        ]
    if "targets" in report:
        lines.append(
            "Targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items()) + "."
        )
    return "\n".join(lines) + "\n"


def picture(report: dict, path: str) -> None:

    spec = report["spec"]
    series = {
        f"rewrite {rewrite}": [(int(c), r["images_per_s_on_over_off"]) for c, r in ratios.items()]
        for rewrite, ratios in report["ratios"].items()
    }
    ratio_picture(
        path,
        title=f"the app over HTTP, images/s invariance on / off; {spec['repeats']} repeats paired, median, "
        "whiskers min-max",
        x_label="concurrency",
        series=series,
    )
