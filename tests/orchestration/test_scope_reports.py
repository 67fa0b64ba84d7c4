"""Where the verified scope is reported, from the stages' real result types: /health per stage and replica, and
each response's `invariance.<stage>` (pure functions; the app end to end is in test_scope_app.py)."""

from contracts.results import Provenance, StageDescription
from orchestration.health import stage_health
from orchestration.responses import scope

TWO_RUNNING = {"configured": 2, "running": 2, "status": "HEALTHY"}
REASON = "model /home/me/models/secret not audited (audited embedded:tiny-llama)"


def described(replica: str, verified: bool) -> StageDescription:
    return StageDescription(stage="llm", model="m", replica=replica, batch_invariant=True, kernel_backend="cpu", kernels={},
                            kernels_installed=True, running=True, verified=verified,
                            scope_differences=[] if verified else [REASON])


def test_health_gives_each_replicas_verdict_and_an_unverified_one_is_information_not_a_fault():
    health = stage_health(True, 2, TWO_RUNNING, [described("r1", True), described("r2", False)])
    assert health.state == "running" and health.reasons == []
    assert health.verified is False
    assert health.scope["r1"].verified and health.scope["r1"].differences == []
    # Paths are cut to their last part, as everywhere in /health.
    assert health.scope["r2"].differences == ["model .../secret not audited (audited embedded:tiny-llama)"]
    assert stage_health(True, 2, TWO_RUNNING, [described("r1", True), described("r2", True)]).verified is True


def test_a_response_is_verified_only_when_every_result_was_and_lists_each_reason_once():
    ok = Provenance(model="m", batch_invariant=True, kernel_backend="cpu", verified=True, verified_by="audit record r")
    big = ok.model_copy(update={"verified": False, "verified_by": "",
                                "scope_differences": ["size 512x512 not audited (audited 64x64)"]})
    assert scope([ok, ok]) == {"verified": True, "verified_by": ["audit record r"], "scope_differences": []}
    assert scope([big, ok, big]) == {"verified": False, "verified_by": ["audit record r"],
                                     "scope_differences": ["size 512x512 not audited (audited 64x64)"]}
    assert scope([]) == {}  # a stage that was not used says nothing
