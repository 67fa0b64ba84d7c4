"""Where time goes in the whole app with prompt rewriting (real Serve app, real HTTP on loopback).

    .venv/bin/python scripts/app_profile.py OUT.json NAME=CONFIG_JSON [NAME=CONFIG_JSON ...] [--repeats 3]

Per config: the app is started (`build_app(config)`, local Ray of our own, all cores, Serve on a free loopback
port), warmed (16 requests), then per repeat 96 requests at concurrency 16 (64x64, 8 steps, distinct prompts and
seeds, enhance_prompt true). Configs alternate per repeat round (app restarted at each switch). Recorded: images/s,
latency, the diffusion stage's co-batching (each image's batch_size), /health sampled at 2 Hz (diffusion engine
active/waiting: the share of samples with no active sample is the engine's idle share), the LLM stage's counters in
/health (when it exposes them), and CPU seconds per process (by process title) over the timed window.
"""

import asyncio
import json
import os
import socket
import statistics
import sys
import time
from collections import Counter, defaultdict

import httpx
import psutil

N, CONC, SIZE, STEPS = 96, 16, 64, 8


def label(p):
    try:
        name = " ".join(p.cmdline())[:80]
    except Exception:
        return None
    for key in (
        "VLLM::Worker",
        "LLMStage",
        "DiffusionStage",
        "Ingress",
        "ProxyActor",
        "ServeController",
        "EngineCore",
        "VLLM",
        "raylet",
        "gcs_server",
        "dashboard",
        "ray::",
        "python",
    ):
        if key in name:
            return key
    return "other"


def cpu_snapshot():
    out = {}
    # Only this script and what it started (Ray's processes are its descendants with address="local").
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (label(p), t.user + t.system)
        except Exception:
            pass
    return out


def cpu_diff(a, b):
    d = defaultdict(float)
    for pid, (lab, t) in b.items():
        d[lab] += t - (a.get(pid, (lab, 0.0))[1])
    return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0.05}


async def health(client):
    return (await client.get("/health")).json()


async def sampler(client, stop, samples):
    while not stop.is_set():
        try:
            h = await health(client)
            b = h["stages"]["diffusion"]["describe"]["details"]["batching"]
            samples.append((b.get("active", 0), b.get("waiting", 0)))
        except Exception:
            pass
        await asyncio.sleep(0.5)


POOL = 0  # --pool K: request i asks for pair (i * 7) % K of K distinct (prompt, seed) pairs; 0: all distinct


