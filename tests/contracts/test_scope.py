"""The verified scope as data (contracts/scope.py): which records cover a configuration, and what is said when none does."""

import pytest

from contracts.scope import (
    AuditResult,
    Configuration,
    Coverage,
    OutsideVerifiedScopeError,
    ScopeRecord,
    SelfCheck,
    load_records,
    resolve_strict,
)

AUDITED = Configuration(
    stage="diffusion", model="omniserve/tiny-sd-unet", weights="ab" * 32, dtype="float32", device="cpu",
    hardware=["path:avx512", "aten:AVX512"], versions={"torch": "2.13.0+cpu", "diffusers": "0.42.1"}, kernels="k1",
    torch_threads=1, engine={"batching": "step"},
)


def record(configuration=AUDITED, *, varied=True, differing=0, batch_sizes=range(1, 9), sizes=("64x64",)):
    return ScopeRecord(
        configuration=configuration,
        coverage=Coverage(batch_sizes=list(batch_sizes), sizes=list(sizes), orderings=["first", "solo"], steps=8),
        result=AuditResult(control_runs=10, control_varied=varied, invariant_runs=10, differing_with_kernels_on=differing),
    )


def test_a_record_with_an_equal_configuration_verifies_it():
    verdict = AUDITED.match([record()], batch_size=8, size="64x64")
    assert verdict.verified and verdict.differences == [] and verdict.record == record().name


def test_unverified_names_each_difference_of_the_nearest_record():
    mine = AUDITED.model_copy(update={"dtype": "bfloat16", "torch_threads": 4})
    far = record(AUDITED.model_copy(update={"dtype": "float16", "torch_threads": 2, "weights": "cd" * 32}))
    verdict = mine.match([far, record()], batch_size=8, size="64x64")
    assert not verdict.verified
    assert verdict.differences == ["dtype bfloat16 not audited (audited float32)",
                                   "thread count 4 not audited (audited 1)"]


def test_the_models_name_or_path_is_never_matched_only_its_weights():
    moved = AUDITED.model_copy(update={"model": "/home/me/models/renamed"})
    assert moved.match([record()], batch_size=8, size="64x64").verified
    retrained = AUDITED.model_copy(update={"weights": "cd" * 32})
    assert retrained.match([record()], batch_size=8, size="64x64").differences == [
        f"weights {'cd' * 6} not audited (audited {'ab' * 6})"]


def self_audited(**audited):
    made = record()
    return made.model_copy(update={"audited": {"by": "self-audit", "summary": "quick: control varied", **audited}})


def test_a_self_audit_record_is_preferred_and_says_so_and_a_differing_self_audit_outweighs_every_record():
    from contracts.scope import SelfAudit

    verdict = AUDITED.match([record(), self_audited()], batch_size=8, size="64x64")
    assert verdict.verified and verdict.record == self_audited().name != record().name
    assert verdict.by.startswith(f"self-audit record {self_audited().name}")
    caught = SelfAudit(mode="quick", runs=7, control_varied=True, differing=["batch 3, target middle: target (12 of 64)"])
    verdict = AUDITED.match([record(), self_audited()], batch_size=8, size="64x64", self_audit=caught)
    assert not verdict.verified and verdict.differences == [caught.reason]
    assert "batch 3, target middle" in caught.reason


def test_versions_engine_settings_and_hardware_are_part_of_the_configuration():
    mine = AUDITED.model_copy(update={"versions": {"torch": "2.14.0", "diffusers": "0.42.1"},
                                      "engine": {"batching": "request"}, "hardware": ["path:avx2", "aten:AVX2"]})
    differences = mine.match([record()], batch_size=8, size="64x64").differences
    assert "torch 2.14.0 not audited (audited 2.13.0+cpu)" in differences
    assert "engine setting batching request not audited (audited step)" in differences
    assert "hardware path:avx2,aten:AVX2 not audited (audited path:avx512,aten:AVX512)" in differences


