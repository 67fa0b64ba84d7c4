"""What a GPU run must show: the batch-invariant kernels on the device, their cost, and the diffusion stage there.

On a machine with CUDA (after `make setup EXTRA=cuda`), from the repository root:

    .venv/bin/python scripts/gpu_check.py --out docs/evidence/gpu

Dry run on CPU, every code path at tiny sizes (under a minute; its figures are not evidence):

    .venv/bin/python scripts/gpu_check.py --out /tmp/gpu-check --device cpu --quick

1. invariance: F.linear (fp32, bf16; LLM shapes; one row alone vs among 2-8, 64, 256 rows, first/middle/last),
   torch.bmm, conv2d, group_norm and scaled_dot_product_attention (diffusion shapes; one sample alone vs in
   batches of 2-16), kernels on (must be bit-equal) and off (the control: how many cases stock varied in).
2. speed: F.linear bf16 at the issue's (K, N) and M = 1..1024, conv2d and group_norm at diffusion shapes;
   time(off) / time(on) paired per repeat, min/median/max.
3. diffusion: the stage's renderer with the embedded models at 64x64 and 256x256, fp32 and bf16: an image's
   bits alone vs co-batched (both render paths), and images/s off vs on at batch 1, 4, 8.
4. self-audit: a diffusion replica (the default model; FULL: every embedded one too) starts on the device with its
   start-up self-audit (solo vs co-batched, its kernels and stock), as a first start: it must prove itself.
5. checks: PASS/FAIL lines, also in the JSON (thresholds below, why in the notes of docs/performance/gpu-check.md).

Why two worker processes instead of switching kernels in one (as the CPU benches do): on CUDA, vLLM's
`init_batch_invariance()` also changes process-wide state that disabling does not undo (cuBLAS workspace
variables cuBLAS reads once, TF32 and reduced-precision flags, the preferred BLAS library), so an "off"
measured in a process that once had them on is no longer stock. Here `off` never installs kernels and `on`
installs them before its first tensor op, as a serving replica does; the parent alternates them (off, on,
then on, off, ...) so both see the same machine. Output, rewritten after every section so a run cut short
keeps what it measured: OUT/gpu-check.json and OUT/gpu-check.md. Exit status: 0 every check passed,
1 a check failed, 2 refused (CUDA asked for, none present).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the repository's packages must import in the workers too
    sys.path.insert(0, str(ROOT))

SETTINGS = ("off", "on")
#: on/off (time off / time on, median of the paired repeats) must reach these. F.linear bf16: vLLM's published
#: batch-invariant cost on one GPU is 0.99x (PR #28161), so 0.9 leaves room for noise, not for a slow kernel.
#: Diffusion: the issue's bar for the stage on CPU, kept on the device.
LINEAR_MIN_RATIO, DIFFUSION_MIN_RATIO = 0.9, 0.95
SCHEMA = "omniserve-gpu-check/1"


@dataclass(frozen=True)
class Plan:
    """Every size the run visits. FULL is what a GPU run must show; QUICK only exercises the code."""

    linear_shapes: tuple = ((512, 1408), (4096, 4096))  # invariance, (K, N)
    linear_rows: tuple = (2, 3, 4, 5, 6, 7, 8, 64, 256)
    dtypes: tuple = ("float32", "bfloat16")
    # name -> (op, shape parameters): the embedded pipelines' convolutions, norms and attention at 64 and 256 px.
    op_cases: dict = field(
        default_factory=lambda: {
            "conv_in_latent32": ("conv2d", dict(cin=4, cout=32, size=32)),
            "conv_unet_16": ("conv2d", dict(cin=64, cout=64, size=16)),
            "conv_vae_32": ("conv2d", dict(cin=64, cout=64, size=32)),
            "conv_vae_256": ("conv2d", dict(cin=32, cout=32, size=256)),
            "group_norm_vae_256": ("group_norm", dict(channels=32, groups=8, size=256, channels_last=False)),
            "group_norm_unet_16": ("group_norm", dict(channels=64, groups=8, size=16, channels_last=False)),
            "group_norm_unet_16_cl": ("group_norm", dict(channels=64, groups=8, size=16, channels_last=True)),
            "bmm_qk_vae_mid": ("bmm", dict(heads=1, m=1024, k=64, n=1024)),
            "bmm_av_vae_mid": ("bmm", dict(heads=1, m=1024, k=1024, n=64)),
            "bmm_qk_unet_cross": ("bmm", dict(heads=8, m=256, k=8, n=77)),
            "sdpa_unet_self": ("sdpa", dict(heads=8, seq=256, dim=8)),
            "sdpa_vae_mid": ("sdpa", dict(heads=1, seq=1024, dim=64)),
            "sdpa_dit_joint": ("sdpa", dict(heads=4, seq=589, dim=8)),  # 16x16 patches + 77 CLIP + 256 T5 slots
        }
    )
    op_batches: tuple = (2, 3, 4, 5, 6, 7, 8, 16)  # classifier-free guidance doubles a batch of 8
    speed_shapes: tuple = ((512, 1408), (1408, 512), (1024, 2816), (2048, 5632), (4096, 4096))
    speed_rows: tuple = (1, 2, 4, 8, 16, 64, 256, 1024)
    speed_ops: tuple = ("conv_in_latent32", "conv_vae_256", "group_norm_vae_256", "group_norm_unet_16")
    speed_op_batches: tuple = (2, 8, 16)
    repeats: int = 7
    target_s: float = 0.02  # one timed measurement: calls repeat until about this long
    sizes: tuple = (64, 256)
    diffusion_dtypes: tuple = ("float32", "bfloat16")
    steps: int = 8
    paths: tuple = ("engine", "pipeline")
    bit_batches: tuple = (2, 4, 8)
    orderings: tuple = ("first", "middle", "last")
    image_batches: tuple = (1, 4, 8)
    image_repeats: int = 5


FULL = Plan()
QUICK = Plan(
    linear_shapes=((64, 96),),
    linear_rows=(2, 3, 16),
    op_cases={
        "conv": ("conv2d", dict(cin=4, cout=8, size=8)),
        "group_norm": ("group_norm", dict(channels=16, groups=4, size=8, channels_last=True)),
        "bmm": ("bmm", dict(heads=2, m=16, k=8, n=16)),
        "sdpa": ("sdpa", dict(heads=2, seq=16, dim=8)),
    },
    op_batches=(2, 3),
    speed_shapes=((64, 96),),
    speed_rows=(1, 4),
    speed_ops=("conv", "group_norm"),
    speed_op_batches=(2,),
    repeats=2,
    target_s=0.002,
    sizes=(32,),
    diffusion_dtypes=("float32",),
    steps=2,
    bit_batches=(2,),
    orderings=("first", "last"),
    image_batches=(1, 2),
    image_repeats=2,
)


# --- worker side: one process per setting, never switched -----------------------------------------------


def _random(shape, seed: int, device: str, dtype: str):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, getattr(torch, dtype))


def build_case(op: str, params: dict, device: str, dtype: str):
    """(fn, make): fn maps a batch to outputs, make(count, seed) builds `count` samples stacked on dim 0."""
    import torch
    import torch.nn.functional as F

    p = dict(params)
    if op == "linear":  # a sample is one row: a token of an LLM batch
        weight = _random((p["n"], p["k"]), 1, device, dtype)
        bias = _random((p["n"],), 2, device, dtype) if p.get("bias") else None
        return (lambda x: F.linear(x, weight, bias)), (
            lambda count, seed: _random((count, p["k"]), seed, device, dtype)
        )
    if op == "conv2d":
        weight, bias = _random((p["cout"], p["cin"], 3, 3), 3, device, dtype), _random((p["cout"],), 4, device, dtype)
        shape = (p["cin"], p["size"], p["size"])
        return (lambda x: F.conv2d(x, weight, bias, padding=1)), (
            lambda count, seed: _random((count, *shape), seed, device, dtype)
        )
    if op == "group_norm":
        weight, bias = _random((p["channels"],), 5, device, dtype), _random((p["channels"],), 6, device, dtype)
        fmt = torch.channels_last if p["channels_last"] else torch.contiguous_format
        shape = (p["channels"], p["size"], p["size"])
        fn = lambda x: F.group_norm(x.contiguous(memory_format=fmt), p["groups"], weight, bias)  # noqa: E731
        return fn, (lambda count, seed: _random((count, *shape), seed, device, dtype))
    if op == "bmm":  # a sample is one image's heads: (heads, m + n, k), its (m, k) @ (k, n) per head
        m, k, n, heads = p["m"], p["k"], p["n"], p["heads"]

        def bmm(x):
            out = torch.bmm(x[:, :, :m].flatten(0, 1), x[:, :, m:].flatten(0, 1).transpose(1, 2))
            return out.unflatten(0, (x.shape[0], heads))

        return bmm, (lambda count, seed: _random((count, heads, m + n, k), seed, device, dtype))
    if op == "sdpa":  # what diffusers' attention processors call
        qkv = (3, p["heads"], p["seq"], p["dim"])
        fn = lambda x: F.scaled_dot_product_attention(x[:, 0], x[:, 1], x[:, 2])  # noqa: E731
        return fn, (lambda count, seed: _random((count, *qkv), seed, device, dtype))
    raise ValueError(f"unknown op {op!r}")


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Tasks:
    """What a worker does on request; every answer is plain data (it crosses a pipe)."""

    def __init__(self, device: str, setting: str):
        from stages.kernels import current_report, enable_batch_invariant_kernels

        self.device, self.setting = device, setting
        # Before any tensor op, as a replica does: on CUDA the cuBLAS settings must precede cuBLAS's first use.
        self.kernels = (enable_batch_invariant_kernels(device) if setting == "on" else current_report()).to_dict()
        self.timed: dict = {}  # the case being timed: built and calibrated once, reused across repeats
        self.renderers: dict = {}
        self.warm: set = set()

    def invariance(self, op: str, params: dict, dtype: str, batch_sizes: list, seed: int = 11) -> dict:
        """One sample alone, then at the first, middle and last position of each batch: differing cases."""
        import torch

        fn, make = build_case(op, params, self.device, dtype)
        sample, others = make(1, seed), make(max(batch_sizes) - 1, seed + 1)
        differing, cases = [], 0
        with torch.inference_mode():
            solo = fn(sample)
            for size in batch_sizes:
                for position in sorted({0, (size - 1) // 2, size - 1}):
                    batch = torch.cat([others[:position], sample, others[position : size - 1]])
                    cases += 1
                    if not torch.equal(fn(batch)[position : position + 1], solo):
                        differing.append([size, position])
        return {"cases": cases, "differing": len(differing), "examples": differing[:8]}

    def time_op(self, op: str, params: dict, dtype: str, batch: int, target_s: float) -> float:
        """Seconds per call of the op on a batch (warmed up and calibrated on first sight of the case)."""
        import torch

        key = json.dumps([op, params, dtype, batch], sort_keys=True)
        if key not in self.timed:
            fn, make = build_case(op, params, self.device, dtype)
            x = make(batch, 21)
            call = lambda: fn(x)  # noqa: E731
            with torch.inference_mode():
                call()
                one = max(self._seconds(call, 1), 1e-7)
            self.timed = {key: (call, max(1, min(2000, int(target_s / one))))}
        call, calls = self.timed[key]
        with torch.inference_mode():
            return self._seconds(call, calls) / calls

    def _seconds(self, call, calls: int) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(self.device)
        return time.perf_counter() - start

    def _renderer(self, model: str, dtype: str):
        from contracts.config import DiffusionStageConfig
        from stages.diffusion import DiffusionRenderer

        if (model, dtype) not in self.renderers:
            self.renderers.clear()  # one model in memory at a time
            # torch_threads=None: torch's own thread count, as the audit and the CPU bench measure.
            config = DiffusionStageConfig(
                model=model, batch_invariant=self.setting == "on", device=self.device, dtype=dtype, torch_threads=None
            )
            self.renderers[(model, dtype)] = DiffusionRenderer(config)
        return self.renderers[(model, dtype)]

    def _params(self, renderer, size: int, steps: int, seed: int):
        from contracts.sampling import DiffusionSamplingParams

        return renderer.resolve(DiffusionSamplingParams(seed=seed, num_inference_steps=steps, height=size, width=size))

    def diffusion_bits(
        self, model: str, dtype: str, size: int, steps: int, path: str, batch_sizes: list, orderings: list
    ) -> dict:
        """The audit's target alone vs co-batched (evidence.diffusion), on this device: per arrangement."""
        from evidence.diffusion import RENDER_PATHS, TARGET, batches, compare

        renderer, render = self._renderer(model, dtype), RENDER_PATHS[path]
        params = self._params(renderer, size, steps, TARGET[1])
        solo = render(renderer, [TARGET], params)[0]
        rows = []
        for ordering, order, target in batches(batch_sizes, orderings):
            counts = compare(solo, render(renderer, order, params)[target])
            rows.append(
                {
                    "ordering": ordering,
                    "batch_size": len(order),
                    "differing_elements": counts["differing_elements"],
                    "total_elements": counts["total_elements"],
                    "max_abs_diff": counts["max_abs_diff"],
                }
            )
        return {"arrangements": len(rows), "differing": sum(1 for r in rows if r["differing_elements"]), "rows": rows}

    def diffusion_seconds(self, model: str, dtype: str, size: int, steps: int, batch: int) -> float:
        """Wall seconds of one whole-batch render through the renderer (the first one per shape warms up)."""
        from stages.diffusion import Job

        renderer = self._renderer(model, dtype)
        params = self._params(renderer, size, steps, 0)
        jobs = [Job(f"gpu check prompt {i}", params.model_copy(update={"seed": i})) for i in range(batch)]
        if (model, dtype, size, batch) not in self.warm:
            renderer.render(jobs)
            self.warm.add((model, dtype, size, batch))
        synchronize(self.device)
        start = time.perf_counter()
        renderer.render(jobs)
        synchronize(self.device)
        return time.perf_counter() - start

    def self_audit(self, model: str, dtype: str, mode: str) -> dict:
        """A diffusion replica's start-up self-audit on this device (stages/diffusion/self_audit.py), as a first start
        (an empty record cache, so it renders): its verdict and what it said."""
        import tempfile

        import contracts.scope
        from contracts.config import DiffusionStageConfig
        from stages.diffusion import DiffusionStage

        self.renderers.clear()  # one model in memory at a time
        config = DiffusionStageConfig(
            model=model,
            batch_invariant=True,
            device=self.device,
            dtype=dtype,
            warm_up=False,
            self_audit=mode,
            max_batch_size=4,
            torch_threads=None,
        )
        with tempfile.TemporaryDirectory() as records:
            contracts.scope.user_records = lambda: Path(records)
            started = time.perf_counter()
            stage = DiffusionStage.func_or_class(config)  # type: ignore[attr-defined]  # the class under the Deployment
            seconds = time.perf_counter() - started
            stage.batching.engine.stop()
        audit, verdict = stage.scope.self_audit, stage.scope.verdict
        return {
            "start_s": round(seconds, 2),
            "self_audit": audit.model_dump(),
            "verified": verdict.verified,
            "verified_by": verdict.by,
            "differences": verdict.differences,
        }


