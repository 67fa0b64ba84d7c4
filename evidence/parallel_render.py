"""One image of a DiT (Stable Diffusion 3) rendered by several worker processes, bit for bit the image one worker
renders (issue 27, items 2 and 3).

CFG parallel (`cfg=2`)       the unconditional and the conditional row of classifier-free guidance on two workers; the
                             two predictions are gathered (all_gather, rank order: [uncond, cond]) and guided by the
                             family's own formula on every worker, so every worker steps the same latents.
Ulysses sequence parallel    the image tokens split across workers, an all-to-all around attention, the text tokens
(`sp=2`)                     replicated: `stages.diffusion.sequence_parallel`, the code a served replica's group runs.
Both (`cfg=2, sp=2`)         four workers, rank = cfg_rank * sp + sp_rank: SP groups within a branch, CFG groups across.

Why the bits can be the same: `stages.diffusion.sequence_parallel`'s docstring (no collective sums anything).

The workers are processes started by torch.multiprocessing (spawn) and joined through a file store in a private
temporary directory (one machine: no port to pick, nothing listening for the rendezvous). Each loads the same pipeline
(`DiffusionRenderer`) and drives the step engine's family (`DiTFamily`: condition, prepare, step, decode), with the
denoiser call split as above; with cfg = sp = 1 the call is the step engine's own.
"""

from __future__ import annotations

import dataclasses
import pickle
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contracts.config import DiffusionStageConfig, ParallelDegrees
from contracts.cpu import hold_process_to_path
from contracts.sampling import DiffusionSamplingParams
from contracts.scope import Configuration
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.families import DiTFamily, guided
from stages.diffusion.renderer import DiffusionRenderer
from stages.diffusion.self_check import image_digest
from stages.diffusion.sequence_parallel import Collectives
from stages.diffusion.sequence_plans import sequence_parallel
from stages.embedded import EMBEDDED_MODELS
from stages.embedded.diffusion import tiny_pipeline_path
from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels
from stages.scope import diffusion_configuration, parallel_engine

#: The degrees rendered and tested: CFG has two branches; SP 2 splits the tiny DiT's 4 heads and its 16 image tokens
#: at 64x64 evenly (SP 4 would too, untested).
DEGREES = (1, 2)


def _branch(sample: Sample, row: int) -> Sample:
    """Row `row` of a guided sample's [uncond, cond] as a sample of its own: one row, no guidance."""
    return dataclasses.replace(
        sample,
        params=sample.params.model_copy(update={"guidance_scale": 1.0}),
        conditioning={name: rows[row : row + 1] for name, rows in sample.conditioning.items()},
    )


def denoise(family: DiTFamily, comms: Collectives, samples: list[Sample]) -> list[torch.Tensor]:
    """The family's denoiser call for `samples`, its CFG rows split over the CFG group; every worker returns the same
    guided predictions (gathered in rank order, then the family's guidance formula)."""
    if comms.cfg == 1:
        return family.denoise(samples)  # the step engine's call
    branches = family.denoise([_branch(s, comms.cfg_rank) for s in samples])
    gathered = [comms.gather(rows, comms.cfg_group, comms.cfg, dim=0) for rows in branches]
    return [guided(s, rows) for s, rows in zip(samples, gathered, strict=True)]


