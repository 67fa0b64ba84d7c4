"""`omniserve audit --stage diffusion --parallel` (evidence/parallel.py): its degrees, and records that carry the
degree and rest on each grid's own control. The renders themselves are tested in test_parallel_render.py (one launch
of the workers there serves both: a second here would cost the suite a minute for the same computation)."""

import argparse

import pytest

from cli.main import _degrees
from contracts.scope import SHIPPED_RECORDS, load_records
from evidence.parallel import DIT_MODELS, grid_name, grids, parse_degrees
from evidence.record import build_record


@pytest.mark.parametrize(
    ("text", "degrees"), [("cfg=2,sp=2", (2, 2)), ("cfg=2", (2, 1)), ("sp=2", (1, 2)), (" sp=2 , cfg=1", (1, 2))]
)
def test_degrees_are_read_with_one_for_a_degree_left_out(text, degrees):
    assert parse_degrees(text) == degrees


@pytest.mark.parametrize("text", ["cfg=3", "tp=2", "cfg=two", "cfg=1,sp=1", ""])
def test_a_degree_it_cannot_render_is_refused_naming_the_option(text):
    with pytest.raises(ValueError, match="--parallel"):
        parse_degrees(text)
    with pytest.raises(argparse.ArgumentTypeError, match="--parallel"):
        _degrees(text)


def test_the_single_worker_comes_first_then_every_grid_the_degrees_allow():
    assert grids(2, 2) == ((1, 1), (2, 1), (1, 2), (2, 2))
    assert grids(1, 2) == ((1, 1), (1, 2))
    assert [grid_name(*g) for g in grids(2, 2)] == ["one", "cfg2", "sp2", "cfg2xsp2"]


def _run(grid: str, kernels: str, differing: int) -> dict:
    return {
        "model": "m",
        "parallel": grid,
        "kernels": kernels,
        "batch_size": 1,
        "ordering": "solo",
        "differing_elements": differing,
    }


def _entry(grid: str, cfg: int, sp: int) -> dict:
    configuration = {
        "stage": "diffusion",
        "model": "m",
        "weights": "w",
        "dtype": "float32",
        "device": "cpu",
        "hardware": ["path:avx2", "aten:AVX2"],
        "versions": {},
        "kernels": "k",
        "torch_threads": 1,
        "engine": {"batching": "step", "parallel": {"cfg": cfg, "sp": sp}},
    }
    return {
        "model": "m",
        "configuration": configuration,
        "coverage": {"sizes": ["64x64"], "steps": 8},
        "parallel": grid,
    }


def test_each_grid_is_recorded_on_its_own_control_and_its_record_names_the_degree():
    # cfg2's control varied; sp2's did not (as measured on CPU: stock kernels give a row's bits whatever the rows).
    report = {"runs": [_run("cfg2", "off", 7), _run("cfg2", "on", 0), _run("sp2", "off", 0), _run("sp2", "on", 0)]}
    record, why = build_record(report, _entry("cfg2", 2, 1))
    assert record is not None, why
    assert record.result.control_runs == 1 and record.configuration.engine["parallel"] == {"cfg": 2, "sp": 1}
    assert "-cfg2-sp1-" in record.name
    record, why = build_record(report, _entry("sp2", 1, 2))
    assert record is None and "control never varied" in why


def test_the_shipped_parallel_records_match_no_single_worker_replica():
    parallel = [r for r in load_records([SHIPPED_RECORDS]) if "parallel" in r.configuration.engine]
    assert parallel and all(r.valid and r.configuration.model in DIT_MODELS for r in parallel)
    assert all(r.coverage.batch_sizes == [1] for r in parallel)  # one request per render: nothing co-batched
    for record in parallel:  # the same model, path and everything else, on one worker: not what was audited
        single = record.configuration.model_copy(update={"engine": {"batching": "step"}})
        verdict = single.match([record], batch_size=1, size="64x64")
        assert not verdict.verified and any("parallel" in difference for difference in verdict.differences)
