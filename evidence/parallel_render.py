"""One image of a DiT (Stable Diffusion 3) rendered by several worker processes, bit for bit the image one worker
renders (issue 27, items 2 and 3).

CFG parallel (`cfg=2`)       the unconditional and the conditional row of classifier-free guidance on two workers; the
                             two predictions are gathered (all_gather, rank order: [uncond, cond]) and guided by the
                             family's own formula on every worker, so every worker steps the same latents.
Ulysses sequence parallel    the image tokens in `sp` contiguous runs, one per worker: every token-wise layer (linear,
(`sp=2`)                     norms, MLP, adaLN modulation) runs on the worker's own tokens; around attention an
                             all-to-all turns "all heads of my tokens" into "all tokens of my heads", each head attends
                             whole on one worker, and a second all-to-all turns it back. SD3's joint attention's text
                             tokens are replicated, not split: every worker runs the whole text stream (the rows one
                             worker runs), attends its heads over every text key, and gathers the text's attention
                             output by heads. The patch embedding runs on the whole latent on every worker; the output
                             projection's tokens are gathered for the unpatchify.
Both (`cfg=2, sp=2`)         four workers, rank = cfg_rank * sp + sp_rank: SP groups within a branch, CFG groups across.

Why the bits can be the same: with the batch-invariant kernels a row's result does not depend on how many rows share
the call, and the attention kernel computes each head on its own (measured here: F.scaled_dot_product_attention's
bits for a head do not follow how many heads or samples share the call, stock kernels), so each worker computes
exactly the values one worker computes, and the collectives only move them: gloo's all_gather and all_to_all_single,
never an all_reduce or any sum whose order follows the topology.

The workers are processes started by torch.multiprocessing (spawn) and joined through a file store in a private
temporary directory (one machine: no port to pick, nothing listening for the rendezvous). Each loads the same pipeline
(`DiffusionRenderer`) and drives the step engine's family (`DiTFamily`: condition, prepare, step, decode), with the
denoiser call split as above; with cfg = sp = 1 the call is the step engine's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from contracts.config import DiffusionStageConfig
from contracts.cpu import hold_process_to_path
from contracts.sampling import DiffusionSamplingParams
from contracts.scope import Configuration
from stages.diffusion.engine import Sample, StepEngine
from stages.diffusion.engine.families import DiTFamily, guided
from stages.diffusion.renderer import DiffusionRenderer
from stages.diffusion.self_check import image_digest
from stages.embedded import EMBEDDED_MODELS
from stages.embedded.diffusion import tiny_pipeline_path
from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels
from stages.scope import diffusion_configuration

#: The degrees rendered and tested: CFG has two branches; SP 2 splits the tiny DiT's 4 heads and its 16 image tokens
#: at 64x64 evenly (SP 4 would too, untested).
DEGREES = (1, 2)


def _group(ranks: list[int]) -> Any:
    """A process group over `ranks`; None for one rank (nothing to move). Every rank creates every group, in one order:
    `new_group` is itself collective."""
    group = dist.new_group(ranks)
    return group if len(ranks) > 1 else None


class Collectives:
    """This worker's place in the grid, its two groups, and the bytes it sends to other workers (what it moves)."""

    def __init__(self, rank: int, cfg: int, sp: int):
        self.rank, self.cfg, self.sp = rank, cfg, sp
        self.member = rank < cfg * sp  # a grid smaller than the world: the workers past it wait
        self.cfg_rank, self.sp_rank = divmod(rank, sp) if self.member else (-1, -1)
        sp_groups = [_group([c * sp + s for s in range(sp)]) for c in range(cfg)]
        cfg_groups = [_group([c * sp + s for c in range(cfg)]) for s in range(sp)]
        self.sp_group = sp_groups[self.cfg_rank] if self.member else None
        self.cfg_group = cfg_groups[self.sp_rank] if self.member else None
        self.sent = 0
        self.calls: Counter[str] = Counter()

    def gather(self, tensor: torch.Tensor, group: Any, size: int, dim: int) -> torch.Tensor:
        """`tensor` of every worker of `group`, concatenated along `dim` in rank order (no arithmetic)."""
        if size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor, group=group)
        self._count("all_gather", tensor.nbytes * (size - 1))
        return torch.cat(parts, dim=dim)

    def exchange(self, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        """All-to-all over dim 0: chunk i goes to the group's worker i; returns (size, ...), chunk j from worker j."""
        size = chunks.shape[0]
        chunks = chunks.contiguous()
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=group)
        self._count("all_to_all", chunks.nbytes * (size - 1) // size)  # its own chunk stays
        return received

    def _count(self, kind: str, sent: int) -> None:
        self.sent += sent
        self.calls[kind] += 1


def _normed(norm: Any, rows: torch.Tensor) -> torch.Tensor:
    return rows if norm is None else norm(rows)


class UlyssesJointAttention:
    """SD3's joint attention (diffusers' JointAttnProcessor2_0: the same layers and attention call) over image tokens
    split across the sequence-parallel group, text tokens whole on every worker. Head-parallel inside: `heads / sp`
    heads per worker, each over all N image + T text tokens, as one worker attends them."""

    def __init__(self, comms: Collectives):
        self.comms = comms

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        comms, size = self.comms, self.comms.sp
        batch, local, heads = hidden_states.shape[0], hidden_states.shape[1], attn.heads
        image = torch.stack([attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)])
        dim = image.shape[-1] // heads
        image = image.view(3, batch, local, heads, dim).transpose(2, 3)  # (3, B, H, n, d): my n tokens
        image = torch.stack([_normed(attn.norm_q, image[0]), _normed(attn.norm_k, image[1]), image[2]])
        # All heads of my tokens -> all tokens of my heads: chunk i (worker i's heads) goes to worker i.
        chunks = image.reshape(3, batch, size, heads // size, local, dim).permute(2, 0, 1, 3, 4, 5)
        mine = comms.exchange(chunks, comms.sp_group)  # (whose tokens, 3, B, H/sp, n, d)
        image = mine.permute(1, 2, 3, 0, 4, 5).reshape(3, batch, heads // size, size * local, dim)
        text = self._text_heads(attn, encoder_hidden_states, heads, dim)  # (3, B, H/sp, T, d)
        query, key, value = torch.cat([image, text], dim=3)  # image tokens first, as diffusers joins them
        attended = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        # All tokens of my heads -> all heads of my tokens: token run j goes back to worker j.
        chunks = attended[:, :, : size * local].reshape(batch, heads // size, size, local, dim).permute(2, 0, 1, 3, 4)
        back = comms.exchange(chunks, comms.sp_group)  # (whose heads, B, H/sp, n, d)
        hidden_states = back.permute(1, 3, 0, 2, 4).reshape(batch, local, heads * dim).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if attn.context_pre_only:  # the last block drops its text stream: nothing to gather
            return hidden_states, None
        text_out = comms.gather(attended[:, :, size * local :], comms.sp_group, size, dim=1)  # (B, H, T, d)
        text_out = text_out.transpose(1, 2).reshape(batch, -1, heads * dim).to(query.dtype)
        return hidden_states, attn.to_add_out(text_out)

    def _text_heads(self, attn, text: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """The text's queries, keys and values, computed whole (the rows one worker computes), of this worker's heads."""
        batch, length = text.shape[:2]
        rows = torch.stack([attn.add_q_proj(text), attn.add_k_proj(text), attn.add_v_proj(text)])
        rows = rows.view(3, batch, length, heads, dim).transpose(2, 3)  # (3, B, H, T, d)
        rows = torch.stack([_normed(attn.norm_added_q, rows[0]), _normed(attn.norm_added_k, rows[1]), rows[2]])
        share = heads // self.comms.sp
        return rows[:, :, self.comms.sp_rank * share : (self.comms.sp_rank + 1) * share]


def _own_tokens(comms: Collectives, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The patch embedding's tokens (B, N, D) -> this worker's contiguous run of N / sp."""
    if output.shape[1] % comms.sp:
        raise ValueError(f"{output.shape[1]} image tokens do not split evenly over {comms.sp} workers")
    share = output.shape[1] // comms.sp
    return output[:, comms.sp_rank * share : (comms.sp_rank + 1) * share]


def _all_tokens(comms: Collectives, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The output projection's rows of this worker's tokens -> every token, in order (the unpatchify takes them all)."""
    return comms.gather(output, comms.sp_group, comms.sp, dim=1)


@contextlib.contextmanager
def sequence_parallel(transformer: Any, comms: Collectives) -> Iterator[None]:
    """The SD3 transformer on this worker's image tokens (a no-op for sp = 1); its own processors and no hooks after."""
    if comms.sp == 1:
        yield
        return
    blocks, heads = transformer.transformer_blocks, transformer.config.num_attention_heads
    if heads % comms.sp or any(block.use_dual_attention for block in blocks):
        raise ValueError(f"sequence parallel degree {comms.sp}: needs heads ({heads}) divisible and no dual attention")
    before = [block.attn.processor for block in blocks]
    processor = UlyssesJointAttention(comms)
    hooks = [
        transformer.pos_embed.register_forward_hook(functools.partial(_own_tokens, comms)),
        transformer.proj_out.register_forward_hook(functools.partial(_all_tokens, comms)),
    ]
    for block in blocks:
        block.attn.set_processor(processor)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for block, own in zip(blocks, before, strict=True):
            block.attn.set_processor(own)


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
    with torch.inference_mode(), sequence_parallel(family.denoiser, comms):
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
    """The render's configuration as a replica's would be described, its engine naming the grid when there is one:
    a record of a parallel render matches a replica that renders on that grid, never a single-worker one."""
    if comms.cfg * comms.sp > 1:
        engine = {**configuration.engine, "parallel": {"cfg": comms.cfg, "sp": comms.sp}}
        configuration = configuration.model_copy(update={"engine": engine})
    return configuration.model_dump(mode="json")


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
