"""A diffusion replica proves its own promise where it runs, before it takes traffic (issue 44).

After its model loads, a replica whose invariance is on renders one target request solo and co-batched with unlike
neighbours (other prompts, seeds, step counts, guidance and, where its family has several, schedulers) at its own
default size, on its own step engine: first with its kernels, then with stock kernels as the control. The verdict
follows the audits' rule (`contracts.scope.ScopeRecord.valid`): proven only when the control varied and the kernels
gave 0 differing elements. A proof is written to the user's record cache as a `ScopeRecord` keyed by what decides
the bits (`stages.scope.diffusion_configuration`: the weights' digest, not the model's name or path), so the next
start of the same configuration reuses it without rendering.

    quick   every batch size 1..max_batch_size, the target in the middle, 2 steps
    full    every batch size, the target first, in the middle and last, 4 steps; the neighbours against their solos

Whatever it finds is in `/health` (`details.self_audit`). A difference leaves the replica unverified naming the case
(strict: it refuses to start); a control that never varies proves nothing, and the records decide as before.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from contracts import envs
from contracts.sampling import DiffusionSamplingParams
from contracts.scope import Configuration, Coverage, SelfAudit
from stages.self_audit import Finding, reusable

from .engine import Sample

TARGET = ("a red circle on a blue background", 7)
NEIGHBOURS = (
    ("a small green star on a white background, left", 11),
    ("a yellow square on a black background", 3),
    ("two cats asleep on a windowsill", 99),
    ("a lighthouse at dusk, oil painting", 1234),
    ("mountains under a starry sky", 5),
    ("a vintage car in the rain", 31337),
    ("macro photo of a dew drop on a leaf", 8),
)
#: What each neighbour changes besides prompt and seed, in turn: steps as an offset from the target's, guidance.
VARIANTS = (
    {"steps": -1, "guidance_scale": 1.0},
    {"steps": 1, "guidance_scale": 3.0},
    {"steps": 0, "guidance_scale": 9.0},
)
ORDERINGS = {"quick": ("middle",), "full": ("first", "middle", "last")}
STEPS = {"quick": 2, "full": 4}


@contextlib.contextmanager
def stock_kernels(device: str, group: Any = None) -> Iterator[None]:
    """Stock kernels inside the block (the control), then the state before it: a replica whose kernels are in
    stays so, one whose kernels are not (the test-only fault) stays without. A parallel group's workers (`group`)
    follow the replica."""
    from stages.kernels import current_report, disable_batch_invariant_kernels, enable_batch_invariant_kernels

    installed = current_report().installed
    disable_batch_invariant_kernels()
    if group is not None:
        group.use_kernels(False)
    try:
        yield
    finally:
        if installed:
            enable_batch_invariant_kernels(device)
        if group is not None:
            group.use_kernels(installed)


def leave_kernels_out_under_test_fault(batch_invariant: bool) -> None:
    """Test-only fault (OMNISERVE_TEST_FAULT=kernels-uninstalled): the switch says on and the renderer's kernel report
    says installed, but stock kernels answer. The self-audit must catch it (tests/stages/test_self_audit.py)."""
    from stages.kernels import disable_batch_invariant_kernels

    if batch_invariant and envs.read("OMNISERVE_TEST_FAULT") == "kernels-uninstalled":
        disable_batch_invariant_kernels()


class _Plan:
    """The samples of one audit: each arrangement's requests and where its target sits."""

    def __init__(self, renderer, mode: str, batch_size: int):
        self.renderer, self.mode = renderer, mode
        schedulers = list(getattr(renderer.family, "SCHEDULERS", {}))
        self.steps = max(STEPS[mode], renderer.capabilities.min_steps + 1)
        self.neighbours = []
        for index, (prompt, seed) in enumerate(NEIGHBOURS[: batch_size - 1]):
            variant = VARIANTS[index % len(VARIANTS)]
            params = {
                "seed": seed,
                "num_inference_steps": max(renderer.capabilities.min_steps, self.steps + variant["steps"]),
                "guidance_scale": variant["guidance_scale"],
            }
            if len(schedulers) > 1:
                params["scheduler"] = schedulers[index % len(schedulers)]
            self.neighbours.append((prompt, params))
        self.target = (TARGET[0], {"seed": TARGET[1], "num_inference_steps": self.steps, "guidance_scale": 5.0})
        self.arrangements: list[tuple[str, list[tuple[str, dict]], int]] = []
        for size in range(2, batch_size + 1):
            others = self.neighbours[: size - 1]
            for ordering in ORDERINGS[mode]:
                at = {"first": 0, "middle": size // 2, "last": size - 1}[ordering]
                self.arrangements.append(
                    (f"batch {size}, target {ordering}", [*others[:at], self.target, *others[at:]], at)
                )

    def sample(self, request: tuple[str, dict]) -> Sample:
        params = DiffusionSamplingParams(**request[1])
        return Sample(request[0], self.renderer.resolve(params, step_engine=True, serving_limits=False), on_done=None)

    def render(self, engine, requests: list[tuple[str, dict]]) -> list[Any]:
        import numpy as np

        return [np.asarray(image) for image in engine.render([self.sample(r) for r in requests])]

    def run(self, engine, *, until_varied: bool = False) -> tuple[int, int, list[str], int]:
        """(arrangements run, those where something differed from solo, the cases that did with their counts, the
        differing elements in all); `full` also compares every neighbour with its own solo render. `until_varied` (the
        control): the largest batches first, stopping at the first that differs, which is all a control must show."""
        solo = self.render(engine, [self.target])[0]
        solos = {r[0]: self.render(engine, [r])[0] for r in self.neighbours} if self.mode == "full" else {}
        ran, varied, cases, elements = 0, 0, [], 0
        for name, requests, at in reversed(self.arrangements) if until_varied else self.arrangements:
            images = self.render(engine, requests)
            found = [(f"{name}: target", _differing(images[at], solo))]
            found += [
                (f"{name}: {r[0]!r}", _differing(image, solos[r[0]]))
                for r, image in zip(requests, images, strict=True)
                if r[0] in solos
            ]
            cases += [f"{case} ({count} of {images[at].size} elements)" for case, count in found if count]
            ran += 1
            varied += any(count for _, count in found)
            elements += sum(count for _, count in found)
            if until_varied and varied:
                break
        return ran, varied, cases, elements


def _differing(a, b) -> int:
    return int((a != b).sum()) if a.shape == b.shape else int(a.size)


def self_audit(
    renderer, engine, configuration: Configuration, *, config, replica: str, group: Any = None
) -> SelfAudit | None:
    """Audit this replica's configuration here, or reuse an earlier start's record of it (nothing rendered); None
    where there is nothing to audit: invariance off, no step engine (whole-request batching) or `self_audit: off`.
    `group`: the replica's parallel group, whose workers take the control's stock kernels too."""
    if not config.batch_invariant or engine is None or config.self_audit == "off":
        return None
    mode, batch_size = config.self_audit, config.max_batch_size
    size = f"{renderer.defaults['width']}x{renderer.defaults['height']}"
    reused = reusable(configuration, ORDERINGS[mode], batch_size, size)
    if reused is not None:
        return SelfAudit(mode=mode, control_varied=reused.valid, record=reused.name, reused=True)
    started = time.monotonic()
    plan = _Plan(renderer, mode, batch_size)
    runs, _, differing, elements = plan.run(engine)
    with stock_kernels(renderer.device, group):
        control_runs, control_varied, _, _ = plan.run(engine, until_varied=True)
    finding = Finding(runs, differing, elements, control_runs, control_varied)
    coverage = Coverage(
        batch_sizes=list(range(1, batch_size + 1)), sizes=[size], orderings=list(ORDERINGS[mode]), steps=plan.steps
    )
    return finding.kept(configuration, coverage, mode=mode, replica=replica, started=started)
