"""The cluster path of docs/operations.md, end to end, as a user types it after `make test` has run on the machine.

    export RAY_AUTH_MODE=token
    ray get-auth-token --generate >/dev/null
    ray start --head && serve deploy examples/omni_app.yaml
    serve status
    serve shutdown -y

Any local `ray.init()` (the suite's, `make serve`'s) writes `~/.ray/auth_token`, and `ray start --head` then turns
Ray's token authentication on; the `serve` CLI sends the token only when `RAY_AUTH_MODE=token` is in its own
environment, hence the `export` there (docs/security.md). This runs those commands with only what a test beside
the suite's own Ray instance needs added: every port free and on the loopback (Ray's single-machine mode), a temp dir
of its own, the dashboard address passed to `serve`, and the example YAML on a free HTTP port with the LLM scaled to
zero and one diffusion replica (the request below does not rewrite its prompt). `ray stop` would stop every Ray on
the machine: the head is stopped by its process session instead, which `ray start` started and every process of the
head (GCS, raylet, dashboard, agents, workers) keeps, in `ray stop`'s order. The token file is never rewritten.
"""

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's `ray` and `serve`, as on the docs' user's PATH
TOKEN_FILE = Path.home() / ".ray" / "auth_token"
RUNNING_TIMEOUT_S = 300
#: Every port `ray start --head` would otherwise take at a fixed default (6379, 8265, 10001, 52365, ...) or by chance
#: (the metrics port); the raylet's own ports and the workers' Ray chooses free.
PORT_FLAGS = (
    "dashboard-port",
    "port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
PROMPT = "a red circle on a blue background"
NOT_INHERITED = ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:  # held together, so the ports differ
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def readme_env() -> dict[str, str]:
    """This process's environment as a fresh shell's, then docs/operations.md's `export RAY_AUTH_MODE=token`.

    The suite's own `ray.init()` set RAY_AUTH_MODE=token in this process (Ray does, for a new local instance): it is
    dropped, so that the test shows what that export does, not what the suite left behind."""
    env = {name: value for name, value in os.environ.items() if name not in NOT_INHERITED}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every address Ray binds is the loopback
    return {**env, "RAY_AUTH_MODE": "token"}


def run(args: list, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def session_members(sid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(name)) == sid:
                    members.append(int(name))
    return members


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_session(sid: int, grace_s: float = 8) -> list[int]:
    """`ray stop` for one head: the raylet first, then the rest, the GCS last; SIGTERM, then SIGKILL after grace_s.
    Only the processes of the session `ray start` opened. Returns those still alive (none, normally)."""

    def bucket(pid: int) -> int:
        line = command_line(pid)
        return 0 if "raylet/raylet" in line else 2 if "gcs/gcs_server" in line else 1

    for stage in (0, 1, 2):
        targets = [pid for pid in session_members(sid) if bucket(pid) == stage]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while (targets := [p for p in targets if p in session_members(sid)]) and time.monotonic() < deadline:
                time.sleep(0.5)
            if not targets:
                break
    time.sleep(1)  # workers leave after their raylet
    return session_members(sid)


def deploy_config(path: Path, http_port: int) -> Path:
    """examples/omni_app.yaml on a free port, small: the LLM scaled to zero, one diffusion replica."""
    config = yaml.safe_load((ROOT / "examples" / "omni_app.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["llm"].pop("num_replicas")
    args["llm"]["autoscaling_config"] = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}
    args["diffusion"]["num_replicas"] = 1
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


#: `ray start --head` tries: Ray waits a fixed 30 s for the new raylet to register with the GCS
#: (ray/_private/node.py, `raylet_start_wait_time_s`), which a 2-core machine busy with the rest of the suite can
#: miss (measured once in a fresh-clone `make test`: "The current node timed out during startup").
HEAD_START_TRIES = 2


class HeadStartTimedOut(Exception):
    """`ray start --head` gave up waiting for its own raylet; its processes are stopped."""


@contextlib.contextmanager
def started_head(env: dict[str, str]):
    """One `ray start --head` on free loopback ports in a temp dir of its own; yields its dashboard URL; stops it.

    The temp dir is short (Ray's socket paths must fit 107 bytes) and under /tmp, like Ray's own."""
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    flags = [f"--{flag}={port}" for flag, port in ports.items()]
    with tempfile.TemporaryDirectory(prefix="omniray-", dir="/tmp", ignore_cleanup_errors=True) as temp_dir:
        command = [BIN / "ray", "start", "--head", "--node-ip-address=127.0.0.1", *flags, f"--temp-dir={temp_dir}"]
        # start_new_session: its session holds every process of this head, and nothing else.
        start = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            out, _ = start.communicate(timeout=180)
            if start.returncode != 0 and "timed out during startup" in out:
                raise HeadStartTimedOut(out[-4000:])
            assert start.returncode == 0, out[-4000:]
            yield f"http://127.0.0.1:{ports['dashboard-port']}"
        finally:
            if start.poll() is None:
                start.kill()
            left = stop_session(start.pid)
            assert not left, f"processes of the head still run: {[command_line(p)[:120] for p in left]}"


@pytest.fixture
def head():
    """A Ray head as the README starts it (`started_head`); yields (dashboard URL, env). A start that timed out
    waiting for its raylet is stopped and tried again, up to HEAD_START_TRIES."""
    env = readme_env()
    token_before = TOKEN_FILE.read_bytes() if TOKEN_FILE.exists() else None
    generated = run([BIN / "ray", "get-auth-token", "--generate"], env)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert token_before is None or TOKEN_FILE.read_bytes() == token_before, "an existing token was replaced"
    for attempt in range(1, HEAD_START_TRIES + 1):
        try:
            with started_head(env) as address:
                yield address, env
            return
        except HeadStartTimedOut as timed_out:
            if attempt == HEAD_START_TRIES:
                raise AssertionError(f"ray start --head timed out {attempt} times; the last: {timed_out}") from None


def serve_status(address: str, env: dict[str, str]) -> dict:
    status = run([BIN / "serve", "status", "-a", address], env)
    assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-4000:]
    return yaml.safe_load(status.stdout)


def wait_running(address: str, env: dict[str, str]) -> dict:
    deadline, app = time.monotonic() + RUNNING_TIMEOUT_S, {}
    while time.monotonic() < deadline:
        app = (serve_status(address, env).get("applications") or {}).get("omniserve") or {}
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        if app.get("status") == "RUNNING":
            return app
        time.sleep(5)
    raise AssertionError(f"omniserve not RUNNING within {RUNNING_TIMEOUT_S} s: {app}")


def test_the_readme_cluster_path_deploys_serves_and_shuts_down(head, tmp_path):
    address, env = head
    http_port = free_ports(1)[0]
    config = deploy_config(tmp_path / "omni_app.yaml", http_port)

    # Without docs/operations.md's export: Ray's token authentication is on, and the serve CLI does not send the token.
    no_export = {name: value for name, value in env.items() if name != "RAY_AUTH_MODE"}
    refused = run([BIN / "serve", "status", "-a", address], no_export)
    assert refused.returncode != 0 and "Missing authentication token" in refused.stdout + refused.stderr
    assert httpx.get(f"{address}/api/serve/applications/", timeout=30).status_code == 401

    deployed = run([BIN / "serve", "deploy", config, "-a", address], env)
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-4000:]
    app = wait_running(address, env)
    assert app["deployments"]["DiffusionStage"]["replica_states"] == {"RUNNING": 1}

    base = f"http://127.0.0.1:{http_port}"
    health = httpx.get(f"{base}/health", timeout=60)
    assert health.status_code == 200 and health.json()["stages"]["diffusion"]["state"] == "running", health.text
    body = {"prompt": PROMPT, "seed": 7, "size": "64x64", "num_inference_steps": 2, "enhance_prompt": False}
    response = httpx.post(f"{base}/v1/images/generations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    (image,) = response.json()["data"]
    assert image["seed"] == 7 and image["revised_prompt"] == PROMPT
    assert base64.b64decode(image["b64_json"]).startswith(b"\x89PNG\r\n\x1a\n")

    shutdown = run([BIN / "serve", "shutdown", "-y", "-a", address], env)
    assert shutdown.returncode == 0, shutdown.stderr[-4000:]
