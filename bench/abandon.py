"""A small request right after big ones whose clients gave up, on the whole app over real HTTP.

Per batching mode the app (`build_app({"diffusion": {"batching": mode}})`, everything else default) runs on a
local Ray of our own (loopback, a free port; stopped at the end). Each trial:

  1. one small request (1 step, 64x64) on the idle app: `solo_s`;
  2. `big_requests` requests (n=8, 256x256, 50 steps) from clients that give up after `give_up_s`: the
     client closes its connection, Serve cancels the request, the ingress cancels its images;
  3. at once, the same small request again: `after_abandon_s` (the issue's figure: 12 s before the engine);
  4. the replica settles: `/health` shows no sample in the step engine (`engine_idle_s`, step mode; with
     `forwards` the steps the engine still ran for the abandoned work), and a small probe answers as fast as
     when idle (`settled_s`: how long abandoned work kept the replica busy).

`build_app` is handed in by the caller (`omniserve bench`), so `stages` does not import `orchestration`.
Every request sets `enhance_prompt: false`: the figure is the diffusion stage's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx

from bench.load import all_cores, spread
from bench.local_serve import local_serve
from evidence.report import environment

if TYPE_CHECKING:
    from ray.serve import Application


@dataclass(frozen=True)
class AbandonSpec:
    """One trial: `big_requests` requests of `big_n` images abandoned after `give_up_s`, then the small one timed."""

    big_requests: int = 4  # the abandoned work: the four n=8, 256x256, 50-step requests
    big_n: int = 8
    big_size: int = 256
    big_steps: int = 50
    give_up_s: float = 1.0  # when each big request's client closes its connection
    small_steps: int = 1  # the small request timed right after
    small_size: int = 64
    trials: int = 3
    settle_timeout_s: float = 600.0  # bound on waiting for the replica to be idle between trials


def image_body(prompt: str, *, n: int, size: int, steps: int, seed: int) -> dict:
    return {
        "prompt": prompt,
        "n": n,
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "seed": seed,
        "enhance_prompt": False,
        "response_format": "b64_json",
    }


class Client:
    """The bench's HTTP side: timed small requests, abandoned big ones, the diffusion stage's /health details."""

    def __init__(self, base: str, spec: AbandonSpec):
        self.base, self.spec = base, spec

    async def small(self, seed: int = 7) -> tuple[float, str]:
        body = image_body("a small request", n=1, size=self.spec.small_size, steps=self.spec.small_steps, seed=seed)
        start = time.perf_counter()
        async with httpx.AsyncClient(base_url=self.base, timeout=self.spec.settle_timeout_s) as client:
            response = await client.post("/v1/images/generations", json=body)
        response.raise_for_status()
        return time.perf_counter() - start, response.json()["data"][0]["sha256"]

    async def abandon(self, first_seed: int) -> int:
        """Send the big requests; each client gives up after `give_up_s` and closes its connection. -> how many gave up."""

        async def one(index: int) -> bool:
            body = image_body(
                f"a big abandoned request {index}",
                n=self.spec.big_n,
                size=self.spec.big_size,
                steps=self.spec.big_steps,
                seed=first_seed + index,
            )
            async with httpx.AsyncClient(base_url=self.base, timeout=self.spec.give_up_s) as client:
                try:
                    await client.post("/v1/images/generations", json=body)
                except httpx.TimeoutException:
                    return True
            return False

        return sum(await asyncio.gather(*(one(i) for i in range(self.spec.big_requests))))

    async def diffusion(self) -> dict:
        """The diffusion stage in /health: its switch, and one replica's public details under `describe`."""
        async with httpx.AsyncClient(base_url=self.base, timeout=60) as client:
            health = (await client.get("/health")).json()
        return health["stages"]["diffusion"]

    async def batching(self) -> dict:
        """Its batching details: mode, in_flight, and the step engine's counters (waiting, active, forwards)."""
        return (await self.diffusion())["describe"]["details"]["batching"]


