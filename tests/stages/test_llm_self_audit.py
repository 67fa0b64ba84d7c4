"""An LLM replica's start-up self-audit (stages/llm/self_audit.py): it proves its own configuration inside its own
engine (its kernels, then our kernels out as the control), keeps the proof as a record keyed by what decides the bits,
reuses it at its next start, and catches a replica whose kernels are not really in (the test-only fault).

The replicas are the Serve class itself, without Ray, in a process of their own (vLLM spawns processes and edits the
environment of the one that starts it), with the embedded default model at one thread; the user's record cache is a
temporary directory. Whether the control varies depends on the kernel path (measured on the avx2 path of an AVX-512
EPYC: 14 of 14 quick runs); where it does not, the tests skip saying what was measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, json, os, shutil, sys, time
from pathlib import Path
import contracts.scope
from contracts.config import LLMStageConfig
from contracts.scope import OutsideVerifiedScopeError
from stages.llm import LLMStage
from stages.llm.self_check import llm_digests

RECORDS = Path(sys.argv[1])
contracts.scope.user_records = lambda: RECORDS  # the user's record cache: empty at first

async def start(**config):
    stage = LLMStage.func_or_class.__new__(LLMStage.func_or_class)
    started = time.monotonic()
    await stage.__init__(LLMStageConfig(batch_invariant=True, torch_threads=1, **config))
    seconds = time.monotonic() - started
    try:
        described = await stage.describe()
        digests = await llm_digests(stage.engine)  # what it serves now: the canonical requests' bits
        return {"seconds": round(seconds, 1), "self_audit": described.details["self_audit"], "digests": digests,
                "verified": described.verified, "by": described.verified_by,
                "differences": described.scope_differences}
    finally:
        stage.engine.shutdown()

async def main():
    out = {"first": await start(), "second": await start()}
    out["records"] = sorted(p.name for p in RECORDS.glob("*.json"))
    # The same weights from a directory of the user's (a copy of the default's, under another name): the same record.
    from stages.llm import resolve_model
    copy = Path(sys.argv[2]) / "my-rewriter"
    shutil.copytree(resolve_model(None).path, copy)
    out["copy"] = await start(model=str(copy))
    contracts.scope.user_records = lambda: RECORDS / "fault"  # a cache without the record (else it is reused)
    os.environ["OMNISERVE_TEST_FAULT"] = "kernels-uninstalled"
    out["fault"] = await start()
    try:
        await start(strict=True)
    except OutsideVerifiedScopeError as err:
        out["strict"] = str(err)
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llm-self-audit")
    script = tmp / "starts.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMNISERVE_TEST_FAULT"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp / "scope"), str(tmp)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def proven(start):
    audit = start["self_audit"]
    if not audit["reused"] and not audit["control_varied"]:
        pytest.skip(f"measured on this machine's kernel path: {audit['reason']}")
    return audit


def test_an_llm_replica_proves_itself_in_its_own_engine_and_its_second_start_and_a_copy_reuse_the_record(starts):
    audit = proven(starts["first"])
    # quick: the long prompt, greedy and seeded, batch sizes 2-8, in the middle
    assert audit["runs"] == 14 and audit["differing"] == [] and audit["seconds"] > 0
    assert audit["reason"] == "self-audit: control varied, 0 of 14 co-batched runs differed with the kernels on"
    assert starts["first"]["verified"] and starts["first"]["by"].startswith(f"self-audit record {audit['record']}")
    # After its control, the replica serves its kernels' bits, as one that never audited (its prefix cache emptied).
    assert starts["first"]["digests"] == starts["second"]["digests"]
    assert starts["records"] == [audit["record"]] and audit["record"].startswith("llm-")
    second = starts["second"]
    assert second["self_audit"]["reused"] and second["self_audit"]["runs"] == 0
    assert second["self_audit"]["record"] == audit["record"] and second["verified"]
    # The same weights served from the user's own directory (where the stage rewrites through the chat template, not
    # the embedded model's grammar): keyed by the weights' content, not the path.
    copy = starts["copy"]
    assert copy["self_audit"]["reused"] and copy["self_audit"]["record"] == audit["record"] and copy["verified"]


def test_llm_kernels_left_out_while_the_switch_says_on_are_caught_strict_refuses_naming_the_case(starts):
    audit = starts["fault"]["self_audit"]
    if not audit["control_varied"] and not audit["differing"]:
        pytest.skip(f"measured on this machine's kernel path: {audit['reason']}")
    assert not audit["reused"] and audit["differing"] and audit["record"] is None
    assert starts["fault"]["verified"] is False
    assert starts["fault"]["digests"] != starts["first"]["digests"]  # stock kernels answer: other bits
    assert any("co-batched differed from solo" in d for d in starts["fault"]["differences"])
    assert all(case.startswith("long prompt ") and case.endswith(" elements)") for case in audit["differing"])
    assert "long prompt greedy, batch 2 at 1 (" in starts["strict"]  # strict refuses, naming the case
