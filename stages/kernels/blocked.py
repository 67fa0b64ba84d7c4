"""Batch-invariant ops by fixed-shape blocking.

Stock CPU kernels pick their algorithm (and so their reduction order) from the whole
tensor shape: MKL uses other GEMM kernels for M < 4 than for M >= 4, oneDNN convolves a
batch of 1 differently from a batch of 2 or more, channels-last group_norm changes with
the batch size. So a sample's result depends on what else is in the batch.

The cure here: never let the batch size reach the library. Every call that a sample's
result depends on is cut along its batch dimension into blocks of a fixed size (zero
padded), copied into freshly allocated (hence equally aligned) tensors, and computed one
block per library call. For a given op and per-sample shape, every call the library sees
has the same shape, strides and alignment, so it takes the same path; a sample's rows
land in some block at some position, and the library computes each row of a block the
same way wherever it sits (pinned by tests/stages/test_kernels.py). Blocking keeps
batching worth it: a block holds as many samples as make about `TARGET_MACS` of work,
so small layers still run one library call for many samples.

Each function here has the signature of the aten overload it replaces and calls the
stock kernel through an overload this module never overrides (`mm.out` for `mm`,
`_convolution` for `convolution`, ...).
"""

from __future__ import annotations

import math

import torch

# Work per library call (multiply-adds) at which the call's own overhead stops mattering:
# GEMMs cost ~5 us to call, oneDNN convolutions ~50 us. Blocks hold as many samples as make
# about this much work; more would only pad small batches with wasted work.
GEMM_MACS = 1 << 17
CONV_MACS = 1 << 21
_FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def block_size(work_per_item: int, target: int, minimum: int = 1, maximum: int = 1024) -> int:
    """Items per library call: the power of two nearest below target / work_per_item, clamped.

    It depends only on the per-item work (never on the batch), which is what makes the
    blocked ops invariant.
    """
    items = target // max(work_per_item, 1)
    items = 1 << max(items.bit_length() - 1, 0)
    return max(minimum, min(maximum, items))


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _aligned(x: torch.Tensor) -> bool:
    # Libraries may take other code paths for unaligned data; fresh allocations are 64-byte aligned.
    return x.data_ptr() % 64 == 0


def _canonical(x: torch.Tensor, block: int, fmt=torch.contiguous_format, *, lines: bool = False) -> torch.Tensor:
    """x zero-padded to whole blocks along dim 0, in layout `fmt`, 64-byte aligned (x itself if it already is).

    The layout never follows x's strides: those can depend on the batch (a reshape copies
    or not), and libraries pick their algorithm by layout. With `lines`, every item (slice
    along dim 0) also starts on a 64-byte line, padding the item stride if need be: MKL's
    result for a GEMM row can follow that row's alignment (measured: K=5 rows at different
    positions of one block differ), so no row may sit differently aligned from another.
    """
    n = x.shape[0]
    total = -(-n // block) * block
    item = math.prod(x.shape[1:])
    line = 64 // x.element_size()
    stride = -(-item // line) * line if lines else item
    if total == n and stride == item and x.is_contiguous(memory_format=fmt) and _aligned(x):
        return x
    if stride == item:
        padded = torch.empty((total, *x.shape[1:]), dtype=x.dtype, device=x.device, memory_format=fmt)
    else:
        padded = torch.empty((total, stride), dtype=x.dtype, device=x.device).narrow(1, 0, item).unflatten(1, x.shape[1:])
    padded[:n].copy_(x)
    if total > n:
        padded[n:].zero_()
    return padded


def _block(x: torch.Tensor, start: int, block: int) -> torch.Tensor:
    """One block of a canonical x: a view, or an aligned copy where the view is not aligned."""
    view = x[start : start + block]
    return view if _aligned(view) else view.clone(memory_format=torch.preserve_format)


def _per_row(t: torch.Tensor, n: int) -> bool:
    """Whether `t` carries one row per item along dim 0 (rather than broadcasting over items)."""
    return t.dim() >= 2 and t.shape[0] == n and n != 1


# --- matrix products -----------------------------------------------------------------


def _gemm_rows(k: int, n: int) -> int:
    # At least 64 rows: one pass over the weight then serves many rows, as in a stock GEMM.
    return block_size(k * n, GEMM_MACS, minimum=64)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.mm(a, b, out=a.new_empty(0))
    return _gemm(a, b, lambda block, out: torch.mm(block, b, out=out))


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(0))
    if _per_row(bias, a.shape[0]):  # a full bias matrix is cut into the same row blocks
        rows = _gemm_rows(a.shape[1], b.shape[1])
        biases = _canonical(bias.expand(a.shape[0], b.shape[1]), rows, lines=True)
        return _gemm(a, b, lambda block, out, start: torch.addmm(
            _block(biases, start, rows), block, b, beta=beta, alpha=alpha, out=out), with_start=True)
    return _gemm(a, b, lambda block, out: torch.addmm(bias, block, b, beta=beta, alpha=alpha, out=out))


def _gemm(a, b, call, with_start=False) -> torch.Tensor:
    """Rows of `a` in fixed blocks, each block's product written in place into one padded output."""
    rows = _gemm_rows(a.shape[1], b.shape[1])
    padded = _canonical(a, rows, lines=True)
    out = a.new_empty(padded.shape[0], b.shape[1])
    for start in range(0, padded.shape[0], rows):
        args = (_block(padded, start, rows), out[start : start + rows])
        call(*args, start) if with_start else call(*args)
    return out[: a.shape[0]]


def _bmm_entries(a: torch.Tensor, b: torch.Tensor) -> int:
    return block_size(a.shape[1] * a.shape[2] * b.shape[2], GEMM_MACS, maximum=256)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.bmm(a, b, out=a.new_empty(0))
    return _batched(a, b, None, lambda x, y, _bias, out: torch.bmm(x, y, out=out))


def baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(0))
    return _batched(a, b, bias, lambda x, y, z, out: torch.baddbmm(z, x, y, beta=beta, alpha=alpha, out=out))


