"""OpenAI's official TypeScript SDK (npm `openai`, the exact version tests/clients/openai_ts/package-lock.json pins)
against the package's "/" app (conftest: both switches on, videos served): `node tests/clients/openai_ts/calls.mjs`
makes a Node client's calls and checks each one, then prints a JSON summary whose checks this test asserts by name.

`make openai-ts` (a prerequisite of `make test`) installs Node (Debian's nodejs and npm, when missing and we are root)
and runs `npm ci` into build/openai-ts (ignored by git). Without them this test fails saying what to run: it never skips.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "clients" / "openai_ts"
SDK_DIR = ROOT / "build" / "openai-ts"
INSTALL_HINT = "run `make openai-ts` (as root it installs Node: apt-get install nodejs npm; then npm ci into build/openai-ts)"
RUN_S = 480  # every call below (6 s on this loaded 2-core box): two video renders, seven image requests, two chats; the
# suite's 900 s timeout also covers the apps' start when this test is the first to ask for them
#: The calls calls.mjs makes, each a check of its own, in its order.
CHECKS = [
    "models.list",
    "models.retrieve",
    "images.generate n=2, same seed twice",
    "images.generate stream partial_images",
    "images.edit multipart",
    "images.generate invalid size is a 400 naming size",
    "chat.completions stream equals non-streamed, with usage",
    "videos create/retrieve/downloadContent twice, same sha256",
]

pytestmark = pytest.mark.slow


def locked_version() -> str:
    lock = json.loads((CLIENT / "package-lock.json").read_text())
    return lock["packages"]["node_modules/openai"]["version"]


def test_the_sdk_is_pinned_to_one_exact_7x_version_and_locked():
    declared = json.loads((CLIENT / "package.json").read_text())["dependencies"]["openai"]
    assert declared == locked_version() and declared.split(".")[0] == "7", declared
    assert "resolved" not in json.loads((CLIENT / "package-lock.json").read_text())["packages"]["node_modules/openai"]


def node() -> str:
    """The node binary, with the locked SDK installed beside this checkout; else a failure saying what to run."""
    found = shutil.which("node")
    if found is None:
        pytest.fail(f"the TypeScript SDK test needs node on PATH: {INSTALL_HINT}")
    installed = SDK_DIR / "node_modules" / "openai" / "package.json"
    if not installed.exists():
        pytest.fail(f"the openai TypeScript SDK is not installed in {SDK_DIR}: {INSTALL_HINT}")
    if (version := json.loads(installed.read_text())["version"]) != locked_version():
        pytest.fail(f"build/openai-ts has openai {version}, the lock pins {locked_version()}: {INSTALL_HINT}")
    return found


def test_the_official_typescript_sdk_makes_a_clients_calls_and_each_checks_out(server):
    run = subprocess.run([node(), str(CLIENT / "calls.mjs"), server, str(SDK_DIR)], capture_output=True, text=True,
                         timeout=RUN_S, cwd=ROOT)
    last = (run.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), f"calls.mjs printed no summary (exit {run.returncode}): {run.stderr[-4000:]}"
    summary = json.loads(last)
    print(json.dumps(summary, indent=1))  # the calls' details and timings, in the test's log
    failed = {c["name"]: c["error"] for c in summary["checks"] if not c["ok"]}
    assert not failed, f"{summary['sdk']} on node {summary['node']}: {json.dumps(failed, indent=1)}"
    assert [c["name"] for c in summary["checks"]] == CHECKS
    assert run.returncode == 0 and summary["ok"] is True, run.stderr[-4000:]
    assert summary["sdk"] == f"openai {locked_version()}"
