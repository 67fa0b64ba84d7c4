"""Each replica's verified scope (stages/scope.py) and `omniserve audit --record` (evidence/record.py).

Diffusion replicas are constructed in-process (the Serve class itself, no Ray); the LLM's in a process of its
own (vLLM spawns processes and edits the environment of the one that starts it). Records are read from the
repository (docs/evidence/scope) and from a temporary user cache.
"""

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import contracts.scope
from cli.main import main
from contracts.config import DiffusionStageConfig
from contracts.errors import InvalidRequestError
from contracts.jobs import RenderJob, final_image
from contracts.provenance import read_record
from contracts.sampling import DiffusionSamplingParams
from contracts.scope import OutsideVerifiedScopeError, load_records
from evidence.record import build_record
from stages.diffusion import DiffusionStage
from stages.embedded import DEFAULT_MODELS
from stages.kernels import disable_batch_invariant_kernels
from tests.scope_facts import record_gap

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def user_records(tmp_path, monkeypatch):
    """The user's records: a fresh directory (the shipped ones stay)."""
    directory = tmp_path / "scope"
    monkeypatch.setattr(contracts.scope, "user_records", lambda: directory)
    return directory


@pytest.fixture
def path_record():
    """The tests below that expect a verdict naming a field need a record of the diffusion default on this path."""
    if gap := record_gap("diffusion"):
        pytest.skip(gap)


@contextmanager
def replica(**config):
    """A replica judged by the records alone (its self-audit off: tests/stages/test_self_audit.py has it on)."""
    defaults = {"batch_invariant": True, "warm_up": False, "self_audit": "off"}
    stage = DiffusionStage.func_or_class(DiffusionStageConfig(**{**defaults, **config}))
    try:
        yield stage
    finally:
        if stage.batching.mode == "step":
            stage.batching.engine.stop()
        disable_batch_invariant_kernels()


def described(stage):
    import asyncio

    return asyncio.run(stage.describe())


def generate(stage, size: int, steps: int = 1):
    import asyncio

    params = DiffusionSamplingParams(seed=3, height=size, width=size, num_inference_steps=steps)
    return asyncio.run(final_image(stage.render(RenderJob(prompt="a red fox", params=params))))


def test_with_the_defaults_the_diffusion_replica_and_its_images_are_verified_by_the_shipped_records(path_record):
    with replica() as stage:
        description = described(stage)
        assert description.verified and description.scope_differences == [], description.scope_differences
        image = generate(stage, 64)
    assert image.verified
    assert "verified" not in read_record(image.png).stages["diffusion"].model_dump()  # the verdict is not in the bytes


def test_an_image_beyond_the_audited_sizes_is_unverified_in_its_provenance_while_the_replica_stays_verified(path_record):
    with replica() as stage:
        image = generate(stage, 512)
        assert described(stage).verified
    reason = "size 512x512 not audited"
    assert not image.verified and any(d.startswith(reason) for d in image.scope_differences)
    assert "scope_differences" not in read_record(image.png).stages["diffusion"].model_dump()  # not in the bytes


def test_a_replica_serving_512x512_by_default_is_unverified_and_strict_mode_refuses_to_start_it(path_record, monkeypatch):
    big = {"defaults": {"height": 512, "width": 512}}
    with replica(**big) as stage:
        description = described(stage)
    assert not description.verified and any(d.startswith("size 512x512 not audited") for d in description.scope_differences)
    with pytest.raises(OutsideVerifiedScopeError, match="size 512x512 not audited"):
        replica(strict=True, **big).__enter__()
    monkeypatch.setenv("OMNISERVE_STRICT_SCOPE", "1")  # the environment's strict mode, for a config that says null
    with pytest.raises(OutsideVerifiedScopeError, match="size 512x512 not audited"):
        replica(**big).__enter__()
    disable_batch_invariant_kernels()


def test_a_strict_replica_refuses_an_unaudited_size_naming_the_field_and_serves_the_audited_one(path_record):
    with replica(strict=True) as stage:
        with pytest.raises(InvalidRequestError, match="outside its verified scope") as refused:
            generate(stage, 512)
        assert refused.value.param == "size" and refused.value.code == "outside_verified_scope"
        assert generate(stage, 64).verified


def test_with_invariance_off_there_is_nothing_to_verify_and_strict_mode_does_not_refuse():
    with replica(batch_invariant=False, strict=True) as stage:
        description = described(stage)
    assert not description.verified and description.scope_differences == ["batch invariance is off: nothing to verify"]