def worker_main(conn, device: str, setting: str) -> None:
    """Serve (task, kwargs) requests until None; answers {"result": ...} or {"error": traceback}."""
    try:
        tasks = Tasks(device, setting)
        conn.send({"result": tasks.kernels})
    except Exception:
        conn.send({"error": traceback.format_exc()})
        return
    while (request := conn.recv()) is not None:
        name, kwargs = request
        try:
            conn.send({"result": getattr(tasks, name)(**kwargs)})
        except Exception:
            conn.send({"error": traceback.format_exc()})


# --- parent side ------------------------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, device: str, setting: str):
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
        self.setting = setting
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, device, setting), name=f"gpu-check-{setting}")
        self.process.start()
        child.close()

    def answer(self):
        try:
            reply = self.conn.recv()
        except EOFError as err:
            raise WorkerError(f"the {self.setting} worker died (exit code {self.process.exitcode})") from err
        if "error" in reply:
            raise WorkerError(f"the {self.setting} worker failed:\n{reply['error']}")
        return reply["result"]

    def call(self, name: str, **kwargs):
        self.conn.send((name, kwargs))
        return self.answer()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def spread(values: list, digits: int = 3) -> dict:
    from bench.load import spread as rounded

    return rounded(values, digits)


def paired(workers: dict, name: str, repeats: int, **kwargs) -> dict:
    """Seconds from both settings, alternating who goes first; ratios time(off) / time(on) paired per repeat."""
    seconds: dict = {s: [] for s in SETTINGS}
    for repeat in range(repeats):
        for setting in SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]:
            seconds[setting].append(workers[setting].call(name, **kwargs))
    ratios = [off / on for off, on in zip(seconds["off"], seconds["on"], strict=True)]
    return {
        "seconds_off": spread(seconds["off"], 7),
        "seconds_on": spread(seconds["on"], 7),
        "on_over_off": spread(ratios),
        "repeats": repeats,
    }


