"""A diffusion replica's start-up self-audit (stages/diffusion/self_audit.py): it proves its own configuration where it
runs, its record is keyed by the weights' content (not the model's name or path) and reused at the next start, and a
replica whose kernels are not really in (the test-only fault) is caught.

The replicas are the Serve class itself, in-process; the user's record cache is a temporary directory. Whether a
stock control varies depends on the kernel path this machine runs (on AVX-512 the default model's does, measured:
5 of 7 quick runs; on some AVX2 machines it may not): where it does not, the tests skip saying what was measured.
"""

import shutil
from contextlib import contextmanager

import pytest

import contracts.scope
from contracts.config import DiffusionStageConfig
from contracts.scope import OutsideVerifiedScopeError
from stages.diffusion import DiffusionStage
from stages.kernels import disable_batch_invariant_kernels

pytestmark = pytest.mark.slow

SIZE = {"defaults": {"height": 64, "width": 64}}


@pytest.fixture(autouse=True)
def user_records(tmp_path, monkeypatch):
    directory = tmp_path / "scope"
    monkeypatch.setattr(contracts.scope, "user_records", lambda: directory)
    return directory


@contextmanager
def replica(**config):
    defaults = {"batch_invariant": True, "warm_up": False, "torch_threads": 1, "max_batch_size": 4, **SIZE}
    stage = DiffusionStage.func_or_class(DiffusionStageConfig(**{**defaults, **config}))
    try:
        yield stage
    finally:
        stage.batching.engine.stop()
        disable_batch_invariant_kernels()


def proven(stage):
    audit = stage.scope.self_audit
    if not audit.reused and not audit.control_varied:
        pytest.skip(f"measured on this machine's kernel path: {audit.reason}")
    return audit


def test_a_replica_proves_itself_writes_its_record_and_its_second_start_reuses_it(user_records):
    with replica() as first:
        audit = proven(first)
        assert audit.runs == 3 and not audit.reused and audit.differing == [] and audit.seconds > 0
        assert first.scope.verdict.verified and first.scope.verdict.by.startswith("self-audit record ")
    (written,) = user_records.iterdir()
    assert written.name == audit.record and written.name.endswith(".json") and "-self-audit-" in written.name
    with replica() as second:
        again = second.scope.self_audit
        assert again.reused and again.runs == 0 and again.record == audit.record
        assert second.scope.verdict.verified and second.scope.verdict.record == audit.record


def test_health_reports_the_self_audit(user_records):
    import asyncio

    with replica() as stage:
        proven(stage)
        details = asyncio.run(stage.describe()).details["self_audit"]
    assert details["mode"] == "quick" and details["runs"] == 3 and details["control_varied"]
    assert details["reason"].startswith("self-audit: control varied, 0 of 3 co-batched runs differed")


def test_the_same_weights_from_another_directory_or_name_reuse_the_record_and_one_changed_tensor_does_not(
    tmp_path, user_records
):
    import torch

    from stages.diffusion.renderer import load_pipeline
    from stages.embedded import DEFAULT_MODELS

    pipe = load_pipeline(DEFAULT_MODELS["diffusion"], device="cpu", dtype="float32")
    saved = tmp_path / "my-model"
    pipe.save_pretrained(saved)
    with replica(model=str(saved)) as first:
        audit = proven(first)
        assert not audit.reused and first.scope.verdict.verified
    renamed = tmp_path / "renamed-model"
    saved.rename(renamed)
    with replica(model=str(renamed)) as moved:
        assert moved.scope.self_audit.reused and moved.scope.self_audit.record == audit.record
        assert moved.scope.verdict.verified
    changed = tmp_path / "changed-model"
    shutil.copytree(renamed, changed)
    with torch.no_grad():
        next(pipe.unet.parameters()).add_(1e-3)  # one tensor of the UNet
    pipe.unet.save_pretrained(changed / "unet")
    with replica(model=str(changed)) as other:
        assert not other.scope.self_audit.reused and other.scope.self_audit.runs == 3
        assert other.scope.configuration.weights != first.scope.configuration.weights
    assert len(list(user_records.iterdir())) == 2


def test_kernels_left_out_while_the_switch_says_on_are_caught_strict_refuses_naming_the_case(monkeypatch):
    monkeypatch.setenv("OMNISERVE_TEST_FAULT", "kernels-uninstalled")
    with replica() as stage:
        audit = stage.scope.self_audit
        if not audit.control_varied:
            pytest.skip(f"measured on this machine's kernel path: {audit.reason}")
        assert stage.renderer.kernels.installed  # what the replica believes
        assert audit.differing and all(case.startswith("batch ") for case in audit.differing)
        verdict = stage.scope.verdict
        assert not verdict.verified and any("co-batched differed from solo" in d for d in verdict.differences)
        assert stage.provenance.verified is False
    with pytest.raises(OutsideVerifiedScopeError, match=r"batch \d, target middle: target \(\d+ of \d+ elements\)"):
        with replica(strict=True):
            pass
    disable_batch_invariant_kernels()


def test_control_the_same_replica_without_the_fault_is_proven(user_records):
    # The fault test's control: the same configuration with the kernels really in gives 0 differing elements.
    with replica() as stage:
        audit = proven(stage)
        assert audit.differing == [] and stage.scope.verdict.verified


def test_full_mode_covers_three_orderings_and_the_neighbours_and_its_record_serves_a_quick_start(user_records):
    with replica(self_audit="full") as full:
        audit = proven(full)
        assert audit.mode == "full" and audit.runs == 9 and audit.differing == []
    with replica(self_audit="quick") as quick:  # a full record covers what quick would render
        assert quick.scope.self_audit.reused and quick.scope.self_audit.record == audit.record


def test_a_finding_that_proves_nothing_is_kept_apart_and_not_rendered_again(user_records, monkeypatch):
    import contextlib

    import stages.diffusion.self_audit

    # The control with the kernels left in: it cannot vary, as on a device where stock computes batch-free bits.
    monkeypatch.setattr(stages.diffusion.self_audit, "stock_kernels", lambda device, group=None: contextlib.nullcontext())
    with replica() as first:
        audit = first.scope.self_audit
        assert audit.runs == 3 and not audit.control_varied and audit.record is None and not audit.reused
        assert "proves nothing here" in audit.reason
        assert not any(d.startswith("self-audit") for d in first.scope.verdict.differences)  # the records decide
    assert not list(user_records.glob("*.json"))  # no record: it verifies nothing
    (kept,) = (user_records / "inconclusive").iterdir()
    with replica() as second:
        again = second.scope.self_audit
        assert again.reused and again.runs == 0 and not again.control_varied and again.record == kept.name
        assert "proves nothing here" in again.reason
