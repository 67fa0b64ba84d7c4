"""A Ray instance of our own on the loopback, with Serve's HTTP proxy on a free port.

Used by the benchmarks that drive a real app and by the test suite. `address="local"` always
starts a fresh instance (never someone else's cluster); every address it binds is 127.0.0.1; on
exit it stops exactly what it started, by handle.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(num_cpus: int, namespace: str) -> Iterator[str]:
    """Start Ray (num_cpus: a scheduling label) and Serve; yields the proxy's base URL; stops both."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        namespace=namespace,
        _node_ip_address="127.0.0.1",
    )  # Ray's own traffic stays on the loopback too
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
