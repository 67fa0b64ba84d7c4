"""The CPU batch-invariant kernels: a sample's result never depends on the rest of the batch.

Each invariance check has a control: the same check with stock kernels, measured here. Where stock
kernels vary, the control passes and shows the check can fail; where they do not vary on this CPU, the
control is skipped with a reason saying what was measured (the check then proves nothing here, and says so).
Whether our kernels are active is read from the dispatcher's own table, which does not depend on the CPU.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import cpu
from stages.kernels import (
    KernelReport,
    batch_invariant_kernels,
    current_report,
    disable_batch_invariant_kernels,
    enable_batch_invariant_kernels,
    native,
)

DTYPES = [torch.float32, torch.bfloat16]
REPLACEABLE_OPS = tuple(f"aten::{op}" for op in native.CPU_OPS)


#: torch's threads as the process started (one per core): each test starts with them, whatever module ran before this
#: one in the worker (a diffusion engine sets its configured count process-wide; seen: the controls then ran on 1
#: thread, where group_norm's stock kernel did not vary).
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _stock_kernels_and_threads_around_each_test():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    disable_batch_invariant_kernels()
    torch.set_num_threads(before)


def _in_batch(fn, sample, others, position):
    """fn applied to a batch holding `sample` at `position` among `others`; returns that sample's output."""
    batch = torch.cat([others[:position], sample, others[position:]])
    return fn(batch)[position : position + 1]


def _this_cpu() -> str:
    return f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads"


def _skip_unless_stock_varies(varied: bool, measured: str) -> None:
    """A control that did not vary on this CPU: skip, saying what was measured (never pass silently)."""
    if not varied:
        pytest.skip(f"measured on this CPU ({_this_cpu()}): stock kernels gave identical bits for {measured}; "
                    "the matching invariance check proves nothing here")