@dataclasses.dataclass(frozen=True)
class DiTLayout:
    """What the collectives' volume follows: an SD3 DiT's attention and one guided request's tokens (2 rows)."""

    heads: int
    head_dim: int
    blocks: int  # joint blocks; the last drops its text stream (SD3's context_pre_only): no text to gather there
    image_tokens: int  # latent patches
    text_tokens: int  # 77 CLIP + the T5 positions (SD3: 256, zeros without T5)
    patch_values: int  # the output projection's values per image token: patch side squared times latent channels
    element_bytes: int = 4

    def bytes_per_step(self, cfg: int, sp: int) -> int:
        """What one denoising step's collectives send, every worker's sends to other workers summed."""
        rows, size = 2 // cfg, self.element_bytes  # a worker's rows in a call: its branch's, or both
        image, heads, dim = self.image_tokens, self.heads, self.head_dim
        total = sp * cfg * (cfg - 1) * rows * image * self.patch_values * size  # each branch's prediction, to the other
        if sp > 1:  # all-to-all: of what a worker holds, the (sp - 1) / sp that other workers own
            worker = (
                self.blocks * 3 * rows * (image // sp) * heads * dim * (sp - 1) // sp  # q, k, v: my tokens, by heads
                + self.blocks * rows * (heads // sp) * image * dim * (sp - 1) // sp  # attention back: my heads' tokens
                + (self.blocks - 1) * rows * (heads // sp) * self.text_tokens * dim * (sp - 1)  # text, by heads
                + rows * (image // sp) * self.patch_values * (sp - 1)  # the output projection's tokens, to unpatchify
            )
            total += cfg * sp * worker * size
        return total


@dataclasses.dataclass(frozen=True)
class ParallelJob:
    """What the workers render: one request on each grid (cfg, sp) in turn, with the kernels on and/or off in turn,
    all in the same processes (each loads the pipeline once). The world is the largest grid; a smaller grid runs on
    the first ranks while the others wait."""

    model: str
    prompt: str
    params: dict[str, Any]  # DiffusionSamplingParams fields; a seed is required (one image, the same on every worker)
    grids: tuple[tuple[int, int], ...] = ((1, 1),)
    kernels: tuple[bool, ...] = (True,)
    step_engine: bool = False  # also render through the step engine on rank 0, to compare with grid (1, 1)
    torch_threads: int = 1
    dtype: str = "float32"
    timeout_s: float = 600.0

    @property
    def world(self) -> int:
        return max(cfg * sp for cfg, sp in self.grids)


@dataclasses.dataclass(frozen=True)
class ParallelRender:
    """Rank 0's image of one grid and kernel setting, and what it took. Bytes: what all the grid's workers sent to
    other workers through collectives, per denoising step."""

    cfg: int
    sp: int
    kernels: bool
    image: np.ndarray  # float32 (H, W, 3) in [0, 1], as the step engine returns it
    latents: np.ndarray  # the final latents (1, C, h, w)
    steps: int
    denoise_s: float  # rank 0's denoising loop
    render_s: float  # rank 0's encode, loop and decode
    bytes_per_step: int
    calls_per_step: dict[str, int]  # collectives per step, on rank 0
    step_engine_image: np.ndarray | None = None  # grid (1, 1) when asked: the step engine's image of the request
    launch_s: float = 0.0  # the whole launch, as its caller waited for it: start, loads, every render, exit
    # Rank 0's `stages.scope.Configuration` (JSON), its engine naming the grid: what an audit's scope record carries.
    configuration: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return image_digest(self.image)


def _switch(kernels: bool) -> None:

    if not kernels:
        disable_batch_invariant_kernels()
    elif not (report := enable_batch_invariant_kernels("cpu")).installed:
        raise RuntimeError(f"the batch-invariant kernels are not installed: {report.reason}")


def _resolved(renderer: DiffusionRenderer, job: ParallelJob) -> DiffusionSamplingParams:
    params = renderer.resolve(DiffusionSamplingParams(**job.params), step_engine=True)
    if any(cfg > 1 for cfg, _ in job.grids) and not (params.guidance_scale or 0.0) > 1.0:
        raise ValueError("CFG parallel renders a guided request: guidance_scale must be above 1")
    if params.lora or (params.cache is not None and params.cache.active):
        raise ValueError("parallel rendering applies no LoRA adapters and no step cache (not split per worker yet)")
    return params


def _render(renderer: DiffusionRenderer, comms: Collectives, job: ParallelJob, base: Configuration) -> dict[str, Any]:
    """One render of the job's request on this worker of `comms`' grid; rank 0's image and the measurements. `base`:
    the worker's configuration (`diffusion_configuration`, its weights hashed once per worker)."""
    family = renderer.family
    assert isinstance(family, DiTFamily)  # checked by the worker
    sample = Sample(job.prompt, _resolved(renderer, job), on_done=None)
    started = time.perf_counter()
    with torch.inference_mode(), sequence_parallel(family, comms):
        family.condition([sample])  # as the step engine joins a sample: its encoding, then its scheduler and noise
        family.prepare(sample)
        looping, sent, calls = time.perf_counter(), comms.sent, Counter(comms.calls)
        while not sample.finished:
            family.step(sample, denoise(family, comms, [sample])[0])
        denoise_s = time.perf_counter() - looping
        image = family.decode(sample.latents, sample.shape)[0] if comms.rank == 0 else None
    steps = len(sample.timesteps)
    return {
        "cfg": comms.cfg,
        "sp": comms.sp,
        "image": image,
        "latents": sample.latents.numpy().copy(),
        "steps": steps,
        "denoise_s": denoise_s,
        "render_s": time.perf_counter() - started,
        "sent_per_step": (comms.sent - sent) // steps,
        "calls_per_step": {kind: (n - calls[kind]) // steps for kind, n in comms.calls.items() if n > calls[kind]},
        "configuration": _configuration(base, comms) if comms.rank == 0 else {},
    }


def _configuration(configuration: Configuration, comms: Collectives) -> dict[str, Any]:
    """The render's configuration as a replica rendering on the same grid describes its own."""
    engine = {**configuration.engine, **parallel_engine(ParallelDegrees(cfg=comms.cfg, sp=comms.sp))}
    return configuration.model_copy(update={"engine": engine}).model_dump(mode="json")


def _on_step_engine(renderer: DiffusionRenderer, job: ParallelJob) -> np.ndarray:
    """The same request through the step engine, as a replica serves it."""
    assert renderer.family is not None  # a DiT family: checked by the worker
    engine = StepEngine(renderer.family, max_batch_size=1, torch_threads=job.torch_threads)
    try:
        return engine.render([Sample(job.prompt, _resolved(renderer, job), on_done=None)])[0]
    finally:
        engine.stop()


def _renders(renderer: DiffusionRenderer, grids: list[Collectives], job: ParallelJob) -> list[dict[str, Any]]:
    """Every grid's render, once per kernel setting; on workers outside a grid, an empty record."""

    base, results = diffusion_configuration(renderer, "step"), []
    for kernels in job.kernels:
        _switch(kernels)
        for comms in grids:
            result: dict[str, Any] = _render(renderer, comms, job, base) if comms.member else {"sent_per_step": 0}
            if comms.rank == 0 and job.step_engine and (comms.cfg, comms.sp) == (1, 1):
                result["step_engine_image"] = _on_step_engine(renderer, job)
            results.append({**result, "kernels": kernels})
            dist.barrier()  # the next grid starts together (and the timings of one grid hold no other's)
    return results


def _worker(rank: int, job: ParallelJob, store: str, out: str) -> None:
    """One worker: join the world, load the pipeline, render every grid and setting; rank 0 writes `out`."""
    hold_process_to_path()  # before torch computes anything: the kernel path's ATen, oneDNN and MKL levels
    timeout = timedelta(seconds=job.timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=job.world, timeout=timeout)
    try:
        grids = [Collectives(rank, cfg, sp) for cfg, sp in job.grids]  # every worker makes every group
        config = DiffusionStageConfig(
            model=job.model, batch_invariant=job.kernels[0], torch_threads=job.torch_threads, dtype=job.dtype
        )
        renderer = DiffusionRenderer(config)  # the kernels before the model loads, as a replica starts
        if not isinstance(renderer.family, DiTFamily):
            raise ValueError(f"parallel rendering drives SD3 DiT pipelines; {job.model} is not one")
        results = _renders(renderer, grids, job)
        sent: list[Any] = [None] * job.world
        dist.gather_object([r["sent_per_step"] for r in results], sent if rank == 0 else None, dst=0)  # not counted
        if rank == 0:
            for result, *each in zip(results, *sent, strict=True):
                result["bytes_per_step"] = sum(each)
            Path(out).write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


def render_parallel_runs(
    model: str,
    prompt: str,
    params: dict[str, Any],
    *,
    grids: tuple[tuple[int, int], ...] = ((1, 1),),
    kernels: tuple[bool, ...] = (True,),
    step_engine: bool = False,
    torch_threads: int = 1,
    dtype: str = "float32",
) -> list[ParallelRender]:
    """Render one request on each grid of (cfg, sp) workers, once per kernel setting (settings outer, grids inner, in
    the order given), all in one set of worker processes; rank 0's image and measurements of each."""
    for cfg, sp in grids:
        if cfg not in DEGREES or sp not in DEGREES:
            raise ValueError(f"degrees must each be one of {DEGREES}, got cfg={cfg}, sp={sp}")
    if params.get("seed") is None:
        raise ValueError("a parallel render needs the request's seed: every worker draws the same noise from it")
    job = ParallelJob(model, prompt, dict(params), tuple(grids), tuple(kernels), step_engine, torch_threads, dtype)
    hold_process_to_path()  # the workers inherit the kernel path's limits
    if model in EMBEDDED_MODELS:  # built here: a worker's build in its process group would save no text encoder
        tiny_pipeline_path(EMBEDDED_MODELS[model].recipe)
    with tempfile.TemporaryDirectory(prefix="omniserve-parallel-") as directory:
        out, started = Path(directory) / "rank0.pickle", time.perf_counter()
        mp.spawn(_worker, args=(job, str(Path(directory) / "store"), str(out)), nprocs=job.world, join=True)
        launch_s = time.perf_counter() - started
        results = pickle.loads(out.read_bytes())  # our own rank 0 wrote it, in our own private directory
    fields = {f.name for f in dataclasses.fields(ParallelRender)}
    return [ParallelRender(launch_s=launch_s, **{k: v for k, v in r.items() if k in fields}) for r in results]


def render_parallel(
    model: str, prompt: str, params: dict[str, Any], *, cfg: int = 1, sp: int = 1, kernels: bool = True
) -> np.ndarray:
    """The image (float32 (H, W, 3) in [0, 1]) of one request rendered on `cfg * sp` workers; cfg = sp = 1 is the
    single-worker reference, by the same code."""
    return render_parallel_runs(model, prompt, params, grids=((cfg, sp),), kernels=(kernels,))[0].image
