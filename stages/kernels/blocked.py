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

# Work per library call (multiply-adds) that keeps per-call overhead small.
TARGET_MACS = 1 << 21
_FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def block_size(work_per_item: int, minimum: int, maximum: int) -> int:
    """Items per library call: a power of two near TARGET_MACS / work_per_item, clamped.

    It depends only on the per-item work (never on the batch), which is what makes the
    blocked ops invariant.
    """
    items = TARGET_MACS // max(work_per_item, 1)
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
    return (x.data_ptr() % 64) == 0


def _blocks(x: torch.Tensor, block: int, fmt: torch.memory_format = torch.contiguous_format) -> list[torch.Tensor]:
    """x cut into `block` items along dim 0, every block in layout `fmt` and 64-byte aligned.

    Whole blocks of an x already so laid out are views (no copy); the tail, and every block
    of an x in another layout, is a fresh zero-padded copy. The layout never follows x: the
    strides x arrives with can depend on the batch (a reshape copies or not), and libraries
    pick their algorithm by layout.
    """
    in_place = x.is_contiguous(memory_format=fmt) and _aligned(x)
    item_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    in_place = in_place and (block * item_bytes) % 64 == 0
    out = []
    for start in range(0, x.shape[0], block):
        part = x[start : start + block]
        if in_place and part.shape[0] == block:
            out.append(part)
            continue
        fresh = torch.empty((block, *x.shape[1:]), dtype=x.dtype, device=x.device, memory_format=fmt)
        fresh[: part.shape[0]].copy_(part)
        if part.shape[0] < block:
            fresh[part.shape[0] :].zero_()
        out.append(fresh)
    return out


def _rows_of(t: torch.Tensor | None, n: int) -> bool:
    """Whether `t` carries one row per item along dim 0 (rather than broadcasting)."""
    return t is not None and t.dim() >= 2 and t.shape[0] == n and n != 1


def _stitch(parts: list[torch.Tensor], n: int) -> torch.Tensor:
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[:n]


# --- matrix products -----------------------------------------------------------------


def _gemm_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    # At least 16 rows: one weight pass serves many rows, as in a stock GEMM.
    return block_size(a.shape[1] * b.shape[1], minimum=64, maximum=1024)


def _padded_output(like: torch.Tensor, blocks: int, block: int, item_shape: tuple[int, ...]) -> torch.Tensor:
    # Whole blocks: every library call writes a full block in place; callers slice off the padding.
    return like.new_empty((blocks * block, *item_shape))


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.mm(a, b, out=a.new_empty(0))
    rows = _gemm_rows(a, b)
    blocks = _blocks(a, rows)
    out = _padded_output(a, len(blocks), rows, (b.shape[1],))
    for i, block in enumerate(blocks):
        torch.mm(block, b, out=out[i * rows : (i + 1) * rows])
    return out[: a.shape[0]]


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(0))
    rows = _gemm_rows(a, b)
    blocks = _blocks(a, rows)
    biases = _blocks(bias.expand(a.shape[0], b.shape[1]), rows) if _rows_of(bias, a.shape[0]) else None
    out = _padded_output(a, len(blocks), rows, (b.shape[1],))
    for i, block in enumerate(blocks):
        torch.addmm(bias if biases is None else biases[i], block, b, beta=beta, alpha=alpha,
                    out=out[i * rows : (i + 1) * rows])
    return out[: a.shape[0]]


def _bmm_entries(a: torch.Tensor, b: torch.Tensor) -> int:
    return block_size(a.shape[1] * a.shape[2] * b.shape[2], minimum=1, maximum=256)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.bmm(a, b, out=a.new_empty(0))
    entries = _bmm_entries(a, b)
    pairs = list(zip(_blocks(a, entries), _blocks(b, entries)))
    out = _padded_output(a, len(pairs), entries, (a.shape[1], b.shape[2]))
    for i, (x, y) in enumerate(pairs):
        torch.bmm(x, y, out=out[i * entries : (i + 1) * entries])
    return out[: a.shape[0]]


def baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if a.dtype not in _FLOATING or a.shape[0] == 0:
        return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(0))
    entries = _bmm_entries(a, b)
    shape = (a.shape[0], a.shape[1], b.shape[2])
    pairs = list(zip(_blocks(a, entries), _blocks(b, entries)))
    biases = _blocks(bias.expand(shape), entries) if bias.dim() == 3 and _rows_of(bias, a.shape[0]) else None
    out = _padded_output(a, len(pairs), entries, shape[1:])
    for i, (x, y) in enumerate(pairs):
        torch.baddbmm(bias if biases is None else biases[i], x, y, beta=beta, alpha=alpha,
                      out=out[i * entries : (i + 1) * entries])
    return out[: a.shape[0]]


# --- convolution ---------------------------------------------------------------------


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    def stock(inp):
        # Fixed algorithm choice (no benchmarking, deterministic, no TF32), whatever the user set.
        return torch.ops.aten._convolution(
            inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
            False, True, torch.backends.cudnn.enabled, False,
        )

    if x.dim() < 3 or x.dtype not in _FLOATING or x.shape[0] == 0:
        return stock(x)
    # Per-sample work: output channels x reduction per output x output positions (approx.).
    positions = math.prod(x.shape[2:]) // max(math.prod(stride), 1)
    work = weight.shape[0] * math.prod(weight.shape[1:]) * positions
    samples = block_size(work, minimum=1, maximum=64)
    # The layout follows the layer's weight (fixed per model), never the activation's strides.
    fmt = _memory_format(weight) if weight.dim() == x.dim() else torch.contiguous_format
    return _stitch([stock(block) for block in _blocks(x, samples, fmt)], x.shape[0])


# --- group_norm ----------------------------------------------------------------------


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    """aten::group_norm: the stock kernel on fixed blocks of samples, always channels-first contiguous.

    (The stock CPU kernel takes another path for channels-last inputs, whose result moves with
    the batch size; contiguous blocks of a fixed size never reach that choice.)
    """
    if x.dim() < 2 or x.dtype not in _FLOATING or x.shape[0] == 0:
        return torch.ops.aten.native_group_norm(
            x, weight, bias, x.shape[0], x.shape[1], math.prod(x.shape[2:]), num_groups, eps)[0]
    channels, positions = x.shape[1], math.prod(x.shape[2:])
    samples = block_size(channels * positions * 8, minimum=1, maximum=64)  # ~8 flops per element
    parts = []
    for block in _blocks(x, samples):
        parts.append(torch.ops.aten.native_group_norm(block, weight, bias, samples, channels, positions, num_groups, eps)[0])
    return _stitch(parts, x.shape[0]).contiguous(memory_format=_memory_format(x))


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
