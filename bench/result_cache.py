"""The exact result cache under a load with repeats (`python -m bench.result_cache`).

Two apps on a local Ray instance over HTTP (loopback), both invariant, one diffusion replica each at one thread (the
scope records' setting: an unverified replica's images are never kept), rewriting off:
"cache" keeps results (`ingress.result_cache_mib`), "none" keeps none. Each run sends `requests` image requests at
`concurrency` in flight, each drawn from `distinct` (prompt, seed) pairs by a Zipf law (rank r with weight r^-s: a
few popular requests and a long tail, as repeated traffic looks), the same draw for both apps, the apps alternating
run by run. Per run: images/s, the hit rate, the median latency of hits and of misses (a hit's share of a render),
and whether every answer for one (prompt, seed) had one sha256, across runs and apps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from bench.load import spread
from bench.local_serve import local_serve
from evidence.report import environment

PROMPTS = [
    "a red circle",
    "a small blue square on a yellow background",
    "a green triangle, left",
    "a cyan ring, top",
    "a large yellow star on a black background",
    "a magenta circle on a white background, right",
]


def app_config(cache_mib: int, steps: int) -> dict:
    return {
        "llm": {
            "batch_invariant": True,
            "ray_actor_options": {"num_cpus": 0.1},
            "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1},
        },
        "diffusion": {
            "batch_invariant": True,
            "ray_actor_options": {"num_cpus": 1},
            "torch_threads": 1,
            "defaults": {"num_inference_steps": steps},
        },
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}, "result_cache_mib": cache_mib},
    }


def zipf_draw(requests: int, distinct: int, s: float, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pool = [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(distinct)]
    weights = [(rank + 1) ** -s for rank in range(distinct)]
    return rng.choices(pool, weights=weights, k=requests)


async def run(base: str, draw: list[tuple[str, int]], concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    answers: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(prompt: str, seed: int) -> None:
            async with gate:
                started = time.monotonic()
                response = await client.post(
                    "/v1/images/generations",
                    json={"prompt": prompt, "seed": seed, "size": "64x64", "enhance_prompt": False},
                )
                response.raise_for_status()
                item = response.json()["data"][0]
                answers.append(
                    {
                        "key": f"{prompt}|{seed}",
                        "sha256": item["sha256"],
                        "cache": item.get("cache"),
                        "latency_s": time.monotonic() - started,
                    }
                )

        started = time.monotonic()
        await asyncio.gather(*(one(p, s) for p, s in draw))
        wall = time.monotonic() - started
    hits = [a["latency_s"] for a in answers if a["cache"] == "hit"]
    misses = [a["latency_s"] for a in answers if a["cache"] != "hit"]
    return {
        "images_per_s": round(len(answers) / wall, 3),
        "hit_rate": round(len(hits) / len(answers), 3),
        "hit_p50_ms": round(statistics.median(hits) * 1000, 2) if hits else None,
        "render_p50_ms": round(statistics.median(misses) * 1000, 2),
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--distinct", type=int, default=40)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    from ray import serve

    from orchestration import build_app

    runs = []
    with local_serve(4, "bench-result-cache") as base:
        for repeat in range(args.repeats):
            draw = zipf_draw(args.requests, args.distinct, args.zipf, seed=repeat)
            for name in ("cache", "none") if repeat % 2 == 0 else ("none", "cache"):
                # An app of its own per run: its ingress starts with an empty cache.
                prefix = f"/{name}{repeat}"
                serve.run(
                    build_app(app_config(256 if name == "cache" else 0, args.steps)),
                    name=prefix[1:],
                    route_prefix=prefix,
                )
                asyncio.run(run(f"{base}{prefix}", [(PROMPTS[0], 1), (PROMPTS[1], 2)], 1))  # warm, outside the pool
                result = asyncio.run(run(f"{base}{prefix}", draw, args.concurrency))
                serve.delete(prefix[1:])
                runs.append({"repeat": repeat, "app": name, **result})
                print(
                    f"[bench result cache] repeat {repeat} {name}: {result['images_per_s']} images/s, hit rate "
                    f"{result['hit_rate']}, hit p50 {result['hit_p50_ms']} ms, render p50 {result['render_p50_ms']} ms"
                )
    report = summarize(runs, vars(args), environment(["python", "-m", "bench.result_cache", *(argv or [])]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    text = markdown(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)


def summarize(runs: list[dict], setup: dict, env: dict) -> dict:
    by_key: dict[str, set[str]] = {}
    for r in runs:
        for a in r["answers"]:
            by_key.setdefault(a["key"], set()).add(a["sha256"])
    cache = [r for r in runs if r["app"] == "cache"]
    none = [r for r in runs if r["app"] == "none"]
    return {
        "setup": setup,
        "speedup": spread([c["images_per_s"] / n["images_per_s"] for c, n in zip(cache, none, strict=True)]),
        "hit_rate": spread([c["hit_rate"] for c in cache]),
        "hit_share_of_render": spread([c["hit_p50_ms"] / c["render_p50_ms"] for c in cache if c["hit_p50_ms"]], 4),
        "one_sha256_per_request": all(len(v) == 1 for v in by_key.values()),
        "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs],
        "environment": env,
    }


def markdown(report: dict) -> str:
    rows = ["| repeat | app | images/s | hit rate | hit p50 ms | render p50 ms |", "|---|---|---|---|---|---|"]
    rows += [
        f"| {r['repeat']} | {r['app']} | {r['images_per_s']} | {r['hit_rate']} | {r['hit_p50_ms']} | "
        f"{r['render_p50_ms']} |"
        for r in report["runs"]
    ]
    return "\n".join(
        [
            "# The exact result cache under a Zipf load",
            "",
            f"setup: {report['setup']}",
            "",
            *rows,
            "",
            f"images/s with the cache / without (min/median/max): {report['speedup']}",
            f"a hit's median latency / a render's: {report['hit_share_of_render']}",
            f"every (prompt, seed) answered with one sha256 across runs and apps: {report['one_sha256_per_request']}",
            "",
        ]
    )


if __name__ == "__main__":
    main()
