"""The LLM audit end to end, small, through the one CLI: real engines, the control varies, the switch makes it vanish."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    path = tmp_path_factory.mktemp("llm-audit") / "audit.json"
    command = [
        sys.executable, "-m", "orchestration.cli", "audit", "--stage", "llm", "--json", str(path),
        "--targets", "short", "--batch-sizes", "1,3", "--orderings", "target-first,target-last",
        "--samplings", "seeded",
    ]
    # A process of its own: vLLM spawns processes and edits the environment of the one that starts it.
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(path.read_text())


def test_llm_audit_control_varies_and_the_switch_makes_every_run_identical(audit):
    summary = audit["summary"]
    assert summary["control_varies"], "a check whose control never varies proves nothing"
    assert summary["invariant"]
    on = [r for r in audit["runs"] if r["kernels"] == "on"]
    assert on and all(r["differing_elements"] == 0 for r in on)
    assert all(r["co_scheduled"] == r["batch_size"] for r in audit["runs"])


def test_llm_audit_runs_and_environment_have_the_shared_shape(audit):
    for run in audit["runs"]:
        assert run["stage"] == "llm" and run["kernels"] in ("off", "on") and run["sampling"] == "seeded"
        assert {"model", "ordering", "batch_size", "differing_elements", "total_elements"} <= set(run)
        assert run["differing_elements"] == run["differing_token_ids"] + run["differing_logprobs"]
    assert {(r["batch_size"], r["ordering"]) for r in audit["runs"]} == {
        (1, "solo-repeat"), (3, "target-first"), (3, "target-last")
    }
    env = audit["environment"]
    assert {"hardware", "versions", "command", "engines"} <= set(env)
    on, off = env["engines"]["on"], env["engines"]["off"]
    assert on["stage"] == "llm" and on["batch_invariant"] and not off["batch_invariant"]
    assert on["kernels"][0]["kernels"]["installed"] and not off["kernels"][0]["kernels"]["installed"]
    # Log stats on: the audit reads when each request was first scheduled.
    assert on["details"]["engine_args"]["disable_log_stats"] is False
