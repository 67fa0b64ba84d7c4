"""A replica's parallel group (issue 46): one image across several workers, the same bytes as one worker.

CFG parallel (`parallel.cfg: 2`): the replica and one more worker, each with the same pipeline, kernels, kernel path
and threads. Each denoiser call's rows are split in order, the first part computed in the replica, the rest by the
worker, and the predictions put back in row order; a guided sample's two rows (its unconditional and its conditional
branch) land on the two workers. With the batch-invariant kernels a row's result does not follow the rows beside it
in the call, so the gathered prediction is bit for bit the one worker's: the workers only move data (the rows'
inputs out, their predictions back, through Ray's object store; no sum crosses workers). The step engine is unchanged:
co-batching of unlike requests, samples joining and leaving between steps, step caching, previews and checkpoints run
in the replica as before; LoRA adapters too: each row's adapters (by name and scale) go with its inputs, and each
worker hooks them on its own denoiser.

Sequence parallel (`parallel.sp: 2`; SD3, FLUX, Qwen-Image, Wan): the workers of one CFG part get the same rows and
split their image tokens (`stages.diffusion.sequence_plans`: all-to-all around attention, the text replicated, every
token gathered at the end), talking through torch.distributed (gloo on CPU, NCCL on CUDA: `backend_for`; the replica
is rank 0 and hosts the store on its node's address; the rest join it before they load). With both, rank = cfg part *
sp + position in the part, as in the audit's prototype. A call whose image tokens do not split evenly runs whole on
the first worker of each part (no collective: the same bits). Each part's first worker returns the part's prediction;
the others return nothing.

Start: the stage's constructor starts the workers as Ray actors in its own placement group's further bundles
(`DiffusionStageConfig.deployment_options`: one bundle per worker, STRICT_PACK, so the group is placed whole on one
node or not at all) and waits until each has loaded its pipeline. Stop: the workers are actors the replica owns, so
they end with it (Ray kills an owner's actors when it dies). Health: a call or a health check that finds a worker gone
marks the group lost; the replica's health check then fails and Serve replaces the replica with a new group, and the
calls that failed (the worker's ActorDiedError, an infrastructure failure) are sent again by the ingress. A collective
that fails (a peer gone: gloo answers at once) leaves the group out of step: it is marked lost too, and the call's
error is the dead worker's ActorDiedError where one is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from contextlib import nullcontext
from typing import Any

import torch

from contracts.config import DiffusionStageConfig, ParallelDegrees
from contracts.results import GroupMember
from stages.kernels import current_report, disable_batch_invariant_kernels, enable_batch_invariant_kernels

from . import sequence_parallel, sequence_plans
from .renderer import DiffusionRenderer
from .sequence_parallel import Collectives, Rendezvous

#: How long a worker may take to load its pipeline, and to answer a health check.
START_TIMEOUT_S = 600.0
PING_TIMEOUT_S = 10.0
#: How long a collective waits for a peer: the peers run the same call on the same inputs, so one only waits out the
#: others' skew (a peer that died fails it at once: gloo sees its connection close).
COLLECTIVE_TIMEOUT_S = 300.0
#: The workers' concurrency group for health checks (`DenoiserGroup.check`), beside the one predictions run in.
HEALTH = "health"


def check_degrees(degrees: ParallelDegrees, family: Any, per_sample: bool) -> None:
    """Refuse, naming the field, a degree this replica's model cannot take."""
    for name, degree in (("cfg", degrees.cfg), ("sp", degrees.sp)):
        if degree > 1 and (family is None or not per_sample):
            raise ValueError(
                f"parallel.{name}={degree} splits the step engine's denoiser calls, and this replica does not run the "
                "step engine (batching: request, or a pipeline it has no family for)"
            )
    if degrees.sp > 1:
        sequence_plans.check(family, degrees.sp)


def start_group(renderer: Any, config: DiffusionStageConfig, step_engine: bool) -> DenoiserGroup | None:
    """The replica's group where its config asks for more than one worker (None: it predicts every row itself), its
    family's predictions routed through it; a degree the model cannot take refused first."""
    check_degrees(config.parallel, renderer.family, step_engine)
    if config.parallel.workers == 1:
        return None
    group = DenoiserGroup(config, renderer.device)
    family = renderer.family
    family.predict = functools.partial(group.predict, family)
    return group