def _cpu_kernel_source(op: str) -> str:
    """Where the dispatcher's active CPU kernel for `op` was registered (a file and line)."""
    active = [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CPU:")]
    return active[0] if active else ""


def _ours_active() -> dict[str, bool]:
    """For each op the kernels can replace: is blocked.cpp's kernel the active CPU one?"""
    return {op: "blocked.cpp" in _cpu_kernel_source(op) for op in REPLACEABLE_OPS}


def _varies(fn, make, sizes=(1, 2, 3, 4, 5, 8), seed=0):
    """True if the first sample's output differs between any two batch sizes (or positions)."""
    gen = torch.Generator().manual_seed(seed)
    sample, others = make(1, gen), make(max(sizes), gen)
    solo = fn(sample)
    for size in sizes[1:]:
        for position in {0, size // 2, size - 1}:
            if not torch.equal(_in_batch(fn, sample, others[: size - 1], position), solo):
                return True
    return False


def linear_case(dtype, k=320, n=1280, rows=1):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    fn = lambda x: F.linear(x, weight, bias)  # noqa: E731
    make = lambda count, gen: torch.randn(count, rows, k, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def conv_case(dtype, cin=4, cout=32, size=16):
    weight = torch.randn(cout, cin, 3, 3, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(cout, generator=torch.Generator().manual_seed(4)).to(dtype)
    fn = lambda x: F.conv2d(x, weight, bias, padding=1)  # noqa: E731
    make = lambda count, gen: torch.randn(count, cin, size, size, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def group_norm_case(dtype, channels=64, groups=32, size=32, channels_last=True):
    weight = torch.randn(channels, generator=torch.Generator().manual_seed(5)).to(dtype)
    bias = torch.randn(channels, generator=torch.Generator().manual_seed(6)).to(dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    fn = lambda x: F.group_norm(x.contiguous(memory_format=fmt), groups, weight, bias)  # noqa: E731
    make = lambda count, gen: torch.randn(count, channels, size, size, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def bmm_case(dtype, m=64, k=40, n=64):
    fn = lambda x: torch.bmm(x[:, :m], x[:, m:].transpose(1, 2))  # noqa: E731
    make = lambda count, gen: torch.randn(count, m + n, k, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def attention_case(dtype, heads=2, queries=24, keys=40, dim=16, masked=False):
    """F.scaled_dot_product_attention over (batch, heads, tokens, dim): queries, then keys, then values."""
    mask = torch.rand(queries, keys, generator=torch.Generator().manual_seed(7)) > 0.25 if masked else None

    def fn(x):
        q, k, v = x.split([queries, keys, keys], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    make = lambda count, gen: torch.randn(count, heads, queries + 2 * keys, dim, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def token_norm_case(dtype, kind="rms", width=32):
    """The per-token norms of the DiT families and the Qwen2.5-VL encoder: RMSNorm (diffusers', over the last dim, as
    FLUX's and Qwen-Image's query/key norms and Qwen-Image's text norm use it) and LayerNorm without affine (the
    blocks' norms). Stock kernels: nothing of ours replaces them."""
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(width, eps=1e-6).to(dtype) if kind == "rms" else torch.nn.LayerNorm(width, elementwise_affine=False)
    with torch.no_grad():
        if kind == "rms":
            norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(8)))
    fn = lambda x: norm(x).detach()  # noqa: E731
    make = lambda count, gen: torch.randn(count, 19, 2, width, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def rope_case(dtype, kind="complex", tokens=21, heads=2, dim=16):
    """Rotary embeddings as the DiT families apply them: Qwen-Image's complex product (`apply_rotary_emb_qwen`) and
    FLUX's cos/sin form (`apply_rotary_emb`), over (batch, tokens, heads, dim) with one table for every row."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    angles = torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(9)) * 6.28
    if kind == "complex":
        table = torch.polar(torch.ones_like(angles), angles)
        fn = lambda x: apply_rotary_emb_qwen(x, table, use_real=False)  # noqa: E731
    else:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        fn = lambda x: apply_rotary_emb(x, (cos, sin), sequence_dim=1)  # noqa: E731
    make = lambda count, gen: torch.randn(count, tokens, heads, dim, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def grouped_attention_case(dtype, heads=4, kv_heads=2, tokens=37, dim=8):
    """The Qwen2.5-VL text encoder's attention: causal, 4 query heads sharing 2 key/value heads, head size 8."""

    def fn(x):
        q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    make = lambda count, gen: torch.randn(count, heads + 2 * kv_heads, tokens, dim, generator=gen).to(dtype)  # noqa: E731
    return fn, make


def pointwise_case(dtype, op="silu"):
    """A transcendental elementwise op over (batch, 53, 37) (the Qwen2.5-VL encoder MLP's shape): ATen's loops take
    other code for some elements by where they fall (a lone element, a loop's tail), which rounds otherwise for SiLU,
    GELU and sigmoid (measured: 4%, 35% and 4% of float32 elements, either path), so with stock kernels a sample's bits
    can follow the batch size; how often a control catches it depends on where the differing elements land."""
    fns = {
        "silu": F.silu,
        "silu_inplace": lambda x: F.silu(x.clone(), inplace=True),
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "exp": torch.exp,
        "exp_inplace": lambda x: x.clone().exp_(),
        "log": lambda x: torch.log(x.abs() + 0.5),
        "sin_cos": lambda x: torch.cat([torch.sin(x * 7), torch.cos(x * 7)], -1),
        "erf": torch.erf,
        # a strided view (not dense): computed through a contiguous copy
        "silu_strided": lambda x: F.silu(x[:, :, ::2]),
        "silu_channels_last": lambda x: F.silu(x[:, None].expand(-1, 4, -1, -1).contiguous(memory_format=torch.channels_last)),
    }
    make = lambda count, gen: (torch.randn(count, 53, 37, generator=gen) * 3).to(dtype)  # noqa: E731
    return fns[op], make


# --- the report --------------------------------------------------------------------------


def test_kernels_cpu_report_names_what_it_installed():
    report = enable_batch_invariant_kernels("cpu")
    assert isinstance(report, KernelReport)
    assert report.installed and report.backend == "cpu"
    for op in REPLACEABLE_OPS:
        assert op in report.ops
    assert all(_ours_active().values()), _ours_active()  # the dispatcher agrees with the report
    assert enable_batch_invariant_kernels("cpu") is report  # idempotent
    assert current_report() is report


def test_kernels_unsupported_device_installs_nothing_and_says_why():
    report = enable_batch_invariant_kernels("meta")
    assert not report.installed and report.backend == "none" and report.ops == []
    assert "meta" in report.reason
    # Nothing was installed: every CPU op still dispatches to its stock kernel.
    assert not any(_ours_active().values()), _ours_active()


def test_kernels_disabled_report_claims_nothing():
    disable_batch_invariant_kernels()
    report = current_report()
    assert not report.installed and report.ops == []


# --- on/off is exact -----------------------------------------------------------------------


def _stock_outputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 320, generator=gen)
    w = torch.randn(1280, 320, generator=gen)
    img = torch.randn(1, 4, 16, 16, generator=gen)
    cw = torch.randn(32, 4, 3, 3, generator=gen)
    return [
        F.linear(x, w),
        torch.mm(x[:1], w.t()),
        torch.bmm(x[None], w[None].transpose(1, 2)),
        F.conv2d(img, cw, padding=1),
        F.group_norm(torch.randn(1, 64, 32, 32, generator=gen).contiguous(memory_format=torch.channels_last), 32),
    ]


def test_kernels_disable_restores_stock_results_exactly():
    stock_sources = {op: _cpu_kernel_source(op) for op in REPLACEABLE_OPS}
    before = _stock_outputs()
    enable_batch_invariant_kernels("cpu")
    assert all(_ours_active().values())  # the overrides really were active in between
    disable_batch_invariant_kernels()
    after = _stock_outputs()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert {op: _cpu_kernel_source(op) for op in REPLACEABLE_OPS} == stock_sources


def test_kernels_off_control_on_results_differ_from_stock_in_the_low_bits():
    # The control of the test above: its bit comparison could fail only if our kernels round differently.
    before = _stock_outputs()
    with batch_invariant_kernels():
        during = _stock_outputs()
    _skip_unless_stock_varies(any(not torch.equal(a, b) for a, b in zip(before, during)),
                              "linear, mm, bmm, conv2d and group_norm, stock vs our kernels")


def test_kernels_context_manager_restores_the_previous_state():
    with batch_invariant_kernels() as report:
        assert report.installed and current_report().installed
    assert not current_report().installed
    enable_batch_invariant_kernels()
    with batch_invariant_kernels():
        pass
    assert current_report().installed  # it was on before the block, so it stays on


# --- invariance, with controls ---------------------------------------------------------------

CASES = {
    "linear": linear_case,
    "linear_rows": lambda dtype: linear_case(dtype, k=32, n=32, rows=7),
    "conv_in3": lambda dtype: conv_case(dtype, cin=3, size=32),
    "conv_in4": conv_case,
    "conv_wide": lambda dtype: conv_case(dtype, cin=32, cout=32, size=8),
    "conv_large": lambda dtype: conv_case(dtype, cin=32, cout=32, size=48),  # the oneDNN-block path
    "group_norm_channels_last": group_norm_case,
    "group_norm_contiguous": lambda dtype: group_norm_case(dtype, channels=32, groups=4, size=8, channels_last=False),
    "bmm": bmm_case,
    "attention": attention_case,
    "attention_masked": lambda dtype: attention_case(dtype, heads=3, queries=7, keys=77, dim=40, masked=True),
    # ATen's batched GEMM takes another path for one one-column matrix than for several.
    "linear_one_column": lambda dtype: linear_case(dtype, k=8, n=1, rows=33),
    # What the DiT families (FLUX, Qwen-Image) and the Qwen2.5-VL encoder add: stock kernels, checked the same way.
    "rms_norm": token_norm_case,
    "layer_norm": lambda dtype: token_norm_case(dtype, kind="layer"),
    "rope_complex": rope_case,
    "rope_cos_sin": lambda dtype: rope_case(dtype, kind="real"),
    "attention_dit_heads_of_16": lambda dtype: attention_case(dtype, heads=2, queries=45, keys=45, dim=16),
    "attention_grouped_causal": grouped_attention_case,
    # Transcendental elementwise ops (pointwise_case): blocks of the stock vector code.
    **{f"pointwise_{op}": functools.partial(pointwise_case, op=op) for op in (
        "silu", "silu_inplace", "gelu", "gelu_tanh", "sigmoid", "tanh", "exp", "exp_inplace", "log", "sin_cos", "erf",
        "silu_strided", "silu_channels_last")},
}
# Each case's control is measured on the machine that runs it (test_kernels_off_control_...). On the
# reference machine kind (2 cores, x86 AVX512, 2 torch threads) stock kernels varied for linear,
# linear_one_column, conv_in3, conv_in4 and conv_wide in float32, and group_norm_channels_last in
# float32 and bfloat16; the other controls were skipped there as not varying.
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_kernels_on_every_position_and_batch_size_gives_the_solo_bits(case, dtype):
    fn, make = CASES[case](dtype)
    with batch_invariant_kernels():
        assert not _varies(fn, make, sizes=BATCH_SIZES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_kernels_off_control_varies_for_the_same_check(case, dtype):
    fn, make = CASES[case](dtype)
    assert not current_report().installed
    _skip_unless_stock_varies(_varies(fn, make, sizes=BATCH_SIZES),
                              f"{case} ({dtype}) at batch sizes 1-8, first, middle and last position")


def _bmm_positions_vary(m, k, n):
    """Whether any matrix of contiguous batches of 1-8 matrices differs from the same product alone."""
    gen = torch.Generator().manual_seed(11)
    a, b = torch.randn(8, m, k, generator=gen), torch.randn(8, k, n, generator=gen)
    alone = [torch.bmm(a[i : i + 1].clone(), b[i : i + 1].clone()) for i in range(8)]
    return any(not torch.equal(torch.bmm(a[:count], b[:count])[i : i + 1], alone[i]) for count in range(2, 9) for i in range(count))


# Few rows: MKL threads a lone matrix itself but a batch across matrices, and a matrix's result
# follows its output's alignment, which in a contiguous batch follows its position.
BMM_SHAPES = [(3, 1408, 250), (15, 262, 7)]


@pytest.mark.parametrize("m,k,n", BMM_SHAPES)
def test_kernels_bmm_matrix_gives_the_same_bits_alone_and_at_every_position(m, k, n):
    with batch_invariant_kernels():
        assert not _bmm_positions_vary(m, k, n)


@pytest.mark.parametrize("m,k,n", BMM_SHAPES)
def test_kernels_off_control_bmm_matrix_varies_with_its_position(m, k, n):
    _skip_unless_stock_varies(_bmm_positions_vary(m, k, n), f"bmm of {m}x{k} @ {k}x{n} alone vs at positions 0-7")


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 300),
    n=st.integers(1, 300),
    rows=st.integers(1, 40),
    batch=st.integers(1, 8),
    data=st.data(),
)
def test_kernels_linear_property_any_shape_any_batch_any_position(k, n, rows, batch, data):
    fn, make = linear_case(torch.float32, k=k, n=n, rows=rows)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    sample, others = make(1, gen), make(batch - 1, gen)
    position = data.draw(st.integers(0, batch - 1))
    with batch_invariant_kernels():
        assert torch.equal(_in_batch(fn, sample, others, position), fn(sample))


@settings(max_examples=40, deadline=None)
@given(
    cin=st.integers(1, 16),
    cout=st.integers(1, 16),
    size=st.integers(3, 20),
    kernel=st.sampled_from([1, 3]),
    stride=st.sampled_from([1, 2]),
    batch=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    channels_last=st.booleans(),
    data=st.data(),
)
def test_kernels_conv_property_any_shape_any_batch_any_position(cin, cout, size, kernel, stride, batch, dtype, channels_last, data):
    weight = torch.randn(cout, cin, kernel, kernel).to(dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    fn = lambda x: F.conv2d(x.contiguous(memory_format=fmt), weight, stride=stride, padding=kernel // 2)  # noqa: E731
    sample, others = torch.randn(1, cin, size, size).to(dtype), torch.randn(batch - 1, cin, size, size).to(dtype)
    position = data.draw(st.integers(0, batch - 1))
    with batch_invariant_kernels():
        assert torch.equal(_in_batch(fn, sample, others, position), fn(sample))


THREAD_SHAPES = [(1, 5, 5), (3, 5, 7), (16, 16, 20), (32, 32, 48)]


def _conv_one_and_two_threads(cin, cout, size) -> list[torch.Tensor]:
    """The first sample's conv2d, alone and in a batch of 3, with one and with two threads."""
    weight = torch.randn(cout, cin, 3, 3, generator=torch.Generator().manual_seed(9))
    batch = torch.randn(3, cin, size, size, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results += [F.conv2d(batch[:1], weight, padding=1), F.conv2d(batch, weight, padding=1)[:1]]
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("cin,cout,size", THREAD_SHAPES)
def test_kernels_conv_gives_the_same_bits_with_one_or_two_threads(cin, cout, size):
    with batch_invariant_kernels():
        results = _conv_one_and_two_threads(cin, cout, size)
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("cin,cout,size", THREAD_SHAPES)
def test_kernels_off_control_conv_varies_with_threads_or_batch(cin, cout, size):
    # Measured on the reference machine kind: stock ATen differs between one and two threads for 1x5x5.
    results = _conv_one_and_two_threads(cin, cout, size)
    _skip_unless_stock_varies(not all(torch.equal(r, results[0]) for r in results),
                              f"conv2d {cin}->{cout} channels at {size}x{size}, 1 and 2 threads, alone and in a batch of 3")


def _sd15_up_block_weight() -> torch.Tensor:
    return torch.randn(640, 1920, 3, 3, generator=torch.Generator().manual_seed(13)) * 0.02


def _sd15_up_block_conv(samples: torch.Tensor) -> torch.Tensor:
    """SD1.5's UNet up_blocks.2.resnets.0.conv1 (3x3, 1920->640) at 32x32, as in a 512x512 render, on channels-last
    input (as our convolution returns its activations)."""
    return F.conv2d(samples.contiguous(memory_format=torch.channels_last), _sd15_up_block_weight(), padding=1)


def _sd15_up_block_inputs() -> torch.Tensor:
    return torch.randn(3, 1920, 32, 32, generator=torch.Generator().manual_seed(14))


def test_kernels_a_real_width_conv_gives_the_solo_bits_at_every_position():
    # The layer where oneDNN's kernel followed the batch (its avx2 path blocked the weights by 24 output channels
    # alone, by 16 in a batch): our convolution runs one sample per call at this size.
    inputs = _sd15_up_block_inputs()
    with batch_invariant_kernels():
        batch = _sd15_up_block_conv(inputs)
        for position in range(len(inputs)):
            assert torch.equal(batch[position : position + 1], _sd15_up_block_conv(inputs[position : position + 1]))


def test_kernels_off_control_a_real_width_conv_varies_with_the_batch():
    # Measured on the avx2 path (ONEDNN_MAX_CPU_ISA=AVX2) of an AVX-512 EPYC: 646,179 of 655,360 outputs differ in
    # a batch of 3 (with one thread in a batch of 2 as well). oneDNN's avx512 path kept one kernel here.
    inputs = _sd15_up_block_inputs()
    varied = not torch.equal(_sd15_up_block_conv(inputs)[:1], _sd15_up_block_conv(inputs[:1]))
    _skip_unless_stock_varies(varied, "conv2d 1920->640 3x3 at 32x32 (SD1.5 at 512x512), alone and in a batch of 3")


def test_kernels_conv_transpose_takes_the_fixed_block_path_and_stays_invariant():
    weight = torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(12))
    fn = lambda x: F.conv_transpose2d(x, weight, stride=2, padding=1)  # noqa: E731
    make = lambda count, gen: torch.randn(count, 6, 9, 9, generator=gen)  # noqa: E731
    with batch_invariant_kernels():
        assert not _varies(fn, make, sizes=(1, 2, 3, 5, 8))


# --- still correct -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=str)
def test_kernels_results_stay_close_to_a_float64_reference(dtype, tol):
    gen = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(37, 96, generator=gen), torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    img, cw = torch.randn(3, 4, 12, 12, generator=gen), torch.randn(8, 4, 3, 3, generator=gen)
    gn_in = torch.randn(3, 32, 9, 9, generator=gen)
    a3, b3, c3 = torch.randn(6, 5, 7, generator=gen), torch.randn(6, 7, 9, generator=gen), torch.randn(6, 5, 9, generator=gen)
    q, k, v = (torch.randn(2, 3, length, 24, generator=gen) for length in (10, 33, 33))
    mask = torch.randn(2, 1, 10, 33, generator=gen)
    references = [
        F.linear(x.double(), w.double(), b.double()),
        F.conv2d(img.double(), cw.double(), padding=1),
        F.group_norm(gn_in.double(), 4),
        torch.baddbmm(c3.double(), a3.double(), b3.double(), beta=0.5, alpha=2.0),
        F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double()),
        F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True),
    ]
    with batch_invariant_kernels():
        results = [
            F.linear(x.to(dtype), w.to(dtype), b.to(dtype)),
            F.conv2d(img.to(dtype), cw.to(dtype), padding=1),
            F.group_norm(gn_in.to(dtype), 4),
            torch.baddbmm(c3.to(dtype), a3.to(dtype), b3.to(dtype), beta=0.5, alpha=2.0),
            F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask.to(dtype)),
            F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True),
        ]
    for got, want in zip(results, references):
        assert got.dtype == dtype and got.shape == want.shape
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol * max(scale, 1.0)


def _layout_pairs(dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """group_norm and conv2d of one input, contiguous and channels-last."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 128, 16, 16, generator=gen).to(dtype)
    weight = torch.randn(8, 128, 3, 3, generator=gen).to(dtype)
    fns = (lambda t: F.group_norm(t, 32), lambda t: F.conv2d(t, weight, padding=1))
    return [(fn(x.contiguous()), fn(x.contiguous(memory_format=torch.channels_last))) for fn in fns]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_group_norm_and_conv_give_the_same_bits_in_either_layout(dtype):
    # Activations arrive channels-last or not depending on the batch (a reshape copies or not).
    with batch_invariant_kernels():
        assert all(torch.equal(a, b) for a, b in _layout_pairs(dtype))


#: (batch, channels, height, width, groups): channels not a multiple of 16, positions not a multiple of 16, one position.
GROUP_NORM_SHAPES = [(3, 24, 5, 7, 6), (2, 40, 9, 9, 8), (1, 320, 8, 8, 32), (4, 16, 1, 1, 4), (2, 64, 17, 3, 32)]


@pytest.mark.parametrize("shape", GROUP_NORM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_kernels_group_norm_same_bits_in_either_layout_and_close_to_float64(shape, dtype, tol):
    # Our group_norm reads channels-first rows 16 positions at a time and channels-last rows 16 channels at a
    # time; the lanes' order is defined on logical indices, so both must give the same bits, for every shape.
    n, c, h, w, groups = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(n, c, h, w, generator=gen) * 3 + 1.5).to(dtype)
    weight, bias = torch.randn(c, generator=gen).to(dtype), torch.randn(c, generator=gen).to(dtype)
    with batch_invariant_kernels():
        first = F.group_norm(x.contiguous(), groups, weight, bias)
        last = F.group_norm(x.contiguous(memory_format=torch.channels_last), groups, weight, bias)
    assert torch.equal(first, last.contiguous())
    want = F.group_norm(x.double(), groups, weight.double(), bias.double())
    assert (first.double() - want).abs().max().item() <= tol * max(want.abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_off_control_group_norm_or_conv_round_differently_by_layout(dtype):
    varied = any(not torch.equal(a, b) for a, b in _layout_pairs(dtype))
    _skip_unless_stock_varies(varied, f"group_norm and conv2d ({dtype}), contiguous vs channels-last")


def test_kernels_group_norm_keeps_the_callers_memory_format():
    x = torch.randn(3, 16, 6, 6).contiguous(memory_format=torch.channels_last)
    with batch_invariant_kernels():
        out = F.group_norm(x, 4)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out, F.group_norm(x.contiguous(), 4), atol=1e-5)


def test_kernels_integer_and_empty_inputs_fall_back_to_stock():
    a, b = torch.arange(6).reshape(2, 3), torch.arange(12).reshape(3, 4)
    with batch_invariant_kernels():
        assert torch.equal(torch.mm(a, b), a.double().mm(b.double()).long())
        assert torch.mm(torch.zeros(0, 3), torch.zeros(3, 4)).shape == (0, 4)
        assert torch.equal(torch.exp(a), torch.exp(a.float())) and torch.exp(a.double()).dtype == torch.float64
        assert torch.sin(torch.zeros(0, 3)).shape == (0, 3)


def test_kernels_pointwise_ops_write_inference_tensors_from_every_worker_thread():
    """Blocks run on torch's worker threads with the caller's dispatch state: under InferenceMode (the step engine,
    vLLM's CPU worker) a worker writing the inference tensor made for the result is allowed (it was refused)."""
    torch.set_num_threads(2)
    x = torch.randn(3, 40000, generator=torch.Generator().manual_seed(12))
    with batch_invariant_kernels(), torch.inference_mode():
        outputs = [F.silu(x), torch.exp(x.clone()), x.clone().sigmoid_()]
    assert all(torch.allclose(a, b) for a, b in zip(outputs, [F.silu(x), torch.exp(x), torch.sigmoid(x)], strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_pointwise_ops_give_the_stock_vector_codes_bits(dtype):
    """Where the stock kernel takes its vector code on every element (numel a multiple of every vector width) ours gives
    its bits; elsewhere the two differ only where stock took its scalar code, by rounding."""
    x = (torch.randn(4, 8192, generator=torch.Generator().manual_seed(11)) * 3).to(dtype)
    ops = [F.silu, F.gelu, lambda t: F.gelu(t, approximate="tanh"), torch.sigmoid, torch.tanh, torch.exp, torch.sin,
           torch.cos, torch.erf, lambda t: torch.log(t.abs() + 0.5)]
    stock = [op(x) for op in ops] + [op(x[:, :37]) for op in ops]
    with batch_invariant_kernels():
        ours = [op(x) for op in ops] + [op(x[:, :37]) for op in ops]
    assert all(torch.equal(a, b) for a, b in zip(stock[: len(ops)], ours[: len(ops)], strict=True))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(stock, ours, strict=True))


# --- the C++ library: built once, cached, and honest when it cannot be built -------------------


def _fresh_interpreter(code, environ=None, **env):
    import os
    import subprocess
    import sys

    environ = os.environ if environ is None else environ
    done = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_kernels_without_a_compiler_install_nothing_and_say_why(tmp_path):
    # An empty cache and no working compiler: the report must not claim coverage, and stock kernels still answer.
    out = _fresh_interpreter(
        "from stages.kernels import enable_batch_invariant_kernels as e; r = e('cpu');"
        "print(r.installed, r.backend, r.ops, r.reason.replace(chr(10), ' '))",
        OMNISERVE_CACHE=str(tmp_path), CXX="false",
    )
    assert out.startswith("False none []"), out
    assert "could not be built" in out and "blocked.cpp" in out


# Once: how the library is named, cached and rebuilt in an empty cache is one rule for every path, and each path's
# own library is compiled from source anyway when its loop first runs (measured: 24-32 s a path for this repeat).
@pytest.mark.path_independent
def test_kernels_library_is_cached_under_a_name_that_follows_its_source(tmp_path):
    from stages.kernels import native

    path = native.build()
    assert path.exists() and path.parent.name == "kernels"
    assert native.build() == path  # cached: a second call does not compile again
    assert native.SOURCE.read_text() and path.name.startswith("blocked-")
    # In a fresh cache the library is compiled there from source, then used.
    out = _fresh_interpreter(
        "from stages.kernels import enable_batch_invariant_kernels as e, native; r = e('cpu');"
        "print(r.installed, native.library_path())",
        OMNISERVE_CACHE=str(tmp_path),
    )
    installed, built = out.split()
    assert installed == "True" and built.startswith(str(tmp_path)) and built.endswith(path.name)


# --- the fixed-order packed GEMM (mm/addmm, float32 and bfloat16, every CPU path) -------------------


ROW_COUNTS = (1, 7, 8, 9, 300)  # around the 8-row tile and past the 256-row block


def _rows_vary(k: int, n: int, dtype, threads: tuple[int, int], row_counts=ROW_COUNTS) -> bool:
    """Whether a row's bits differ between computed alone (threads[0]) and among other rows (threads[1])."""
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            torch.set_num_threads(threads[1])
            together = F.linear(x, weight, bias)
            torch.set_num_threads(threads[0])
            for position in {0, rows // 2, rows - 1}:
                if not torch.equal(F.linear(x[position : position + 1], weight, bias), together[position : position + 1]):
                    return True
    finally:
        torch.set_num_threads(before)
    return False


GEMM_SHAPES = [(1, 1), (40, 32), (3, 47), (257, 49), (1024, 130), (512, 1408)]  # panels of 16, 32 and 48 columns


@pytest.mark.parametrize("k,n", GEMM_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [(1, 1), (1, 2), (2, 1)], ids=lambda t: f"{t[0]}vs{t[1]}threads")
def test_kernels_packed_gemm_row_bits_follow_neither_rows_position_nor_threads(k, n, dtype, threads):
    with batch_invariant_kernels():
        assert native_packed_gemm_active()
        assert not _rows_vary(k, n, dtype, threads, _row_counts(k, n, threads))


def _row_counts(k: int, n: int, threads: tuple[int, int]) -> tuple[int, ...]:
    """Every row count, but 300 rows of the LLM-sized shape once per dtype: together on 2 threads against alone on 1.
    There they cross the 256-row block and split its 88 panels into groups that differ between 1 and 2 threads; the
    other thread pairs check that shape at the tile's edges (1-9 rows). 300 of its rows cost 33 s a case on the
    generic path, where a fused multiply-add is a libm call (measured on an Intel Xeon, 2 cores)."""
    llm_sized = (k, n) == GEMM_SHAPES[-1]
    return ROW_COUNTS if not llm_sized or threads == (1, 2) else tuple(r for r in ROW_COUNTS if r < 256)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_off_control_packed_gemm_shapes_vary_with_rows_or_threads(dtype):
    varied = [(k, n, t) for k, n in GEMM_SHAPES for t in [(1, 1), (1, 2)] if _rows_vary(k, n, dtype, t)]
    _skip_unless_stock_varies(bool(varied), f"linear ({dtype}) at (K, N) in {GEMM_SHAPES}, rows {ROW_COUNTS}, 1 vs 1-2 threads")
    assert varied


def native_packed_gemm_active() -> bool:
    """The loaded library is this process's path's, and its GEMM is the one answering mm."""
    return native.loaded_isa() == native.cpu_isa() and _ours_active()["aten::mm"]


# Each path's products as sha256, in a process of its own (a process loads one path's library).
_PATH_BITS = """
import hashlib, json, numpy, torch
from stages.kernels import enable_batch_invariant_kernels, native
torch.set_num_threads(1)
assert enable_batch_invariant_kernels("cpu").installed
# Inputs from numpy: torch.randn's own bits follow ATen's level (its vectorized normal fill, 16+ values).
gen, bits = numpy.random.default_rng(0), {}
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in [(1, 64, 16), (7, 33, 40), (9, 128, 96), (300, 257, 48), (17, 1024, 1000), (3, 5, 3)]:
        x, w, b = (torch.from_numpy(gen.standard_normal(s, dtype=numpy.float32)).to(dtype) for s in ((m, k), (n, k), (n,)))
        y = torch.cat([torch.nn.functional.linear(x, w, b), x @ w.t(), torch.addmm(b, x, w.t(), beta=0.5, alpha=-2)])
        bits[f"{dtype} {m}x{k} @ {k}x{n}"] = hashlib.sha256(y.float().numpy().tobytes()).hexdigest()
        if dtype == torch.float32:  # MKL, held to COMPATIBLE on every path (bfloat16: ATen's and oneDNN's, per path)
            a, c = x.expand(3, m, k), torch.from_numpy(gen.standard_normal((3, m, n), dtype=numpy.float32))
            y = torch.cat([torch.bmm(a, w.t().expand(3, k, n)), torch.baddbmm(c, a, w.t().expand(3, k, n), alpha=0.5)])
            bits[f"{dtype} 3 x {m}x{k} @ {k}x{n}"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
print(json.dumps({"isa": native.loaded_isa(), "bits": bits}))
"""


@pytest.mark.path_independent
def test_kernels_every_cpu_path_this_cpu_runs_gives_the_gemm_the_same_bits():
    import json
    import os

    runs = {isa: json.loads(_fresh_interpreter(_PATH_BITS, cpu.path_environment(isa, os.environ)).strip().splitlines()[-1])
            for isa in cpu.supported_isas()}
    assert all(run["isa"] == isa for isa, run in runs.items())
    assert len(runs) >= 2, f"this CPU runs only {list(runs)}: nothing to compare"
    reference_isa, reference = next(iter(runs.items()))
    for isa, run in runs.items():
        differ = [product for product, digest in run["bits"].items() if digest != reference["bits"][product]]
        assert not differ, f"the {isa} path differs from the {reference_isa} path for {differ}"


_MKL_BITS = """
import hashlib, numpy, torch, torch.nn.functional as F
from stages.kernels import enable_batch_invariant_kernels
torch.set_num_threads(1)
assert enable_batch_invariant_kernels("cpu").installed
gen = numpy.random.default_rng(0)
t = lambda *shape: torch.from_numpy(gen.standard_normal(shape, dtype=numpy.float32))
q, k, v, a, b = t(4, 2, 64, 32), t(4, 2, 77, 32), t(4, 2, 77, 32), t(8, 64, 40), t(8, 40, 77)
y = torch.cat([F.scaled_dot_product_attention(q, k, v).flatten(), torch.bmm(a, b).flatten()])
print(hashlib.sha256(y.numpy().tobytes()).hexdigest())
"""
# MKL (float32 attention and bmm) picks its code from the CPU model, not only from the instructions it may use: an
# AMD EPYC and an Intel Xeon, both held to AVX2 (MKL_CBWR=AVX2), computed different images. Every path now holds
# MKL to its COMPATIBLE code (envs._ISA_LIMITS), the same on every x86-64 CPU. One machine shows what that pins by
# changing the instructions MKL may pick (MKL_ENABLE_INSTRUCTIONS): nothing changes under the path's setting, while
# MKL's own choice (MKL_CBWR=AUTO) follows them.
MKL_INSTRUCTIONS = (None, "SSE4_2", "AVX2")


def _bits_by_mkl_instructions(cbwr: str | None) -> dict[str, str]:
    import os

    environ = cpu.path_environment(cpu.cpu_isa(), os.environ)
    if cbwr is not None:
        environ["MKL_CBWR"] = cbwr
    runs = {}
    for instructions in MKL_INSTRUCTIONS:
        env = {k: v for k, v in environ.items() if k != "MKL_ENABLE_INSTRUCTIONS"}
        if instructions is not None:
            env["MKL_ENABLE_INSTRUCTIONS"] = instructions
        runs[instructions or "any"] = _fresh_interpreter(_MKL_BITS, env).split()[-1]
    return runs


@pytest.mark.path_independent
def test_kernels_attention_and_bmm_bits_follow_no_mkl_code_choice_on_this_path():
    runs = _bits_by_mkl_instructions(None)
    assert len(set(runs.values())) == 1, f"float32 attention and bmm differ by the instructions MKL may use: {runs}"


@pytest.mark.path_independent
def test_kernels_off_control_mkls_own_choice_follows_the_instructions_it_may_use():
    runs = _bits_by_mkl_instructions("AUTO")
    _skip_unless_stock_varies(len(set(runs.values())) > 1,
                              f"float32 attention and bmm under MKL_CBWR=AUTO, MKL_ENABLE_INSTRUCTIONS {list(runs)}")


@pytest.mark.path_independent
def test_kernels_a_path_this_cpu_cannot_run_is_refused_naming_what_it_lacks(monkeypatch):
    # An AVX2-only CPU's flags (this one may run every path): the refusal is a rule on the flags, tested as such.
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    assert cpu.supported_isas() == ["avx2", "generic"]
    monkeypatch.setenv("OMNISERVE_CPU_ISA", "avx512")
    with pytest.raises(native.KernelBuildError, match=r"OMNISERVE_CPU_ISA=avx512: this CPU lacks \['avx512_bf16', "
                                                      r"'avx512bw', 'avx512dq', 'avx512f', 'avx512vl'\]"):
        native.cpu_isa()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)], ids=str)
def test_kernels_addmm_every_bias_layout_alpha_beta_and_operand_layout_match_float64(dtype, tol):
    gen = torch.Generator().manual_seed(21)
    m, k, n = 19, 83, 61
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    biases = [torch.randn(n, generator=gen), torch.randn(m, n, generator=gen), torch.randn(m, 1, generator=gen),
              torch.randn(1, n, generator=gen), torch.randn(n, m, generator=gen).t()]
    with batch_invariant_kernels():
        for bias in biases:
            for alpha, beta in [(1.0, 1.0), (0.5, -2.0)]:
                got = torch.addmm(bias.to(dtype), a.to(dtype), b.to(dtype), beta=beta, alpha=alpha)
                want = torch.addmm(bias.double(), a.double(), b.double(), beta=beta, alpha=alpha)
                assert got.shape == want.shape and got.is_contiguous()
                assert torch.allclose(got.double(), want, rtol=tol, atol=tol * 10), (tuple(bias.shape), alpha, beta)
        # beta 0 ignores the bias entirely, NaN included, as stock does
        nan = torch.full((n,), float("nan"))
        assert not torch.addmm(nan.to(dtype), a.to(dtype), b.to(dtype), beta=0).isnan().any()
        # a transposed left operand and a row-major weight give the same bits as contiguous ones
        assert torch.equal(torch.mm(a.t().contiguous().t().to(dtype), b.to(dtype)),
                           torch.mm(a.to(dtype).contiguous(), b.t().contiguous().t().to(dtype)))


def test_kernels_packed_weights_are_reused_repacked_when_changed_and_bounded():
    gen = torch.Generator().manual_seed(5)
    with batch_invariant_kernels():
        weight, x = torch.randn(64, 40, generator=gen), torch.randn(3, 40, generator=gen)
        first = F.linear(x, weight)
        before = native.packed_weights()
        assert torch.equal(F.linear(x, weight), first)
        assert native.packed_weights()["hits"] == before["hits"] + 1
        weight.mul_(2)  # in place: the version counter moves, the packed copy is stale
        assert torch.equal(F.linear(x, weight), F.linear(x, weight.clone()))
        assert not torch.equal(F.linear(x, weight), first)
        with torch.inference_mode():  # no version counter: packed on each call, never cached
            frozen = torch.randn(64, 40, generator=gen)
            uncached = native.packed_weights()["uncached_packs"]
            assert torch.equal(F.linear(x, frozen), F.linear(x, frozen.clone()))
        assert native.packed_weights()["uncached_packs"] >= uncached + 2
        limit = 4 * 64 * 48 * 4  # room for about four packed 40x64 weights
        try:
            native.packed_weights(limit)
            weights = [torch.randn(64, 40, generator=gen) for _ in range(12)]
            for w in weights:
                F.linear(x, w)
            stats = native.packed_weights()
            assert 0 < stats["bytes"] <= limit and stats["entries"] < len(weights)
        finally:
            native.packed_weights(2 << 30)
    assert native.packed_weights()["entries"] == 0  # disabling the kernels drops every packed copy


# --- nearest upsampling: moved values, the stock result exactly ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
def test_kernels_nearest_upsampling_gives_the_stock_tensor_for_every_size_and_layout(dtype, channels_last):
    gen = torch.Generator().manual_seed(8)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for shape in [(8, 64, 16, 16), (1, 3, 5, 7), (2, 1, 4, 4), (3, 2, 1, 1)]:
        x = (torch.randn(shape, generator=gen) * 100).to(dtype).contiguous(memory_format=fmt)
        for how in ({"scale_factor": 2.0}, {"size": (shape[2] * 2, shape[3] * 2)}, {"scale_factor": 3.0},
                    {"size": (shape[2] * 2 + 1, shape[3] * 2)}, {"scale_factor": (2.0, 1.0)}):
            disable_batch_invariant_kernels()
            stock = F.interpolate(x, mode="nearest", **how)
            with batch_invariant_kernels():
                ours = F.interpolate(x, mode="nearest", **how)
            assert torch.equal(ours, stock) and ours.stride() == stock.stride(), (shape, how)
