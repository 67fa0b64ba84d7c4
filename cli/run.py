"""`make serve`: `serve run TARGET` in a Ray instance of its own whose Prometheus endpoint is at a fixed port.

    python -m cli.run [--metrics-port PORT] examples.omni_app:app [serve run's arguments...]

`serve run` starts its local Ray with the metrics export port left to chance, and takes no option for it:
this starts that local Ray first (`ray.init(address="local", _metrics_export_port=...)`, Ray's only way to
fix it besides `ray start`), then runs `serve run` itself, in this process, which finds Ray started and uses
it. Ctrl-C is `serve run`'s: it removes the app; this process then exits, and Ray stops the instance this
process started (and nothing else). SIGTERM (what `docker stop`, Kubernetes and systemd send; `make serve` passes it
on) drains first (`orchestration.drain`): no new request is admitted (503 `shutting_down`), every admitted one is
answered, for at most --drain-timeout-s; then the same as Ctrl-C, and the exit status is 0. The endpoint binds the
loopback when Ray runs in its single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which the Makefile sets).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

from contracts.cpu import hold_process_to_path
from contracts.metrics import METRICS_EXPORT_PORT

#: Under Kubernetes' default grace period (30 s) before its SIGKILL; `docker stop` waits 10 s unless given `-t`.
DRAIN_TIMEOUT_S = 25.0


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ingress_replicas() -> int:
    """How many ingress replicas run now, in every app of this instance (one per app by default)."""
    from ray import serve

    from stages.serve_replica import running

    return sum(
        running(deployment)
        for app in serve.status().applications.values()
        for name, deployment in app.deployments.items()
        if name == "Ingress"
    )


def drain_then_stop(timeout_s: float) -> None:
    """SIGTERM: drain, then stop as Ctrl-C does (serve run removes the app on KeyboardInterrupt and exits 0)."""
    from orchestration.drain import start_draining, wait_drained

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one drain; a second SIGTERM does not cut it short

    def log(line: str) -> None:
        print(f"omniserve: {line}", flush=True)

    log(f"SIGTERM: draining (no new request admitted; at most {timeout_s:g} s for those in flight)")
    start_draining()
    wait_drained(ingress_replicas(), timeout_s, log)  # counted once: the controller is asked nothing per poll
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:

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
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help=f"on SIGTERM, how long admitted requests may take to be answered (default {DRAIN_TIMEOUT_S:g})",
    )
    args, serve_run_args = parser.parse_known_args(argv)
    if not serve_run_args:
        parser.error("give serve run's arguments, e.g. examples.omni_app:app")
    if not port_is_free(args.metrics_port):  # else Ray's start-up times out after a minute without saying why
        parser.error(
            f"port {args.metrics_port} is in use (another make serve?); choose another: METRICS_PORT=... make serve"
        )

    import ray
    from ray.serve.scripts import cli

    from stages.serve_replica import serve_namespace

    # The namespace `serve run` itself would use; a fresh instance, never someone else's cluster.
    ray.init(address="local", namespace=serve_namespace(), _metrics_export_port=args.metrics_port)
    print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
    # After ray.init: it installs Ray's own SIGTERM handler (a stack trace, then abort), which this one replaces.
    signal.signal(signal.SIGTERM, lambda *_: drain_then_stop(args.drain_timeout_s))
    try:
        cli.main(args=["run", *serve_run_args], prog_name="serve")
    except SystemExit as stopped:  # serve run's own exit, after Ctrl-C or a drain
        print(f"omniserve: stopped, exit status {stopped.code or 0}", flush=True)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
