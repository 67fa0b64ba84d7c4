"""Fixtures shared by the suite: one local Ray instance with Serve for every test that needs one.

Loopback only, bounded, and torn down by handle: `ray.init(address="local")` always starts a fresh
instance of our own (never someone else's cluster), and the session ends it with `ray.shutdown()`.
Tests that use it are marked `slow` (they start Ray, vLLM or a pipeline).
"""

from __future__ import annotations

import os
import socket

import pytest

# Ray's single-machine mode: every address Ray binds and dials is the loopback, here and in every process the
# tests start (read when ray is first imported, which is after this file).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_instance():
    """A local Ray instance (2 CPUs) with Serve's HTTP proxy on a free loopback port; yields the base URL.

    Each test module deploys its own applications under its own names and deletes them when done.
    """
    import ray
    from ray import serve

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="omniserve-tests",
             _node_ip_address="127.0.0.1")  # Ray's own traffic stays on the loopback too
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def clean_switches(monkeypatch):
    """No batch-invariance variable set: each test sets what it means."""
    for name in ("VLLM_BATCH_INVARIANT", "OMNI_LLM_BATCH_INVARIANT", "OMNI_DIFFUSION_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