def invariance_cases(plan: Plan) -> list[dict]:
    cases = [
        {
            "name": f"linear K={k} N={n}{' +bias' if bias else ''}",
            "op": "linear",
            "params": {"k": k, "n": n, "bias": bias},
            "dtype": dtype,
            "batch_sizes": list(plan.linear_rows),
        }
        for dtype in plan.dtypes
        for k, n in plan.linear_shapes
        for bias in (False, True)
    ]
    cases += [
        {"name": name, "op": op, "params": params, "dtype": dtype, "batch_sizes": list(plan.op_batches)}
        for dtype in plan.dtypes
        for name, (op, params) in plan.op_cases.items()
    ]
    return cases


def run_invariance(workers: dict, plan: Plan, rows: list, log) -> None:
    for case in invariance_cases(plan):
        task = {key: case[key] for key in ("op", "params", "dtype", "batch_sizes")}
        row = {**case, **{setting: workers[setting].call("invariance", **task) for setting in SETTINGS}}
        rows.append(row)
        log(
            f"invariance {case['name']} {case['dtype']}: on {row['on']['differing']}/{row['on']['cases']} differ, "
            f"off {row['off']['differing']}/{row['off']['cases']}"
        )


def run_linear_speed(workers: dict, plan: Plan, rows: list, log) -> None:
    for k, n in plan.speed_shapes:
        for m in plan.speed_rows:
            task = {
                "op": "linear",
                "params": {"k": k, "n": n, "bias": False},
                "dtype": "bfloat16",
                "batch": m,
                "target_s": plan.target_s,
            }
            row = {"k": k, "n": n, "m": m, "dtype": "bfloat16", **paired(workers, "time_op", plan.repeats, **task)}
            rows.append(row)
            log(f"F.linear bf16 K={k} N={n} M={m}: on/off {row['on_over_off']}")


