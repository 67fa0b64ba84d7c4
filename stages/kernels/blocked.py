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

import functools
import math

import torch

# Work per library call (multiply-adds) at which a call's fixed cost (~10 us for a GEMM with
# its Python around it, ~50 us for a convolution) stops mattering. Blocks hold as many items as
# make about this much work; more would only pad small batches with wasted work.
GEMM_MACS = 1 << 18
CONV_MACS = 1 << 21
# Per-sample size up to which group_norm takes the stock channels-first kernel (copying if need be).
SMALL_NORM_ELEMENTS = 1 << 12
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
    if fmt == torch.contiguous_format:
        # One op: zero rows below, zero columns right of each item (the item-stride padding).
        flat = x.reshape(n, item)
        padded = torch.constant_pad_nd(flat, (0, stride - item, 0, total - n))
        return padded.narrow(1, 0, item).unflatten(1, x.shape[1:]) if stride != item else padded.view(total, *x.shape[1:])
    padded = torch.empty((total, *x.shape[1:]), dtype=x.dtype, device=x.device, memory_format=fmt)
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


@functools.lru_cache(maxsize=4096)
def _gemm_rows(k: int, n: int) -> int:
    # Small blocks for wide layers (a decode step's few rows pad to little), larger for narrow ones.
    return block_size(k * n, GEMM_MACS, minimum=16, maximum=256)