#: A random-weight pipeline (the audits' wider test): its stock kernels vary with the batch at batch size 2 here.
RANDOM_UNET = "omniserve/tiny-sd-unet"


def audit(*options: str) -> int:
    return main(["audit", "--stage", "diffusion", "--model", RANDOM_UNET, "--steps", "2", *options])


def test_audit_record_grows_the_scope_to_a_new_thread_count_and_the_next_replica_is_verified(path_record, user_records):
    new = {"model": RANDOM_UNET, "torch_threads": 2, "max_batch_size": 2}
    with replica(**new) as stage:
        before = described(stage)
    assert not before.verified and "thread count 2 not audited (audited 1)" in before.scope_differences

    assert audit("--torch-threads", "2", "--batch-sizes", "1,2", "--record") == 0
    (written,) = user_records.iterdir()
    record = json.loads(written.read_text())
    assert record["configuration"]["torch_threads"] == 2 and record["coverage"]["batch_sizes"] == [1, 2]
    assert record["result"]["control_varied"] and record["result"]["differing_with_kernels_on"] == 0

    with replica(**new) as stage:
        after = described(stage)
    assert after.verified and after.scope_differences == []


def test_a_record_whose_control_cannot_vary_is_never_written(user_records, tmp_path):
    # Batch size 1 only: solo against solo, the control cannot vary, so the audit proves nothing.
    assert audit("--torch-threads", "2", "--batch-sizes", "1", "--record", str(tmp_path / "shipped")) == 1
    assert not (tmp_path / "shipped").exists() and not user_records.exists()
    # Nor from a report whose control ran at batch sizes > 1 without a difference.
    report = {"runs": [{"model": "m", "kernels": k, "batch_size": 2, "ordering": "first", "differing_elements": 0}
                       for k in ("off", "on")]}
    record, why = build_record(report, {"model": "m", "configuration": {}, "coverage": {}})
    assert record is None and "control never varied" in why


def _llm_run(kernels: str, threads: int, differing: int, digest: str) -> dict:
    return {"model": "m", "kernels": kernels, "torch_threads": threads, "batch_size": 2, "ordering": "target-first",
            "target": "long", "sampling": "seeded", "target_position": 0, "differing_elements": differing,
            "target_digest": digest, "reference_digest": "solo"}


def _llm_entry(threads: int) -> dict:
    configuration = {"stage": "llm", "model": "m", "weights": "w", "dtype": "float32", "device": "cpu",
                     "hardware": ["path:avx2", "aten:AVX2"], "versions": {}, "kernels": "k", "torch_threads": threads,
                     "engine": {}}
    return {"model": "m", "configuration": configuration, "coverage": {}}


def test_a_control_that_varied_only_at_another_thread_count_stands_in_when_the_kernels_on_bits_are_equal():
    # 1 thread: the control never varied; 2 threads: it did, and the kernels-on target gave the same bits at both.
    runs = [_llm_run("off", 1, 0, "a"), _llm_run("on", 1, 0, "b"), _llm_run("off", 2, 5, "c"), _llm_run("on", 2, 0, "b")]
    record, why = build_record({"runs": runs}, _llm_entry(1))
    assert record is not None, why
    assert record.result.control_varied and record.result.control_threads == 2
    assert record.result.control_runs == 1 and record.result.invariant_runs == 1


def test_a_control_at_another_thread_count_stands_in_for_nothing_when_the_kernels_on_bits_differ_there():
    runs = [_llm_run("off", 1, 0, "a"), _llm_run("on", 1, 0, "b"), _llm_run("off", 2, 5, "c"), _llm_run("on", 2, 0, "x")]
    record, why = build_record({"runs": runs}, _llm_entry(1))
    assert record is None and "did not give the bits of the 1-thread runs" in why
    alone = [_llm_run("off", 1, 0, "a"), _llm_run("on", 1, 0, "b")]
    record, why = build_record({"runs": alone}, _llm_entry(1))
    assert record is None and "control never varied" in why and "--control-threads" in why


def test_the_shipped_records_are_valid_and_cover_the_diffusion_default():
    records = load_records([contracts.scope.SHIPPED_RECORDS])
    assert records and all(r.valid for r in records)
    assert DEFAULT_MODELS["diffusion"] in {r.configuration.model for r in records}