def run_op_speed(workers: dict, plan: Plan, rows: list, log) -> None:
    for name in plan.speed_ops:
        op, params = plan.op_cases[name]
        for dtype in plan.dtypes:
            for batch in plan.speed_op_batches:
                task = {"op": op, "params": params, "dtype": dtype, "batch": batch, "target_s": plan.target_s}
                row = {
                    "name": name,
                    "op": op,
                    "params": params,
                    "dtype": dtype,
                    "batch": batch,
                    **paired(workers, "time_op", plan.repeats, **task),
                }
                rows.append(row)
                log(f"{name} {dtype} batch {batch}: on/off {row['on_over_off']}")


def _models() -> tuple:
    from stages.embedded import embedded_models

    return embedded_models("diffusion")


def run_diffusion_bits(workers: dict, plan: Plan, rows: list, log) -> None:
    for model in _models():
        for dtype in plan.diffusion_dtypes:
            for size in plan.sizes:
                for path in plan.paths:
                    task = {
                        "model": model,
                        "dtype": dtype,
                        "size": size,
                        "steps": plan.steps,
                        "path": path,
                        "batch_sizes": list(plan.bit_batches),
                        "orderings": list(plan.orderings),
                    }
                    row = {**task, **{s: workers[s].call("diffusion_bits", **task) for s in SETTINGS}}
                    rows.append(row)
                    log(
                        f"diffusion bits {model} {dtype} {size}px {path}: on {row['on']['differing']}/"
                        f"{row['on']['arrangements']} differ, off {row['off']['differing']}/{row['off']['arrangements']}"
                    )


