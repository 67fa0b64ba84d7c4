"""Autoscaling the diffusion stage under a stepped load (bench/autoscale.py, which records the figures): the replica
count rises and falls, no request is lost, every response's bytes are the reference run's, and every image is verified
(a new replica renders the golden requests in its constructor, so it is verified, or says why not, before Serve routes
it anything)."""

import pytest

from bench.autoscale import CONFIG, NAME, changed, stepped_run, summary
from tests.reliability.replicas import deployed
from tests.scope_facts import record_gap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def autoscaled(serve_instance):
    with deployed(serve_instance, NAME, CONFIG) as url:
        yield url


def test_a_stepped_load_scales_the_diffusion_stage_up_and_down_losing_nothing_and_changing_no_byte(autoscaled):
    run = stepped_run(autoscaled)
    figures = summary(run)
    assert run["replicas"][0][1] == 1  # the reference ran on the single replica
    assert figures["lost"] == 0, [a for a in run["reference"] + run["answers"] if a["status"] != 200][:3]
    assert figures["peak_replicas"] >= 2 and figures["final_replicas"] == 1, (run["replicas"], run["final"])
    assert not changed(run), [(a["body"], a["replica"]) for a in changed(run)]
    assert len(figures["replicas_served"]) >= 2, figures["replicas_served"]  # the new replicas served
    if gap := record_gap("diffusion"):
        pytest.skip(f"every byte equal over {figures['responses']} responses on up to {figures['peak_replicas']} "
                    f"replicas; verification: {gap}")
    assert figures["unverified"] == 0, "an unverified image"
    print(f"{figures['responses']} responses, replicas over time {run['replicas']}")