async def settle(client: Client, solo_s: float, started: float) -> dict:
    """Wait until the engine holds no sample (step mode) and a probe answers within 3x the idle time (min 0.5 s)."""
    deadline = started + client.spec.settle_timeout_s
    engine_idle_s = None
    while time.perf_counter() < deadline:
        state = await client.batching()
        if "active" not in state or state["active"] + state["waiting"] == 0:
            engine_idle_s = round(time.perf_counter() - started, 2) if "active" in state else None
            break
        await asyncio.sleep(0.2)
    while time.perf_counter() < deadline:
        probe_s, _ = await client.small(seed=8)
        if probe_s <= max(0.5, 3 * solo_s):
            break
    return {
        "engine_idle_s": engine_idle_s,
        "settled_s": round(time.perf_counter() - started, 2),
        "forwards_after": (await client.batching()).get("forwards"),
    }


async def trial(client: Client, number: int) -> dict:
    before = await client.batching()
    solo_s, solo_sha = await client.small()
    gave_up = await client.abandon(first_seed=1000 * number)
    given_up_at = time.perf_counter()
    after_s, after_sha = await client.small()
    settled = await settle(client, solo_s, given_up_at)
    forwards = settled.pop("forwards_after")
    return {
        "trial": number,
        "solo_s": round(solo_s, 3),
        "gave_up": gave_up,
        "after_abandon_s": round(after_s, 3),
        **settled,
        "forwards_during_trial": None if forwards is None else forwards - before.get("forwards", 0),
        "same_bytes": solo_sha == after_sha,
    }


def run_abandon(
    build_app: Callable[[dict], Application],
    spec: AbandonSpec,
    *,
    modes: Sequence[str] = ("step", "request"),
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    from ray import serve

    runs, stage_info = [], {}
    with local_serve(all_cores(), "omniserve-bench") as base:
        for mode in modes:
            started = time.perf_counter()
            serve.run(build_app({"diffusion": {"batching": mode}}), name="omniserve-bench", route_prefix="/")
            log(f"[bench] app with {mode} batching running after {time.perf_counter() - started:.0f} s")
            client = Client(base, spec)
            described = asyncio.run(client.diffusion())
            stage_info[mode] = {
                "batch_invariant": described["batch_invariant"],
                "torch_threads": described["describe"]["details"]["torch_threads"],
                "batching": described["describe"]["details"]["batching"],
            }
            for number in range(spec.trials):
                runs.append({"mode": mode, **asyncio.run(trial(client, number))})
                log(f"[bench] {mode} trial {number}: {runs[-1]}")
            serve.delete("omniserve-bench")
    return summarize(runs, spec, modes, stage_info, environment(command))


def summarize(runs: list[dict], spec: AbandonSpec, modes: Sequence[str], stage_info: dict, environment: dict) -> dict:
    summary: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: spread([r[key] for r in mine]) for key in ("solo_s", "after_abandon_s", "settled_s")}
        summary[mode]["after_abandon_under_2s"] = all(r["after_abandon_s"] < 2.0 for r in mine)
    return {
        "kind": "abandoned",
        "spec": asdict(spec),
        "stages": stage_info,
        "runs": runs,
        "summary": summary,
        "environment": environment,
    }


def markdown(report: dict) -> str:
    spec, env = report["spec"], report["environment"]
    lines = [
        f"Default app over HTTP (local Ray, loopback), `enhance_prompt: false`. Per trial: a {spec['small_steps']}-step "
        f"{spec['small_size']}x{spec['small_size']} request on the idle app, then {spec['big_requests']} requests of n={spec['big_n']}, "
        f"{spec['big_size']}x{spec['big_size']}, {spec['big_steps']} steps whose clients give up after {spec['give_up_s']} s, "
        f"then the small request again; {spec['trials']} trials per mode.",
        "Diffusion stage: "
        + "; ".join(
            f"{mode}: batch_invariant {info['batch_invariant']}, torch threads {info['torch_threads']}, "
            f"max_batch_size {info['batching']['max_batch_size']}"
            for mode, info in report["stages"].items()
        )
        + ".",
        f"Hardware: {env['hardware']['cpu']}, {env['hardware']['usable_cpus']} usable CPUs. Command: `{env['command']}`",
        "",
        "| mode | trial | idle s | after abandonment s | engine empty after s | replica settled after s | engine forwards in trial |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['mode']} | {r['trial']} | {r['solo_s']} | {r['after_abandon_s']} | "
            f"{'-' if r['engine_idle_s'] is None else r['engine_idle_s']} | {r['settled_s']} | "
            f"{'-' if r['forwards_during_trial'] is None else r['forwards_during_trial']} |"
        )
    return "\n".join(lines) + "\n"
