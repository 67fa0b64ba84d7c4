"""The golden table on whatever machine runs the suite: the canonical requests, rendered on this machine's kernel
path, give the sha256 the table holds for that path (docs/evidence/golden.json, `omniserve golden --record`).

A path without a column is skipped, naming the command that makes one (a machine fact, not a failure); a column
that differs fails, naming the path and every request that differs, when it was made on a CPU of this model. Made on
another model, the difference is a measured machine fact (issue 21: an Intel Xeon with AMX reproduced 0 of 6 float32
diffusion outputs of columns made on an AMD EPYC until MKL was held to its COMPATIBLE code on every path). Such a
machine is then held to its own model's column (docs/evidence/golden-by-cpu/, `contracts.scope.cpu_golden_table`)
where one was recorded, else skips. `make test` runs this on every kernel path the CPU can run (OMNISERVE_CPU_ISA),
ATen, oneDNN and MKL held to the path.
"""

import pytest

from contracts.scope import cpu_golden_table, load_golden
from evidence.golden import diffusion_column

pytestmark = pytest.mark.slow


def _assert_reproduces_its_column(column, name: str, record: str) -> None:
    """This machine's `column` against the shipped table: skipped where the table has none for its path."""
    check = column.configuration.compare_golden(column.digests, load_golden())
    path = ",".join(column.configuration.hardware)
    if not check.total:
        pytest.skip(f"measured: no golden column for {name} on {path} with these kernels and weights; "
                    f"`{record}` on such a machine makes one")
    (shipped,) = (c for c in load_golden() if c.configuration == column.configuration)
    cpu = column.made.get("cpu", "")
    if not check.verified and shipped.made.get("cpu") != cpu:
        # Made on another CPU model: this model's own column, where one was recorded, is what must hold here.
        table = cpu_golden_table(cpu)
        own = column.configuration.compare_golden(column.digests, load_golden(table))
        if not own.total:
            pytest.skip(f"measured: {name} on {path} on this CPU ({cpu}) differs from the column made on "
                        f"{shipped.made.get('cpu', 'a CPU the table does not name')}: {check.reason}; the same kernel "
                        f"path is not proven the same bits on every CPU model (issue 21); `{record} --table {table}` "
                        "records this model's column")
        assert own.verified, f"{name} on {path}, against this CPU model's own column ({table.name}): {own.reason}"
        return
    assert check.verified, f"{name} on {path}: {check.reason}"
    assert check.total == len(column.digests)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_golden_diffusion_requests_give_this_paths_sha256(dtype):
    column = diffusion_column(dtype)  # refuses to exist if the co-batched target differs from its solo render
    _assert_reproduces_its_column(column, f"diffusion {dtype}", "omniserve golden --record")


def test_golden_a_differing_output_is_named_with_its_path():
    columns = load_golden()
    assert columns, "the shipped golden table is missing or empty"
    column = columns[0]
    digests = {**column.digests, "edit": "0" * 64}
    check = column.configuration.compare_golden(digests, columns)
    assert not check.verified and check.differing == ["edit"]
    assert ",".join(column.configuration.hardware) in check.reason and "edit" in check.reason


def test_golden_llm_requests_give_this_paths_token_ids_and_logprobs():
    from evidence.golden import llm_column

    column = llm_column()  # refuses to exist if a co-batched target differs from its solo run
    _assert_reproduces_its_column(column, "the llm", "omniserve golden --record --stages llm")
