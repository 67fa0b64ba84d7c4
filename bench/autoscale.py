"""Autoscaling the diffusion stage under a stepped load (issue 27): the replica count over time, latency per step of
the load, no request lost, every response's bytes the reference run's, every image verified.

An app of its own ("/autoscale": its LLM scaled to zero, the requests skip the rewrite) with Serve's
`autoscaling_config` on the diffusion stage, min 1, max 3, two ongoing requests per replica as the target. The load
steps 1 -> 12 -> 3 -> 0 concurrent clients (wanted replicas: 1, 3, 2, 1), each client sending the same 12 requests
round after round; the reference is those 12 sent one at a time to the single replica first. Scale-down starts while
the load still runs (the 3-client step): a replica that Serve stops finishes what it holds (its graceful shutdown), and
anything cut would be retried by the ingress on another replica with the same bytes (orchestration/retries.py).

    .venv/bin/python -m bench.autoscale --json docs/evidence/bench-autoscaling.json \
        --markdown docs/evidence/bench-autoscaling.md

`tests/orchestration/test_autoscaling.py` runs the same load and asserts what this reports.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.load import percentile
from bench.local_serve import local_serve
from evidence.report import cpu_model

NAME = "autoscale"
CONFIG: dict[str, Any] = {
    "llm": {
        "batch_invariant": True,
        "ray_actor_options": {"num_cpus": 0.05},
        "autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1},
    },
    "diffusion": {
        "batch_invariant": True,
        "ray_actor_options": {"num_cpus": 0.1},
        "max_batch_size": 4,
        "autoscaling_config": {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": 3,
            "target_ongoing_requests": 2,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
            "upscale_delay_s": 1,
            "downscale_delay_s": 4,
        },
    },
    "ingress": {"ray_actor_options": {"num_cpus": 0.02}},
}
# Long enough that 12 clients keep the replicas busy (measured: at 4 steps each request ended so fast that the
# ongoing count stayed under the target and nothing scaled); 64x64, the audited size, so each image is verifiable.
BODIES = [
    {
        "prompt": f"a {colour} {shape} on a black background",
        "seed": 40 + i,
        "size": "64x64",
        "num_inference_steps": 40,
        "enhance_prompt": False,
    }
    for i, (colour, shape) in enumerate(
        (c, s) for c in ("red", "green", "yellow", "white") for s in ("circle", "square", "star")
    )
]
#: (concurrent clients, seconds): up to 3 replicas wanted, then 2 while the load still runs.
STEPS = ((12, 25.0), (3, 15.0))
TIMEOUT_S = 180.0
SETTLE_S = 120.0  # after the load, how long the count may take to fall back to the minimum


def diffusion_replicas(name: str = NAME) -> int:
    """RUNNING diffusion replicas of app `name`, as Serve's controller reports them now."""
    from ray import serve

    from stages.serve_replica import running

    return running(serve.status().applications[name].deployments["DiffusionStage"])


def render(base: str, body: dict, step: int = -1) -> dict[str, Any]:
    """One request: its status, and for a 200 the image's sha256, replica and verdict (`verified`: its replica's
    scope covered it); its latency and the load step it was sent in."""
    started = time.monotonic()
    response = httpx.post(f"{base}/v1/images/generations", json=body, timeout=TIMEOUT_S)
    answer: dict[str, Any] = {"status": response.status_code, "latency_s": time.monotonic() - started, "step": step}
    if response.status_code == 200:
        image = response.json()["data"][0]
        verified = response.json()["invariance"]["diffusion"]["verified"]
        answer.update(sha256=image["sha256"], replica=image["replica"], verified=verified)
    else:
        answer["error"] = response.text[:500]
    return answer


def load(base: str, clients: int, seconds: float, step: int) -> list[dict[str, Any]]:
    """`clients` threads, each sending BODIES round after round for `seconds`; each answer names its body."""
    deadline, answers = time.monotonic() + seconds, []

    def client(offset: int) -> None:
        i = offset
        while time.monotonic() < deadline:
            answers.append({"body": i % len(BODIES), **render(base, BODIES[i % len(BODIES)], step)})
            i += 1

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client, k) for k in range(clients)]:
            future.result()
    return answers