def _batched(a, b, bias, call) -> torch.Tensor:
    """Matrices of a batched product in fixed blocks of entries."""
    entries = _bmm_entries(a, b)
    x, y = _canonical(a, entries, lines=True), _canonical(b, entries, lines=True)
    per_entry = bias is not None and bias.dim() == 3 and _per_row(bias, a.shape[0])
    z = _canonical(bias.expand(a.shape[0], a.shape[1], b.shape[2]), entries, lines=True) if per_entry else bias
    parts = []
    for start in range(0, x.shape[0], entries):
        block_bias = _block(z, start, entries) if per_entry else z
        out = a.new_empty(entries, a.shape[1], b.shape[2])  # fresh, so aligned like every other block
        call(_block(x, start, entries), _block(y, start, entries), block_bias, out)
        parts.append(out)
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[: a.shape[0]]


# --- convolution ---------------------------------------------------------------------


def _stock_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if not transposed and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() in (4, 5):
        # oneDNN directly: ATen would otherwise pick its im2col path for some batch sizes only.
        return torch.mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)
    # Fixed algorithm choice (no benchmarking, deterministic, no TF32), whatever the user set.
    return torch.ops.aten._convolution(
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
        False, True, torch.backends.cudnn.enabled, False,
    )


def _im2col_fits(x: torch.Tensor, weight: torch.Tensor, positions: int) -> bool:
    """2-D, and every per-sample buffer (input, columns, output) a whole number of 64-byte lines:
    the GEMMs then see equally aligned pointers for every sample (MKL's result can follow alignment)."""
    line = 64 // x.element_size()
    per_sample = (math.prod(x.shape[1:]), math.prod(weight.shape[1:]) * positions, weight.shape[0] * positions)
    return x.dim() == 4 and all(size % line == 0 for size in per_sample)


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Two fixed strategies, chosen per layer (by its per-sample work, never by the batch).

    Small layers: ATen's im2col convolution, which computes every sample as its own single-threaded
    GEMM of one fixed shape, so the batch only changes how many such GEMMs run (cut into blocks,
    oneDNN's per-call cost would dominate these layers). Larger layers: oneDNN on fixed blocks of
    samples in the weight's layout.
    """
    args = (stride, padding, dilation, transposed, output_padding, groups)
    if x.dim() < 3 or x.dtype not in _FLOATING or x.shape[0] == 0:
        return _stock_convolution(x, weight, bias, *args)
    positions = math.prod(x.shape[2:]) // max(math.prod(stride), 1)
    work = weight.shape[0] * math.prod(weight.shape[1:]) * positions  # multiply-adds per sample (approx.)
    if work <= CONV_MACS and _im2col_fits(x, weight, positions) and groups == 1 and not transposed and tuple(dilation) == (1, 1):
        # At least two samples: ATen then runs each sample's GEMM single-threaded inside its
        # parallel loop; a lone sample would get a multi-threaded GEMM, whose order can differ.
        padded = _canonical(x, 1) if x.shape[0] > 1 else _canonical(x, 2)
        out = torch.ops.aten._slow_conv2d_forward(padded, weight.contiguous(), weight.shape[2:], bias, stride, padding)
        return out[: x.shape[0]]
    # Samples of a block sit at offsets of whole samples: only whole 64-byte lines keep them equally aligned.
    line = 64 // x.element_size()
    samples = block_size(work, CONV_MACS, maximum=64) if math.prod(x.shape[1:]) % line == 0 else 1
    # The layout follows the layer's weight (fixed per model), never the activation's strides.
    fmt = _memory_format(weight) if weight.dim() == x.dim() else torch.contiguous_format
    padded = _canonical(x, samples, fmt)
    if padded.shape[0] == samples:
        return _stock_convolution(padded, weight, bias, *args)[: x.shape[0]]
    blocks = range(0, padded.shape[0], samples)
    return torch.cat([_stock_convolution(_block(padded, start, samples), weight, bias, *args) for start in blocks])[: x.shape[0]]


# --- group_norm ----------------------------------------------------------------------


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    """aten::group_norm on a channels-first contiguous input, in the caller's layout afterwards.

    The stock contiguous kernel reduces each (sample, group) row on one thread in a fixed order,
    whatever the batch; its channels-last kernel does not (it splits work by the batch size).
    """
    channels, positions = x.shape[1], math.prod(x.shape[2:])
    fmt = _memory_format(x)
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.ops.aten.native_group_norm(x, weight, bias, x.shape[0], channels, positions, num_groups, eps)[0]
    return out if fmt == torch.contiguous_format else out.contiguous(memory_format=fmt)


#: The op table: aten overload -> batch-invariant replacement. One place to read what is covered.
CPU_OPS = {
    "mm": mm,
    "addmm": addmm,
    "bmm": bmm,
    "baddbmm": baddbmm,
    "convolution": convolution,
    "group_norm": group_norm,
}
#: What vLLM's CUDA mode leaves out, covered the same way on CUDA.
CUDA_COVER_OPS = {
    "convolution": convolution,
    "group_norm": group_norm,
}
