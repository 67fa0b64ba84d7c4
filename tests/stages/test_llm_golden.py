"""The LLM stage's golden table (stages/llm/self_check.py, recorded by evidence/golden.py): canonical requests on a
real engine, the self-check, and
how it lets another machine's audit record cover a replica (contracts.scope.match).

One LLM replica per module, in a process of its own (vLLM spawns processes and edits the environment of the one
that starts it): the Serve class itself (no Ray) with the embedded default model, invariance on, one thread. It
starts with an empty golden table (its self-check finds no column and runs nothing), then computes the digests
twice, writes its column and checks itself against it as a replica does at start-up, timed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.scope import (
    AuditResult,
    Configuration,
    Coverage,
    GoldenColumn,
    ScopeRecord,
    load_golden,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, json, sys, time
from pathlib import Path
from contracts.config import LLMStageConfig
from contracts.scope import load_golden
import stages.llm.self_check as golden
from evidence.golden import llm_golden_column
import stages.llm.stage as stage_module
from stages.llm import LLMStage
from stages.scope import llm_configuration, llm_scope

TABLE = Path(sys.argv[1])

async def main():
    golden.load_golden = lambda: load_golden(TABLE)  # the replica's table: empty until its column is written
    timed = {}

    async def self_check(engine, configuration):  # the stage's own call at start-up, timed
        started = time.monotonic()
        try:
            return await golden.llm_self_check(engine, configuration)
        finally:
            timed["start_self_check_s"] = time.monotonic() - started

    stage_module.llm_self_check = self_check
    stage = LLMStage.func_or_class.__new__(LLMStage.func_or_class)
    started = time.monotonic()
    await stage.__init__(LLMStageConfig(batch_invariant=True, torch_threads=1, self_audit="off"))
    out = {"stage_start_s": time.monotonic() - started, "engine_start_s": stage.engine.startup_s, **timed}
    engine = stage.engine
    try:
        scope = engine.scope
        out["no_column"] = {"total": scope.self_check.total, "reason": scope.self_check.reason,
                            "verdict": scope.verdict.model_dump()}
        configuration = llm_configuration(engine)
        out["configuration"] = configuration.model_dump(mode="json")
        out["max_num_seqs"] = engine.config.max_num_seqs
        runs = []
        for _ in range(2):
            started = time.monotonic()
            runs.append(await golden.llm_digests(engine))
            out.setdefault("digests_s", []).append(time.monotonic() - started)
        out["runs"] = runs
        column = await llm_golden_column(engine, configuration)
        out["column"] = column.model_dump(mode="json")
        column.write_into(TABLE)
        started = time.monotonic()  # what a replica runs at start-up once its column exists
        check = await golden.llm_self_check(engine, configuration)
        engine.scope = llm_scope(engine, self_check=check, configuration=configuration)
        out["self_check_s"] = time.monotonic() - started
        out["self_check"] = check.model_dump()
        out["verdict"] = engine.scope.verdict.model_dump()
        print("RESULT " + json.dumps(out))
    finally:
        engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llm-golden")
    script, table = directory / "llm_golden.py", directory / "golden.json"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(table)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    result["table"] = load_golden(table)
    print({k: result[k] for k in ("stage_start_s", "engine_start_s", "start_self_check_s", "digests_s", "self_check_s")})
    return result


def test_the_canonical_requests_repeat_bit_for_bit_and_co_batching_changes_no_target(replica):
    first, second = replica["runs"]
    assert first == second
    assert set(first) == {f"{sampling} {case}" for sampling in ("greedy", "seeded") for case in (
        "solo", "co-batched target", "co-batched neighbour 1", "co-batched neighbour 2")}
    for sampling in ("greedy", "seeded"):
        assert first[f"{sampling} solo"] == first[f"{sampling} co-batched target"]
        # Distinct requests, distinct digests: the cases are not one output. (Greedy and seeded are one output for
        # the trained default: sampled at temperature 1 it writes its greedy answer, measured on 6 prompts.)
        assert len({first[f"{sampling} {case}"] for case in ("solo", "co-batched neighbour 1", "co-batched neighbour 2")}) == 3
    assert all(len(digest) == 64 for digest in first.values())


def test_the_replica_starts_without_a_column_and_its_self_check_then_renders_nothing(replica):
    assert replica["no_column"]["total"] == 0 and "no golden column" in replica["no_column"]["reason"]
    assert "self-check" not in replica["no_column"]["verdict"]["by"]


def test_the_column_is_keyed_by_the_kernel_path_and_the_self_check_verifies_or_names_what_differs(replica):
    mine = Configuration.model_validate(replica["configuration"])
    assert mine.hardware[0].startswith("path:") and mine.hardware[1].startswith("aten:")
    column = GoldenColumn.model_validate(replica["column"])
    assert column.configuration == mine and column.digests == replica["runs"][0]
    assert set(column.made) == {"date", "cpu"}
    assert replica["table"] == [column]
    assert replica["self_check"] == {"path": ",".join(mine.hardware), "total": 8, "differing": []}

    digests = replica["runs"][0]
    assert mine.compare_golden(digests, [column]).verified
    altered = {**digests, "seeded co-batched target": "0" * 64}
    check = mine.compare_golden(altered, [column])
    assert not check.verified and check.differing == ["seeded co-batched target"]
    assert "differing: seeded co-batched target" in check.reason


def audit_record(configuration: Configuration, batch_sizes) -> ScopeRecord:
    """A valid record of `configuration`, as an audit on any machine of its kernel path would write it."""
    return ScopeRecord(
        configuration=configuration,
        coverage=Coverage(batch_sizes=list(batch_sizes), orderings=["target-first", "target-last"]),
        result=AuditResult(control_runs=10, control_varied=True, invariant_runs=10, differing_with_kernels_on=0),
        audited={"cpu": "another machine", "cpu_flags": "avx avx2 avx512f fma"},
    )


def test_a_record_of_the_replicas_path_covers_it_with_its_self_check_and_a_differing_check_undoes_that(replica):
    configuration = Configuration.model_validate(replica["configuration"])
    bound = replica["max_num_seqs"]
    record = audit_record(configuration, range(1, bound + 1))
    column = GoldenColumn.model_validate(replica["column"])

    check = configuration.compare_golden(replica["runs"][0], [column])
    verdict = configuration.match([record], batch_size=bound, self_check=check)
    assert verdict.verified and verdict.record == record.name and "self-check reproduced 8 of 8" in verdict.by
    differing = configuration.compare_golden({**replica["runs"][0], "greedy solo": "0" * 64}, [column])
    refused = configuration.match([record], batch_size=bound, self_check=differing)
    assert not refused.verified and "differing: greedy solo" in refused.differences[-1]
    other_path = audit_record(configuration.model_copy(update={"hardware": ["path:other", "aten:OTHER"]}),
                              range(1, bound + 1))
    elsewhere = configuration.match([other_path], batch_size=bound, self_check=check)
    assert not elsewhere.verified and any(d.startswith("hardware ") for d in elsewhere.differences)


def test_the_self_check_at_start_up_is_a_few_seconds(replica):
    assert replica["self_check_s"] < 30, replica["self_check_s"]