def run_diffusion_speed(workers: dict, plan: Plan, rows: list, log) -> None:
    for model in _models():
        for dtype in plan.diffusion_dtypes:
            for size in plan.sizes:
                for batch in plan.image_batches:
                    task = {"model": model, "dtype": dtype, "size": size, "steps": plan.steps, "batch": batch}
                    row = {**task, **paired(workers, "diffusion_seconds", plan.image_repeats, **task)}
                    row["images_per_s_off"] = round(batch / row["seconds_off"]["median"], 3)
                    row["images_per_s_on"] = round(batch / row["seconds_on"]["median"], 3)
                    rows.append(row)
                    log(
                        f"diffusion {model} {dtype} {size}px batch {batch}: {row['images_per_s_off']} -> "
                        f"{row['images_per_s_on']} img/s, on/off {row['on_over_off']}"
                    )


def run_self_audit(workers: dict, plan: Plan, rows: list, log) -> None:
    """Each model's replica audits itself on the device, in the kernels-on worker (a replica installs its kernels before
    its model loads; its control swaps them out and back in its own process)."""
    from stages.embedded import DEFAULT_MODELS

    models = (DEFAULT_MODELS["diffusion"], *(() if plan is QUICK else _models()))
    for model in models:
        for dtype in plan.diffusion_dtypes:
            row = {
                "model": model,
                "dtype": dtype,
                **workers["on"].call("self_audit", model=model, dtype=dtype, mode="quick"),
            }
            rows.append(row)
            log(f"self-audit {model} {dtype}: {row['self_audit']['reason']} ({row['start_s']} s start)")