async def load(base, first_seed, n=N, conc=CONC, enhance=True, prompts=None):
    sem = asyncio.Semaphore(conc)
    lat, batch, shas = [], [], {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(i):
            k = (i * 7) % POOL if POOL and n == N else i
            body = {
                "prompt": prompts[k] if prompts else f"a quiet lake number {first_seed + k} under the sky",
                "n": 1,
                "size": f"{SIZE}x{SIZE}",
                "num_inference_steps": STEPS,
                "seed": first_seed + k,
                "enhance_prompt": enhance,
                "response_format": "b64_json",
            }
            async with sem:
                t = time.perf_counter()
                r = await client.post("/v1/images/generations", json=body)
                r.raise_for_status()
                lat.append(time.perf_counter() - t)
                data = r.json()["data"][0]
                batch.append(data["batch_size"])
                shas[first_seed + k] = (data["sha256"], data["revised_prompt"])

        stop, samples = asyncio.Event(), []
        s = asyncio.create_task(sampler(client, stop, samples))
        await health(client)  # the stage is answering before the clock starts
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        el = time.perf_counter() - t
        stop.set()
        await s
        h1 = await health(client)
    idle = sum(1 for a, w in samples if a == 0) / max(1, len(samples))
    return {
        "images_per_s": round(n / el, 2),
        "elapsed_s": round(el, 2),
        "lat_p50": round(statistics.median(lat), 3),
        "lat_max": round(max(lat), 3),
        "diffusion_batch_size": dict(sorted(Counter(batch).items())),
        "diffusion_idle_share": round(idle, 3),
        "diffusion_active_mean": round(statistics.mean(a for a, _ in samples), 2) if samples else None,
        "diffusion_waiting_mean": round(statistics.mean(w for _, w in samples), 2) if samples else None,
        "rewrite_cache": h1.get("ingress", {}).get("rewrite_cache"),
        "shas": shas,
    }


def llm_rewrites():
    from ray import serve

    details = serve.get_deployment_handle("LLMStage", app_name="balance").describe.remote().result().details
    return details.get("rewrites") or {}


def delta(a, b, wall):
    d = {k: round(b[k] - a.get(k, 0), 3) for k in b}
    if d.get("rewrites"):
        d["tokens_per_rewrite"] = round(d["completion_tokens"] / d["rewrites"], 2)
        d["rewrites_in_engine_mean"] = round(d["engine_s"] / wall, 2)  # Little's law over the window
        d["engine_s_per_rewrite"] = round(d["engine_s"] / d["rewrites"], 3)
    return d


def main():
    import ray
    from ray import serve

    from evidence.report import environment
    from orchestration import build_app

    out = sys.argv[1]
    args = sys.argv[2:]
    repeats = 3
    global POOL
    if "--pool" in args:
        i = args.index("--pool")
        POOL = int(args[i + 1])
        del args[i : i + 2]
    if "--repeats" in args:
        i = args.index("--repeats")
        repeats = int(args[i + 1])
        del args[i : i + 2]
    configs = [(a.split("=", 1)[0], json.loads(a.split("=", 1)[1])) for a in args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    ray.init(
        address="local",
        num_cpus=len(os.sched_getaffinity(0)),
        include_dashboard=False,
        log_to_driver=False,
        namespace="balance-profile",
        _node_ip_address="127.0.0.1",
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs = []
    try:
        for rep in range(repeats):
            order = configs if rep % 2 == 0 else configs[::-1]
            for name, cfg in order:
                t = time.perf_counter()
                serve.run(build_app(cfg), name="balance", route_prefix="/")
                startup = time.perf_counter() - t
                asyncio.run(load(base, 10_000_000 + rep * 1000, n=16))  # warm
                solo = asyncio.run(load(base, 1000 * (rep + 1), n=1, conc=1))["shas"]  # request 0 alone first
                l0 = llm_rewrites()
                c0 = cpu_snapshot()
                t0 = time.perf_counter()
                r = asyncio.run(load(base, 1000 * (rep + 1)))
                wall = time.perf_counter() - t0
                r["cpu_s"] = cpu_diff(c0, cpu_snapshot())
                r["wall_s"] = round(wall, 2)
                r["llm"] = delta(l0, llm_rewrites(), wall)
                key = 1000 * (rep + 1)
                r["solo_equals_loaded"] = solo[key] == r.pop("shas")[key]  # same image and rewrite alone and under load
                r.update(name=name, repeat=rep, startup_s=round(startup, 1), loadavg=os.getloadavg())
                print(json.dumps(r), flush=True)
                runs.append(r)
                serve.delete("balance")
    finally:
        serve.shutdown()
        ray.shutdown()
    summary = {}
    for name, _ in configs:
        v = [r["images_per_s"] for r in runs if r["name"] == name]
        summary[name] = {"images_per_s": {"min": min(v), "median": statistics.median(v), "max": max(v)}}
    import hashlib

    import stages

    tree = os.path.dirname(os.path.dirname(stages.__file__))
    kernel = hashlib.sha256(open(os.path.join(tree, "stages/kernels/blocked.cpp"), "rb").read()).hexdigest()[:12]
    report = {
        "kind": "balance",
        "tree": tree,
        "kernel_sha": kernel,
        "spec": {
            "requests": N,
            "concurrency": CONC,
            "size": SIZE,
            "steps": STEPS,
            "enhance_prompt": True,
            "pool": POOL,
        },
        "configs": dict(configs),
        "runs": runs,
        "summary": summary,
        "environment": environment(sys.argv),
    }
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