def _gemm(a: torch.Tensor, b: torch.Tensor, bias=None, beta=1, alpha=1) -> torch.Tensor:
    """mm / addmm as one batched GEMM over fixed-size row blocks: (blocks, rows, k) @ (k, n).

    ATen's batched GEMM computes each matrix of a batch on its own, the same way whatever the
    batch count (measured: 2400 checks, float32 and bfloat16), so every row block is computed
    alike, wherever it sits, while a single call keeps the cost of a stock GEMM.
    """
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    rows = _gemm_rows(k, n)
    blocks = _canonical(a, rows, lines=True).unflatten(0, (-1, rows))
    weight = b.expand(blocks.shape[0], k, n)
    out = a.new_empty(blocks.shape[0], rows, n)
    if bias is None:
        torch.bmm(blocks, weight, out=out)
    else:
        if _per_row(bias, m):  # a full bias matrix is cut into the same row blocks
            bias = _canonical(bias.expand(m, n), rows, lines=True).unflatten(0, (-1, rows))
        torch.baddbmm(bias, blocks, weight, beta=beta, alpha=alpha, out=out)
    return out.view(-1, n)[:m]


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.mm(a, b, out=a.new_empty(0))
    return _gemm(a, b)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(0))
    return _gemm(a, b, bias, beta, alpha)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each matrix on its own (see _gemm), in one canonical layout with every matrix line-aligned."""
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.bmm(a, b, out=out)
    return torch.bmm(_canonical(a, 1, lines=True), _canonical(b, 1, lines=True), out=out)


def baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    if bias.dim() == 3 and _per_row(bias, a.shape[0]):
        bias = _canonical(bias.expand(out.shape), 1, lines=True)
    return torch.baddbmm(bias, _canonical(a, 1, lines=True), _canonical(b, 1, lines=True), beta=beta, alpha=alpha, out=out)


# --- convolution ---------------------------------------------------------------------


def _onednn_takes(x: torch.Tensor, transposed: bool) -> bool:
    return not transposed and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() in (3, 4, 5)


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """oneDNN directly, always channels-last; fixed blocks of samples for what oneDNN does not take.

    ATen's CPU convolution varies with the batch because it picks its backend by batch size
    (im2col for a lone small sample, oneDNN otherwise) and follows the input's layout, which
    itself can follow the batch size. oneDNN computes every output from its own sample in an
    order its kernels fix, whatever the batch: measured over 2400 random layers (channels,
    sizes, kernels, strides, groups, layouts, float32/bfloat16, batch sizes 1-8, every
    position) and pinned in tests/stages/test_kernels.py.
    """
    # One layout whatever the activation's strides (they can depend on the batch: a reshape
    # copies or not), and oneDNN's result depends on the layout. Channels-last: oneDNN's faster one here.
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim(), torch.contiguous_format)
    if _onednn_takes(x, transposed) and x.shape[0] > 0:
        x = x if x.is_contiguous(memory_format=fmt) else x.contiguous(memory_format=fmt)
        return torch.mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)

    def stock(inp):
        # Fixed algorithm choice (no benchmarking, deterministic, no TF32), whatever the user set.
        return torch.ops.aten._convolution(
            inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
            False, True, torch.backends.cudnn.enabled, False,
        )

    if x.dim() < 3 or x.dtype not in _FLOATING or x.shape[0] == 0:
        return stock(x)
    positions = math.prod(x.shape[2:]) // max(math.prod(stride), 1)
    work = weight.shape[0] * math.prod(weight.shape[1:]) * positions  # multiply-adds per sample (approx.)
    # Samples of a block sit at offsets of whole samples: only whole 64-byte lines keep them equally aligned.
    line = 64 // x.element_size()
    samples = block_size(work, CONV_MACS, maximum=64) if math.prod(x.shape[1:]) % line == 0 else 1
    padded = _canonical(x, samples, fmt)
    blocks = [stock(_block(padded, start, samples)) for start in range(0, padded.shape[0], samples)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[: x.shape[0]]


# --- group_norm ----------------------------------------------------------------------


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    """aten::group_norm in any layout, each (sample, group) reduced the same way whatever the batch.

    The stock kernels differ by layout, and the channels-last one splits its reduction by the
    batch size; activations arrive in either layout depending on the batch. Here every input is
    read as (sample, position, channel) (a view of channels-last memory, one copy otherwise), and
    each channel sums over positions in one fixed order; a group's mean, then its variance
    around that mean, add up its channels' sums (ATen's Welford reduction would be ~50x slower).
    Small samples take the stock kernel on channels-first memory instead (fewer ops); the path
    depends only on the per-sample shape, so a layer always takes the same one.
    """
    n, channels = x.shape[:2]
    if math.prod(x.shape[1:]) <= SMALL_NORM_ELEMENTS:
        # Small samples: the stock kernel on channels-first memory (it reduces each (sample, group)
        # row on one thread in a fixed order, whatever the batch): one op instead of a dozen.
        flat = x.contiguous()
        out = torch.ops.aten.native_group_norm(flat, weight, bias, n, channels, math.prod(x.shape[2:]), num_groups, eps)[0]
        return out.contiguous(memory_format=_memory_format(x))
    per_group = channels // num_groups
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    # (sample, position, channel) in exactly that memory order: contiguous() is a no-op for channels-last
    # memory and a copy otherwise (reshape alone may return a transposed view, summed in another order).
    rows = x.movedim(1, -1).contiguous().view(n, -1, channels).to(compute)
    count = rows.shape[1] * per_group

    def group_sum(t):  # (sample, channel) -> (sample, group, 1)
        return t.view(n, num_groups, per_group).sum(dim=2, keepdim=True)

    def per_channel(t):  # (sample, group, 1) -> (sample, channel)
        return t.expand(n, num_groups, per_group).reshape(n, channels).to(compute)

    # Exact two passes: the group's mean, then the sum of squared deviations from it (a 2-norm over
    # positions per channel, squared), both summed over the group's channels.
    mean = group_sum(rows.sum(dim=1)) / count
    deviations = torch.linalg.vector_norm(rows - per_channel(mean)[:, None, :], dim=1).square()
    var = group_sum(deviations) / count
    scale = per_channel(torch.rsqrt(var + eps))
    if weight is not None:
        scale = scale * weight.to(compute)
    shift = -per_channel(mean) * scale
    if bias is not None:
        shift = shift + bias.to(compute)
    # Normalised in the (sample, position, channel) layout too: elementwise kernels round
    # differently by layout (fused multiply-add or not), so the layout is fixed here as well.
    out = torch.addcmul(shift[:, None, :], rows, scale[:, None, :]).to(x.dtype)
    out = out.view(n, *x.shape[2:], channels).movedim(-1, 1)
    return out.contiguous(memory_format=_memory_format(x))


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