SECTIONS = {
    "invariance": run_invariance,
    "linear_speed": run_linear_speed,
    "op_speed": run_op_speed,
    "diffusion_bits": run_diffusion_bits,
    "diffusion_speed": run_diffusion_speed,
    "self_audit": run_self_audit,
}


# --- verdicts and output ----------------------------------------------------------------------------------


def checks(report: dict) -> list[dict]:
    """What must hold; a section that failed to run is a failed check too."""
    out = [
        {
            "name": "kernels installed on the device",
            "passed": bool(report["kernels"].get("on", {}).get("installed")),
            "detail": report["kernels"].get("on", {}).get("reason", ""),
        }
    ]
    for row in report["invariance"]:
        out.append(
            {
                "name": f"invariance on: {row['name']} {row['dtype']}",
                "passed": row["on"]["differing"] == 0,
                "detail": f"{row['on']['differing']}/{row['on']['cases']} cases differ (stock: {row['off']['differing']})",
            }
        )
    for row in report["diffusion_bits"]:
        out.append(
            {
                "name": f"diffusion bits on: {row['model']} {row['dtype']} {row['size']}px {row['path']}",
                "passed": row["on"]["differing"] == 0,
                "detail": f"{row['on']['differing']}/{row['on']['arrangements']} arrangements differ "
                f"(stock: {row['off']['differing']})",
            }
        )
    for row in report["linear_speed"]:
        ratio = row["on_over_off"]["median"]
        out.append(
            {
                "name": f"speed F.linear bf16 K={row['k']} N={row['n']} M={row['m']} on/off >= {LINEAR_MIN_RATIO}",
                "passed": ratio >= LINEAR_MIN_RATIO,
                "detail": f"median {ratio} (min {row['on_over_off']['min']})",
            }
        )
    for row in report["diffusion_speed"]:
        ratio = row["on_over_off"]["median"]
        out.append(
            {
                "name": f"speed diffusion {row['model']} {row['dtype']} {row['size']}px batch {row['batch']} "
                f"on/off >= {DIFFUSION_MIN_RATIO}",
                "passed": ratio >= DIFFUSION_MIN_RATIO,
                "detail": f"median {ratio} (min {row['on_over_off']['min']})",
            }
        )
    for row in report["self_audit"]:
        audit = row["self_audit"]
        out.append(
            {
                "name": f"self-audit proves the replica: {row['model']} {row['dtype']}",
                "passed": row["verified"] and audit["control_varied"] and not audit["differing"],
                "detail": audit["reason"],
            }
        )
    for error in report["errors"]:
        out.append(
            {
                "name": f"section {error['section']} ran",
                "passed": False,
                "detail": error["error"].strip().splitlines()[-1],
            }
        )
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
        "",
    ]


