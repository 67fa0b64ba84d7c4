"""A node lost under load on a real two-node Ray cluster: the service keeps answering, nothing hangs, no byte changes.

The scenario (tests/reliability/node_loss.py) runs in a process of its own, since it drives a Ray cluster of its
own; it prints its figures as JSON, which docs/reliability.md records.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("node-loss") / "figures.json"
    done = subprocess.run([sys.executable, "-m", "tests.reliability.node_loss", "--json", str(out), "--requests", "48"], cwd=ROOT,
                          capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_switch_and_the_kernels_reach_the_second_node_and_both_nodes_give_the_same_bytes(figures):
    assert {r["node"] for r in figures["replicas_before"]} == {"head", "second"}
    assert all(r["batch_invariant"] and r["kernels_installed"] for r in figures["replicas_before"])
    assert figures["same_bytes_on_both_nodes"] is True


def test_losing_a_node_under_load_loses_no_request_and_changes_no_byte(figures):
    loss = figures["under_node_loss"]
    assert loss["other"] == [], "a request got neither 200 nor 503 + Retry-After"
    assert loss["ok"] + loss["retry_later_503"] == loss["requests"] and loss["bytes_differ"] == 0
    assert loss["slowest_s"] < 100, "a request hung"
    assert figures["retried_calls"] > 0, "the node was removed while none of its calls was in flight"


def test_the_service_comes_back_on_the_nodes_it_has(figures):
    assert figures["replicas_after_loss"] == ["head"]
    assert figures["seconds_to_a_replica_on_the_new_node"] is not None