def stepped_run(base: str, steps: tuple[tuple[int, float], ...] = STEPS) -> dict[str, Any]:
    """The reference (BODIES one at a time), then the stepped load while a thread samples the replica count every
    0.5 s, then the wait for the count to fall back to the minimum (read fresh at the end, not from the sampler)."""
    reference = [render(base, body) for body in BODIES]
    replicas: list[tuple[float, int]] = [(0.0, diffusion_replicas())]
    started, sampling = time.monotonic(), threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            replicas.append((round(time.monotonic() - started, 1), diffusion_replicas()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers = [
            answer for step, (clients, seconds) in enumerate(steps) for answer in load(base, clients, seconds, step)
        ]
        deadline = time.monotonic() + SETTLE_S
        while (final := diffusion_replicas()) > 1 and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        sampling.set()
        sampler.join()
    return {
        "steps": steps,
        "reference": reference,
        "answers": answers,
        "replicas": replicas,
        "final": final,
        "settled_s": round(time.monotonic() - started, 1),
    }


def changed(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The answers whose bytes differ from their body's reference (a non-200 is lost, not changed)."""
    reference = run["reference"]
    return [a for a in run["answers"] if a["status"] == 200 and a["sha256"] != reference[a["body"]]["sha256"]]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    answers = run["answers"]
    per_step = []
    for step, (clients, seconds) in enumerate(run["steps"]):
        mine = [a for a in answers if a["step"] == step]
        latencies = [a["latency_s"] for a in mine if a["status"] == 200]
        per_step.append(
            {
                "clients": clients,
                "seconds": seconds,
                "responses": len(mine),
                "p50_s": percentile(latencies, 50),
                "p95_s": percentile(latencies, 95),
                "max_s": max(latencies, default=0.0),
            }
        )
    everything = run["reference"] + answers
    return {
        "responses": len(answers),
        "lost": sum(a["status"] != 200 for a in everything),
        "changed": len(changed(run)),
        "unverified": sum(a["status"] == 200 and not a["verified"] for a in everything),
        "replicas_served": sorted({a["replica"] for a in answers if a["status"] == 200}),
        "peak_replicas": max(n for _, n in run["replicas"]),
        "final_replicas": run["final"],
        "per_step": per_step,
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    timeline = ", ".join(f"{t:g}s:{n}" for t, n in _changes(report["run"]["replicas"]))
    lines = [
        f"Command: `{report['command']}`; {report['cpu']}; {report['date']}.",
        "",
        f"{s['responses']} responses under load after {len(BODIES)} reference renders: {s['lost']} lost, "
        f"{s['changed']} with bytes other than the reference's, {s['unverified']} unverified; "
        f"{len(s['replicas_served'])} replicas served, peak {s['peak_replicas']}, "
        f"back to {s['final_replicas']} at {report['run']['settled_s']} s.",
        "",
        f"Diffusion replicas RUNNING over time (each change, seconds from the load's start): {timeline}",
        "",
        "| step | clients | seconds | responses | p50 s | p95 s | max s |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, step in enumerate(s["per_step"]):
        lines.append(
            f"| {i + 1} | {step['clients']} | {step['seconds']:g} | {step['responses']} | {step['p50_s']:.2f} | "
            f"{step['p95_s']:.2f} | {step['max_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _changes(replicas: list[tuple[float, int]]) -> list[tuple[float, int]]:
    return [(t, n) for i, (t, n) in enumerate(replicas) if i == 0 or n != replicas[i - 1][1]]


def main(argv: list[str] | None = None) -> int:
    import sys

    from ray import serve

    from orchestration import build_app

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    args = parser.parse_args(argv)
    with local_serve(2, "omniserve-bench-autoscale") as base:
        serve.run(build_app(CONFIG), name=NAME, route_prefix=f"/{NAME}")
        run = stepped_run(f"{base}/{NAME}")
    report: dict[str, Any] = {
        "command": " ".join(["python -m bench.autoscale", *(argv if argv is not None else sys.argv[1:])]),
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary(run),
        "run": run,
    }
    for path, text in ((args.json, json.dumps(report, indent=1) + "\n"), (args.markdown, markdown(report))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    print(markdown(report))
    figures = report["summary"]
    return 0 if not (figures["lost"] or figures["changed"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
