"""The LLM stage with batch invariance off vs on: output tokens/s and request latency against concurrency.

Two engines (a vLLM engine's switch is fixed when it starts), both from the stage's own `LLMStageConfig`
and both kept alive for the whole run: the embedded model is tiny, so holding both costs little memory,
and no restart sits between the runs compared. Each point is a closed loop of `requests` chat requests
(`LLMRequests.chat`: what `/v1/chat/completions` runs) at one concurrency; every request is seeded and asks
for exactly `max_tokens` tokens (min_tokens = max_tokens: no early end of sequence), so off and on do the
same work. Per repeat and concurrency, off and on run back to back (order flipping per repeat), after one
untimed warm-up point per engine.

    omniserve bench --stage llm --json bench-llm.json --markdown bench-llm.md --picture bench-llm.png

Run it under `if __name__ == "__main__":` (vLLM spawns processes), as the CLI does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from bench import paired as bench_paired
from bench.paired import SETTINGS, closed_loop, setting_orders
from bench.plot import ratio_picture
from contracts.jobs import final
from contracts.results import Completion
from contracts.sampling import LLMSamplingParams
from evidence.report import environment

PROMPT = "benchmark request {index}: describe a lighthouse on a cliff at dusk, waves below, in one long sentence"


@dataclass(frozen=True)
class LLMBenchSpec:
    concurrency: Sequence[int] = (1, 4, 8, 16)
    requests: int = 64  # per point (one setting, one concurrency, one repeat)
    max_tokens: int = 32  # and min_tokens: every request produces exactly this many
    repeats: int = 3
    model: str | None = None  # None: the embedded default
    torch_threads: int | None = None  # None: the stage's default
    stage: dict = field(default_factory=dict)  # further LLMStageConfig fields, e.g. {"max_num_seqs": 16}


def stage_config(spec: LLMBenchSpec, setting: str) -> dict:
    """The stage's config for one setting: its defaults, the switch, and what the spec sets."""
    given = {"model": spec.model, "torch_threads": spec.torch_threads}
    return {**spec.stage, **{k: v for k, v in given.items() if v is not None}, "batch_invariant": setting == "on"}


def chat_call(requests, spec: LLMBenchSpec, seed_base: int) -> Callable:
    """call(i) -> completion tokens of request i (seed seed_base + i), through the stage's chat request."""

    async def call(index: int) -> int:
        messages = [{"role": "user", "content": PROMPT.format(index=index)}]
        params = LLMSamplingParams(
            temperature=1.0, seed=seed_base + index, max_tokens=spec.max_tokens, min_tokens=spec.max_tokens
        )
        completion = await final(requests.chat(messages, params), Completion)
        return completion.usage.completion_tokens

    return call


async def _start(spec: LLMBenchSpec, log: Callable[[str], None]) -> dict:
    from stages.llm import LLMEngine, LLMRequests

    started = {}
    try:
        for setting in SETTINGS:
            engine = LLMEngine(stage_config(spec, setting))
            await engine.start()
            log(f"[bench llm] engine invariance {setting} started in {engine.startup_s} s")
            started[setting] = LLMRequests(engine)
    except BaseException:
        for requests in started.values():
            requests.engine.shutdown()
        raise
    return started


async def _measure(spec: LLMBenchSpec, log: Callable[[str], None]) -> tuple[list[dict], dict]:
    stages = await _start(spec, log)
    try:
        top = max(spec.concurrency)
        for requests in stages.values():  # untimed: first-call costs, every batch size up to the top
            await closed_loop(chat_call(requests, spec, 10**6), requests=min(spec.requests, 2 * top), concurrency=top)
        runs = []
        for repeat, order in enumerate(setting_orders(spec.repeats)):
            for concurrency in spec.concurrency:
                for setting in order:
                    point = await closed_loop(
                        chat_call(stages[setting], spec, 1000 * repeat), requests=spec.requests, concurrency=concurrency
                    )
                    runs.append(_run(repeat, setting, point))
                    log(
                        f"[bench llm] repeat {repeat} concurrency {concurrency} invariance {setting}: "
                        f"{runs[-1]['tokens_per_s']} tokens/s, p50 {point['p50_s']} s, p95 {point['p95_s']} s"
                    )
        return runs, {s: r.engine.describe().model_dump(mode="json") for s, r in stages.items()}
    finally:
        for requests in stages.values():
            requests.engine.shutdown()


def _run(repeat: int, setting: str, point: dict) -> dict:
    tokens = point.pop("units")
    point.pop("units_per_s")
    return {
        "repeat": repeat,
        "setting": setting,
        **point,
        "tokens": tokens,
        "tokens_per_s": round(tokens / point["wall_s"], 2),
    }


def run_llm_bench(
    spec: LLMBenchSpec, *, command: Sequence[str] | None = None, log: Callable[[str], None] = print
) -> dict:
    """Both engines, every point, every repeat -> the report (`markdown` and `picture` render it)."""

    started = time.time()
    env = environment(command)
    runs, engines = asyncio.run(_measure(spec, log))
    env["engines"] = engines  # per setting: engine arguments, worker threads, kernel reports
    env["seconds"] = round(time.time() - started, 1)
    summary, ratios = bench_paired.summarize(runs, point="concurrency", rate="tokens_per_s")
    report = {
        "kind": "llm",
        "spec": {**asdict(spec), "concurrency": list(spec.concurrency)},
        "engines_alive": "both engines started once and kept alive; settings alternate between them",
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "environment": env,
    }
    if "16" in ratios:
        report["targets"] = {
            "tokens_per_s_on_over_off_at_16_at_least_0.9": ratios["16"]["tokens_per_s_on_over_off"]["median"] >= 0.9
        }
    return report


def markdown(report: dict) -> str:
    spec, env = report["spec"], report["environment"]
    engine = env["engines"]["on"]
    threads = "/".join(str(r.get("torch_threads")) for r in engine.get("kernels", []))
    lines = [
        f"LLM stage (`LLMRequests.chat`, what `/v1/chat/completions` runs), model {engine['model']}, invariance off vs on: "
        f"{spec['requests']} seeded requests per point, exactly {spec['max_tokens']} output tokens each, "
        f"{spec['repeats']} repeats alternating off/on, {report['engines_alive']}.",
        f"Engine: max_num_seqs {engine['details']['engine_args'].get('max_num_seqs')}, worker torch threads {threads or '?'}, "
        f"kernel backend (on) {engine['kernel_backend']}.",
        *bench_paired.environment_lines(env),
        "",
        *bench_paired.markdown_rows(
            report["summary"], report["ratios"], point="concurrency", rate="tokens_per_s", rate_label="output tokens/s"
        ),
    ]
    if "targets" in report:
        lines.append(
            "Targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in report["targets"].items()) + "."
        )
    return "\n".join(lines) + "\n"


def picture(report: dict, path: str) -> None:

    points = [(int(c), r["tokens_per_s_on_over_off"]) for c, r in report["ratios"].items()]
    ratio_picture(
        path,
        title=f"LLM stage, output tokens/s invariance on / off; {report['spec']['repeats']} repeats paired, "
        "median, whiskers min-max",
        x_label="concurrency",
        series={"tokens/s on/off": points},
    )