def row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """`rows` in `parts` contiguous runs, in order, the first ones one longer where they do not divide."""
    size, extra = divmod(rows, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def rows_of(value: Any, start: int, stop: int, rows: int, name: str) -> Any:
    """Rows `start:stop` of one denoiser input: tensors and sequences by their first dimension, dicts and the packed
    calls' per-row dataclasses field by field; None and plain values whole."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {key: rows_of(item, start, stop, rows, f"{name}.{key}") for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: rows_of(getattr(value, f.name), start, stop, rows, f"{name}.{f.name}")
            for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **fields)
    length = (
        len(value)
        if isinstance(value, torch.Tensor | list | tuple) and not (isinstance(value, torch.Tensor) and value.dim() == 0)
        else None
    )
    if length != rows:
        # A whole-call input that happens to be split would change the bits silently: the family names those.
        raise ValueError(f"denoiser input {name!r} is not per row ({rows} rows): list it in the family's shared_inputs")
    return value[start:stop]


def call_rows(inputs: dict[str, Any], start: int, stop: int, rows: int, shared: frozenset[str]) -> dict[str, Any]:
    return {
        name: value if name in shared else rows_of(value, start, stop, rows, name) for name, value in inputs.items()
    }


def member(renderer: Any, rows: int) -> GroupMember:
    """This process as a member of its group, `rows` predicted."""
    import ray

    return GroupMember(
        pid=os.getpid(),
        node=ray.get_runtime_context().get_node_id(),
        device=renderer.device,
        torch_threads=torch.get_num_threads(),
        kernels_installed=current_report().installed,
        rows=rows,
    )


def joined(rendezvous: Rendezvous | None, rank: int, degrees: ParallelDegrees, store: Any = None) -> Collectives | None:
    """This member's collectives where its group splits tokens (every rank makes every group, in one order)."""
    if rendezvous is None:
        return None
    rendezvous.join(rank, store)
    return Collectives(rank, degrees.cfg, degrees.sp)


class DenoiserWorker:
    """A further worker of a group (a Ray actor): the replica's pipeline, loaded as the replica loads it; rank `rank`
    of the group's torch.distributed world where it splits tokens (joined first: the replica waits for every rank)."""

    def __init__(self, config: DiffusionStageConfig, rank: int, rendezvous: Rendezvous | None):
        self.comms = joined(rendezvous, rank, config.parallel)
        self.renderer = DiffusionRenderer(config.model_copy(update={"parallel": ParallelDegrees()}))
        assert self.renderer.family is not None  # check_degrees ran in the replica
        self.rows = 0

    def member(self) -> GroupMember:
        return member(self.renderer, self.rows)

    def predict(
        self, inputs: dict[str, Any], adapters: list[list[tuple[str, float]]], split_tokens: bool
    ) -> torch.Tensor | None:
        """The rows' prediction, each row with its adapters (name, scale), hooked here as in the replica; None from a
        worker that is not its part's first (its part's first returns the same prediction)."""
        family = self.renderer.family
        assert family is not None
        lora = family.adapters
        assignment = [lora.hooked(row) for row in adapters]
        with torch.inference_mode(), lora.denoiser.rows(assignment), tokens_split(family, self.comms, split_tokens):
            prediction = family.call_denoiser(**inputs)
        self.rows += len(prediction)
        return prediction if self.comms is None or self.comms.sp_rank == 0 else None

    def use_kernels(self, on: bool) -> None:
        """The self-audit's control: stock kernels here too while the replica has them out."""
        if on:
            enable_batch_invariant_kernels(self.renderer.device)
        else:
            disable_batch_invariant_kernels()


def tokens_split(family: Any, comms: Collectives | None, split: bool) -> Any:
    """The block's denoiser calls on this member's share of the image tokens, where the call splits them."""
    return sequence_plans.sequence_parallel(family, comms) if comms and split else nullcontext()


def remote_worker() -> Any:
    """DenoiserWorker as a Ray actor class whose health answers run in a thread of their own (`HEALTH`): a prediction
    of a real model can outlast the ping's timeout, and a worker that answered only between predictions would look
    dead while it works."""
    import ray

    # Ray's typing of `remote` leaves out its `concurrency_groups` option (documented, and measured by the test).
    return ray.remote(concurrency_groups={HEALTH: 1})(DenoiserWorker)  # type: ignore[call-overload]


class DenoiserGroup:
    """The replica's side of its group: starts the further workers, splits each denoiser call among them."""

    def __init__(self, config: DiffusionStageConfig, device: str):
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.degrees = config.parallel
        placement = get_current_placement_group()  # None outside Serve (a stage built directly): placed anywhere
        actor = remote_worker()
        resources = {k: config.ray_actor_options[k] for k in ("num_cpus", "num_gpus") if k in config.ray_actor_options}
        rendezvous, store = (
            sequence_parallel.serve_rendezvous(
                ray.util.get_node_ip_address(), self.degrees.workers, COLLECTIVE_TIMEOUT_S, device
            )
            if self.degrees.sp > 1
            else (None, None)
        )
        self.workers: list[Any] = []  # actor handles; worker i is rank i + 1 and sits in bundle i + 1
        for rank in range(1, self.degrees.workers):
            strategy = (
                PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank) if placement else None
            )
            self.workers.append(
                actor.options(**resources, scheduling_strategy=strategy).remote(config, rank, rendezvous)
            )
        self.comms = joined(rendezvous, 0, self.degrees, store)  # returns once every worker joined
        self.members: list[GroupMember] = ray.get([w.member.remote() for w in self.workers], timeout=START_TIMEOUT_S)
        self.lost: str | None = None
        self.rows = 0  # predicted here, in the replica

    def predict(self, family: Any, **inputs: Any) -> torch.Tensor:
        """The call's prediction, its rows (those of its first tensor input) split in order among the CFG parts, each
        row with its LoRA adapters (the family's current assignment, sent by name and scale); within a part, its image
        tokens split among the part's workers where they divide evenly."""
        first_input = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
        rows, shared, sp = len(first_input), family.shared_inputs, self.degrees.sp
        split = sp > 1 and sequence_plans.splits(family, inputs, sp)
        lora = family.adapters.denoiser
        named = [[(adapter.name, scale) for adapter, scale in row] for row in lora.assignment]
        parts = row_bounds(rows, self.degrees.cfg)
        calls = []
        for rank, worker in enumerate(self.workers, start=1):
            (start, stop), position = parts[rank // sp], rank % sp
            if stop > start and (position == 0 or split):
                part = call_rows(inputs, start, stop, rows, shared)
                calls.append(worker.predict.remote(part, named[start:stop], split))
        (start, stop) = parts[0]
        try:
            with lora.rows(lora.assignment[start:stop]), tokens_split(family, self.comms, split):
                local = family.call_denoiser(**call_rows(inputs, start, stop, rows, shared))
        except RuntimeError:
            if split:  # a collective failed: the group is out of step; a worker gone is the cause to report
                self.lost = "a collective of this replica's parallel group failed"
                self._gathered(calls, timeout_s=PING_TIMEOUT_S)
            raise
        self.rows += len(local)
        return torch.cat([local, *(p for p in self._gathered(calls) if p is not None)])

    def _gathered(self, calls: list, timeout_s: float | None = None) -> list[torch.Tensor | None]:
        """The workers' answers in order (raises a gone worker's error, marking the group lost); with a timeout, what
        answered within it (the rest: None)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(calls, timeout=timeout_s)
        except RayActorError as exc:
            self.lost = f"a worker of this replica's parallel group is gone ({type(exc).__name__})"
            raise
        except GetTimeoutError:
            return [None] * len(calls)

    async def check(self) -> str | None:
        """Why the group cannot serve (a worker gone or not answering); None when every worker answers. Each answer
        refreshes `members` (their rows so far)."""
        from ray.exceptions import RayActorError

        if self.lost is None:
            try:
                answers = asyncio.gather(*(w.member.options(concurrency_group=HEALTH).remote() for w in self.workers))
                self.members = list(await asyncio.wait_for(answers, PING_TIMEOUT_S))
            except (RayActorError, TimeoutError) as exc:
                self.lost = f"a worker of this replica's parallel group did not answer ({type(exc).__name__})"
        return self.lost

    def use_kernels(self, on: bool) -> None:
        import ray

        ray.get([w.use_kernels.remote(on) for w in self.workers])

    def describe(self, renderer: Any) -> dict[str, Any]:
        """`/health`'s view: the degrees, every worker (the replica first, the others as they last answered `check`)
        and why the group cannot serve, if so."""
        return {
            "problem": self.lost,
            "cfg": self.degrees.cfg,
            "sp": self.degrees.sp,
            "collectives_sent_bytes": self.comms.sent if self.comms else 0,  # by the replica, to its part's workers
            "workers": [m.model_dump() for m in (member(renderer, self.rows), *self.members)],
        }