def _ratio(spread_: dict) -> str:
    return f"{spread_['median']} ({spread_['min']}-{spread_['max']})"


def markdown(report: dict) -> str:
    env, hw = report["environment"], report["environment"]["hardware"]
    lines = [
        f"# GPU check ({'quick dry run, not evidence' if report['quick'] else 'full'}) on {report['device']}",
        "",
        f"Device: {report['device_info']}. CPU: {hw['cpu']}. Versions: "
        + ", ".join(f"{name} {version}" for name, version in env["versions"].items() if version)
        + ".",
        f"Command: `{env['command']}`. {report['seconds']} s. Ratios: time(off)/time(on), median (min-max) "
        f"over paired repeats.",
        "",
        "## Checks",
        "",
        "```",
        *(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}" for c in report["checks"]),
        "```",
        "",
    ]
    lines += ["## Invariance (differing cases / cases)", ""] + _table(
        ["case", "dtype", "on", "off (control)"],
        [
            [
                r["name"],
                r["dtype"],
                f"{r['on']['differing']}/{r['on']['cases']}",
                f"{r['off']['differing']}/{r['off']['cases']}",
            ]
            for r in report["invariance"]
        ],
    )
    lines += ["## F.linear bf16 speed", ""] + _table(
        ["K", "N", "M", "s/call off", "s/call on", "on/off"],
        [
            [r["k"], r["n"], r["m"], r["seconds_off"]["median"], r["seconds_on"]["median"], _ratio(r["on_over_off"])]
            for r in report["linear_speed"]
        ],
    )
    lines += ["## conv2d / group_norm speed", ""] + _table(
        ["case", "dtype", "batch", "on/off"],
        [[r["name"], r["dtype"], r["batch"], _ratio(r["on_over_off"])] for r in report["op_speed"]],
    )
    lines += ["## Diffusion bits (differing arrangements / arrangements)", ""] + _table(
        ["model", "dtype", "size", "path", "on", "off (control)"],
        [
            [
                r["model"],
                r["dtype"],
                r["size"],
                r["path"],
                f"{r['on']['differing']}/{r['on']['arrangements']}",
                f"{r['off']['differing']}/{r['off']['arrangements']}",
            ]
            for r in report["diffusion_bits"]
        ],
    )
    lines += ["## Diffusion images/s", ""] + _table(
        ["model", "dtype", "size", "batch", "img/s off", "img/s on", "on/off"],
        [
            [
                r["model"],
                r["dtype"],
                r["size"],
                r["batch"],
                r["images_per_s_off"],
                r["images_per_s_on"],
                _ratio(r["on_over_off"]),
            ]
            for r in report["diffusion_speed"]
        ],
    )
    lines += ["## Self-audit (a replica's first start on the device)", ""] + _table(
        ["model", "dtype", "start s", "verified", "what it said"],
        [
            [r["model"], r["dtype"], r["start_s"], r["verified"], r["self_audit"]["reason"]]
            for r in report["self_audit"]
        ],
    )
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    report["checks"] = checks(report)
    report["passed"] = all(c["passed"] for c in report["checks"])
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu-check.md").write_text(markdown(report))


