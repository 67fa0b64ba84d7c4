"""Fixtures shared by the suite: one local Ray instance with Serve for every test that needs one.

Loopback only, bounded, and torn down by handle: `ray.init(address="local")` always starts a fresh
instance of our own (never someone else's cluster), and the session ends it with `ray.shutdown()`.
Tests that use it are marked `slow` (they start Ray, vLLM or a pipeline).
"""

from __future__ import annotations

import os

# OpenMP threads that wait spin 10,000 rounds before they sleep, not libgomp's 300,000, here and in every process the
# tests start (read when torch first loads libgomp, which is after this line). The suite runs two workers, Ray, vLLM
# engines and diffusion replicas on 2 cores, and a thread spinning for a peer that is not scheduled takes the core
# another process needs. Measured on this 2-core Intel Xeon, the tiny UNet and DiT rendering 12 images (4 steps,
# 64x64, 2 torch threads): three processes side by side 10.3-25.7 s each with the default, 3.0-6.9 s with 10,000
# (1,000 or passive: 1.8-3.2 s, but one process alone 3.5-3.8 s instead of 1.2-1.3 s, which 10,000 keeps); the main
# suite 17 min 53 s against 18 min 41 s and 19 min 27 s in the two runs before it, its processes' CPU time 1979 s
# against 2177 s. Scheduling only: no result's bits depend on it. (The stages keep libgomp's default.)
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import pytest

from contracts.cpu import hold_process_to_path

# ATen, oneDNN and MKL held to the kernel path's level (OMNISERVE_CPU_ISA=avx2|generic forces one), here and in every
# process the tests start, before any of them reads its variable: one machine runs another's paths.
hold_process_to_path()

from bench.local_serve import local_serve  # noqa: E402

# Ray's single-machine mode: every address Ray binds and dials is the loopback, here and in every process the
# tests start (read when ray is first imported, which is after this file).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")




#: Seconds each scope took (setup, calls and teardown, from `pytest --durations`, 2-core EPYC, 2026-12-02): the
#: scheduler hands out the longest first, so no long module starts last while the other worker idles (measured before:
#: the reliability modules, few tests each, went last and ran 6 minutes on one worker). Only the order matters;
#: a scope not listed counts as short.
SCOPE_SECONDS = {
    "tests/orchestration": 660,
    "tests/orchestration:small": 170,
    "tests/reliability/test_llm_faults.py": 250,
    "tests/stages/test_llm_serve.py": 240,
    "tests/stages/test_diffusion_stage.py": 240,
    "tests/stages/test_step_engine.py": 200,
    "tests/stages/test_diffusion_audit.py": 190,
    "tests/stages/test_parallel_group.py": 300,
    "tests/stages/test_sequence_parallel_group.py": 400,
    "tests/reliability/test_node_loss.py": 180,
    "tests/bench/test_app.py": 90,
    "tests/orchestration/test_autoscaling.py": 120,
    "tests/orchestration/test_cluster_path.py": 90,
    "tests/orchestration/test_parallel_app.py": 400,
    "tests/stages/test_img2img.py": 80,
    "tests/stages/test_parallel_render.py": 60,
    "tests/stages/test_llm.py": 70,
    "tests/stages/test_kernels.py": 60,
    "tests/reliability/test_replica_loss.py": 60,
    "tests/reliability/test_group_faults.py": 150,
    "tests/reliability/test_scale_down.py": 40,
    "tests/test_make_serve.py": 60,
    "tests/stages/test_llm_audit.py": 55,
    "tests/bench/test_llm.py": 45,
    "tests/stages/test_scope.py": 40,
    "tests/stages/test_llm_golden.py": 40,
    "tests/test_gpu_check_script.py": 30,
    "tests/test_golden.py": 20,
}


#: The orchestration modules that use the package's "/small" app only (tests/orchestration/conftest.py): one scope of
#: their own, so they run beside the shared apps' modules on the other worker, which starts only the small app.
SMALL_APP_MODULES = ("tests/orchestration/test_schema_fuzz.py", "tests/orchestration/test_rewriter_http.py")
#: Orchestration modules that use none of the package's apps (their own app, or a Ray of their own): scopes of their
#: own, so a worker that has the package's apps running is not also given theirs.
APART_MODULES = (
    "tests/orchestration/test_cluster_path.py",
    "tests/orchestration/test_autoscaling.py",
    "tests/orchestration/test_parallel_app.py",
)


def pytest_xdist_make_scheduler(config, log):
    """Two xdist workers (pyproject's addopts): each test module whole on one worker, so its module fixtures start
    once; the orchestration package whole on one, since its modules share one app (tests/orchestration/conftest.py);
    the longest scopes first (SCOPE_SECONDS). (xdist's own `loadgroup` marks do not reach its node ids under pytest 9,
    measured: modules were split.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in SMALL_APP_MODULES:
                return "tests/orchestration:small"
            if path in APART_MODULES:
                return path
            return "tests/orchestration" if path.startswith("tests/orchestration/") else path

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda scope: SCOPE_SECONDS.get(scope, 0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def serve_instance():
    """A local Ray instance (2 CPUs) with Serve's HTTP proxy on a free loopback port; yields the base URL.

    Each test module deploys its own applications under its own names and deletes them when done.
    """
    with local_serve(2, "omniserve-tests") as base:
        yield base


@pytest.fixture
def clean_switches(monkeypatch):
    """No batch-invariance variable set: each test sets what it means."""
    for name in ("VLLM_BATCH_INVARIANT", "OMNI_LLM_BATCH_INVARIANT", "OMNI_DIFFUSION_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