def test_a_size_or_batch_bound_beyond_the_audited_ones_is_outside_the_scope():
    assert AUDITED.match([record()], batch_size=8, size="512x512").differences == [
        "size 512x512 not audited (audited 64x64)"]
    assert AUDITED.match([record(batch_sizes=[1, 2, 4])], batch_size=4, size="64x64").differences == [
        "batch sizes up to 4 not audited (audited 1,2,4)"]


def test_the_sizes_of_several_records_of_one_configuration_all_count():
    records = [record(), record(sizes=["256x256"], batch_sizes=[1, 2])]
    assert AUDITED.match(records, batch_size=2, size="256x256").verified
    assert not AUDITED.match(records, batch_size=8, size="256x256").verified


@pytest.mark.parametrize("varied, differing", [(False, 0), (True, 3)])
def test_a_record_whose_control_did_not_vary_or_that_differed_verifies_nothing(varied, differing, tmp_path):
    invalid = record(varied=varied, differing=differing)
    verdict = AUDITED.match([invalid], batch_size=8, size="64x64")
    assert not verdict.verified and "control did not vary" in verdict.differences[-1]
    with pytest.raises(ValueError, match="verifies nothing"):
        invalid.write_into(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_no_record_of_the_stage_says_so():
    llm = AUDITED.model_copy(update={"stage": "llm"})
    assert llm.match([record()], batch_size=8).differences == ["no audit record for the llm stage"]


def test_records_are_written_and_loaded_back_and_a_broken_file_is_ignored(tmp_path):
    path = record().write_into(tmp_path)
    assert path.name == record().name and path.name.startswith("diffusion-omniserve-tiny-sd-unet-float32-cpu-t1-64x64-")
    (tmp_path / "broken.json").write_text("{not json")
    assert load_records([tmp_path, tmp_path / "absent"]) == [record()]


def test_strict_follows_the_config_then_the_environment_and_is_off_by_default():
    assert resolve_strict(None, {}) is False
    assert resolve_strict(None, {"OMNISERVE_STRICT_SCOPE": "1"}) is True
    assert resolve_strict(False, {"OMNISERVE_STRICT_SCOPE": "on"}) is False
    assert resolve_strict(True, {}) is True
    with pytest.raises(ValueError, match="OMNISERVE_STRICT_SCOPE"):
        resolve_strict(None, {"OMNISERVE_STRICT_SCOPE": "maybe"})


def test_the_strict_refusal_names_the_differences_and_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(OutsideVerifiedScopeError("llm", ["dtype bfloat16 not audited (audited float32)"])))
    assert error.differences == ["dtype bfloat16 not audited (audited float32)"]
    assert "llm stage is strict" in str(error) and "dtype bfloat16 not audited" in str(error)


# --- the self-check: a replica's golden outputs against its path's column --------------------------------------


def test_a_covering_record_and_a_reproduced_self_check_verify_and_say_both():
    check = SelfCheck(path="path:avx512,aten:AVX512", total=6)
    verdict = AUDITED.match([record()], batch_size=8, size="64x64", self_check=check)
    assert verdict.verified
    assert verdict.by == f"self-check reproduced 6 of 6 golden outputs on path:avx512,aten:AVX512; audit record {record().name}"


def test_a_self_check_that_differs_leaves_a_covered_replica_unverified_naming_the_cases():
    check = SelfCheck(path="path:avx512,aten:AVX512", total=6, differing=["edit", "solo"])
    verdict = AUDITED.match([record()], batch_size=8, size="64x64", self_check=check)
    assert not verdict.verified and verdict.differences == [
        "self-check reproduced 4 of 6 golden outputs on path:avx512,aten:AVX512; differing: edit, solo"]


def test_a_record_of_another_kernel_path_covers_nothing_even_where_the_self_check_reproduced():
    mine = AUDITED.model_copy(update={"hardware": ["path:avx2", "aten:AVX2"]})
    verdict = mine.match([record()], batch_size=8, size="64x64",
                    self_check=SelfCheck(path="path:avx2,aten:AVX2", total=6))
    assert not verdict.verified
    assert verdict.differences == ["hardware path:avx2,aten:AVX2 not audited (audited path:avx512,aten:AVX512)"]