def test_the_shipped_records_cover_the_llm_default():
    if gap := record_gap("llm"):
        pytest.skip(gap)
    assert DEFAULT_MODELS["llm"] in {r.configuration.model for r in load_records([contracts.scope.SHIPPED_RECORDS])}


LLM_SCRIPT = """
import asyncio, json
from contracts.config import LLMStageConfig
from contracts.scope import AuditResult, Coverage, OutsideVerifiedScopeError, ScopeRecord
from stages.llm import LLMStage
from stages.scope import ReplicaScope, llm_configuration

async def start():
    stage = LLMStage.func_or_class.__new__(LLMStage.func_or_class)
    # The records alone judge it (its self-audit, which may prove bfloat16 here, is tests/stages/test_llm_self_audit.py's).
    await stage.__init__(LLMStageConfig(dtype="bfloat16", batch_invariant=True, self_audit="off"))
    try:
        out = {"describe": (await stage.describe()).model_dump(include={"verified", "scope_differences"})}
        # A valid record of the float32 default, as an audit of this machine would write it (the shipped ones may
        # lack one: tests/scope_facts.py): the nearest record's difference names the dtype.
        mine = llm_configuration(stage.engine)
        record = ScopeRecord(configuration=mine.model_copy(update={"dtype": "float32"}),
                             coverage=Coverage(batch_sizes=list(range(1, 9)), orderings=["solo"]),
                             result=AuditResult(control_runs=1, control_varied=True, invariant_runs=1,
                                                differing_with_kernels_on=0))
        try:
            ReplicaScope(mine, batch_invariant=True, batch_size=stage.engine.config.max_num_seqs, strict=True,
                         records=[record])  # what a strict stage runs at start-up, on this configuration
        except OutsideVerifiedScopeError as err:
            out["strict"] = str(err)
        print("RESULT " + json.dumps(out))
    finally:
        stage.engine.shutdown()

if __name__ == "__main__":
    asyncio.run(start())
"""


def test_the_llm_in_bfloat16_is_unverified_with_the_reason_and_strict_mode_refuses_it(tmp_path):
    script = tmp_path / "llm_scope.py"
    script.write_text(LLM_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["describe"]["verified"] is False and result["describe"]["scope_differences"]
    reason = "dtype bfloat16 not audited (audited float32)"
    assert "llm stage is strict" in result["strict"] and reason in result["strict"]


# --- the self-check: a record of the replica's kernel path covers it wherever the record was made ----------------


def test_a_replica_is_verified_by_its_paths_record_and_its_own_self_check(path_record):
    # The shipped records name the kernel path, not the CPU they were audited on (their `audited` says which): this
    # machine is covered because it runs that path and reproduces the path's golden outputs at start-up. Its golden
    # requests render up to 6 steps, whatever the deployment's step limit: a limit below that still starts verified.
    with replica(torch_threads=1, max_inference_steps=2) as stage:
        description = described(stage)
        check = stage.scope.self_check
        if not check.total:
            pytest.skip(f"measured: {check.reason}")
        assert check.verified, check.reason
        assert description.verified and description.scope_differences == [], description.scope_differences
        assert description.verified_by.startswith("self-check reproduced 6 of 6 golden outputs on path:")
        assert "audit record diffusion-" in description.verified_by
        assert generate(stage, 64).verified


def test_a_replica_whose_self_check_differs_is_unverified_and_names_what_differed(monkeypatch):
    from contracts.scope import GoldenColumn
    from tests.scope_facts import golden_gap

    if gap := golden_gap():  # then every output differs here, not the one altered below
        pytest.skip(gap)

    columns = contracts.scope.load_golden()
    altered = [GoldenColumn.model_validate({**c.model_dump(), "digests": {**c.digests, "edit": "0" * 64}}) for c in columns]
    monkeypatch.setattr(contracts.scope, "load_golden", lambda path=None: altered)
    import stages.diffusion.self_check

    monkeypatch.setattr(stages.diffusion.self_check, "load_golden", lambda path=None: altered)
    with replica(torch_threads=1) as stage:
        check = stage.scope.self_check
        if not check.total:
            pytest.skip(f"measured: {check.reason}")
        description = described(stage)
        assert not description.verified and check.differing == ["edit"]
        assert any("differing: edit" in d for d in description.scope_differences), description.scope_differences