def device_info(device: str) -> str:
    import torch

    if device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        return f"{torch.cuda.get_device_name(0)}, compute capability {major}.{minor}, CUDA {torch.version.cuda}"
    return f"CPU ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads)"


def run(
    device: str, plan: Plan, quick: bool, out: Path, log, *, only: tuple = tuple(SECTIONS), budget_s: float = 450.0
) -> dict:
    from evidence.report import environment

    started = time.perf_counter()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "device": device,
        "device_info": device_info(device),
        "quick": quick,
        "plan": asdict(plan),
        "thresholds": {"linear_bf16_on_over_off": LINEAR_MIN_RATIO, "diffusion_on_over_off": DIFFUSION_MIN_RATIO},
        "environment": environment(),
        "kernels": {},
        "errors": [],
        "section_seconds": {},
        **{name: [] for name in SECTIONS},
        "seconds": 0.0,
    }
    workers = {setting: Worker(device, setting) for setting in SETTINGS}  # both start (import) at once
    try:
        for setting, worker in workers.items():
            report["kernels"][setting] = worker.answer()
        if not report["kernels"]["on"]["installed"]:  # nothing to measure: "on" would be stock
            log(f"kernels not installed: {report['kernels']['on']['reason']}")
            return report
        for name, section in ((n, s) for n, s in SECTIONS.items() if n in only):
            begun = time.perf_counter()
            if begun - started > budget_s:  # a run cut short by the caller's timeout would lose the output
                report["errors"].append({"section": name, "error": f"not run: past the time budget of {budget_s} s"})
                continue
            try:
                section(workers, plan, report[name], log)
            except WorkerError as err:
                report["errors"].append({"section": name, "error": str(err)})
                log(f"section {name} failed: {err}")
            report["section_seconds"][name] = round(time.perf_counter() - begun, 1)
            report["seconds"] = round(time.perf_counter() - started, 1)
            write(report, out)
    except WorkerError as err:
        report["errors"].append({"section": "start", "error": str(err)})
    finally:
        for worker in workers.values():
            worker.stop()
        report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu-check.json and gpu-check.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every code path, not evidence")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=tuple(SECTIONS),
        default=tuple(SECTIONS),
        help="run these sections only (e.g. to rerun what a run cut short left out)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="start no section after this many seconds (each one then fails as not run)",
    )
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: refusing: --device cuda but torch sees no CUDA device here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run it on a GPU machine after "
            "`make setup EXTRA=cuda`, or dry-run it with --device cpu --quick.",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[gpu_check {time.perf_counter() - start:6.1f}s] {message}", flush=True)

    report = run(
        args.device,
        QUICK if args.quick else FULL,
        args.quick,
        args.out,
        log,
        only=tuple(args.only),
        budget_s=args.budget_s,
    )
    write(report, args.out)
    for check in report["checks"]:
        print(f"{'PASS' if check['passed'] else 'FAIL'}  {check['name']}: {check['detail']}")
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: {args.out / 'gpu-check.json'}, {args.out / 'gpu-check.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
