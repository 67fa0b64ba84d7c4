"""`make serve`: `serve run TARGET` in a Ray instance of its own whose Prometheus endpoint is at a fixed port.

    python -m cli.run [--metrics-port PORT] examples.omni_app:app [serve run's arguments...]

`serve run` starts its local Ray with the metrics export port left to chance, and takes no option for it:
this starts that local Ray first (`ray.init(address="local", _metrics_export_port=...)`, Ray's only way to
fix it besides `ray start`), then runs `serve run` itself, in this process, which finds Ray started and uses
it. Ctrl-C is `serve run`'s: it removes the app; this process then exits, and Ray stops the instance this
process started (and nothing else). The endpoint binds the loopback when Ray runs in its single-machine mode
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which the Makefile sets).
"""

from __future__ import annotations

import argparse
import socket
import sys

from contracts.metrics import METRICS_EXPORT_PORT


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> None:
    from contracts.cpu import hold_process_to_path

    hold_process_to_path()  # Ray's processes, and so every replica, inherit the kernel path's limits
    parser = argparse.ArgumentParser(
        prog="python -m cli.run", description=__doc__.splitlines()[0], allow_abbrev=False
    )  # the rest is serve run's, untouched
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_EXPORT_PORT,
        help=f"Ray's Prometheus endpoint, http://127.0.0.1:PORT/metrics (default {METRICS_EXPORT_PORT})",
    )
    args, serve_run_args = parser.parse_known_args(argv)
    if not serve_run_args:
        parser.error("give serve run's arguments, e.g. examples.omni_app:app")
    if not port_is_free(args.metrics_port):  # else Ray's start-up times out after a minute without saying why
        parser.error(
            f"port {args.metrics_port} is in use (another make serve?); choose another: METRICS_PORT=... make serve"
        )

    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.scripts import cli

    # The namespace `serve run` itself would use; a fresh instance, never someone else's cluster.
    ray.init(address="local", namespace=SERVE_NAMESPACE, _metrics_export_port=args.metrics_port)
    print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
    cli.main(args=["run", *serve_run_args], prog_name="serve")


if __name__ == "__main__":
    main(sys.argv[1:])
