"""The grouped-expert GEMM with per-expert LoRA in its epilogue: one launch for every expert's rows.

Over the expert-sorted rows of :mod:`fastft.kernels.moe_route` (row ``m`` belongs to expert ``e(m)``), with a frozen
``W [E, n, K]``, optional LoRA ``B [E, n, r]`` and scale ``s``, optional bias ``[E, n]`` and a per-row scale ``w``:

    Y[m] = w[m] · (X[src(m)] W_eᵀ + bias_e + s · XA[m] B_eᵀ),     e = e(m)

``src(m)`` is the row's token when the input is the unsorted ``x [T, K]`` (``gather``: the tokens are read in place,
no sorted copy of x is made), else ``m``. ``XA [N, r]`` is the rows' LoRA-A product, itself a launch of this kernel
with ``W = A`` and no LoRA. With ``scatter`` row ``m`` is stored at its flat ``(token, slot)`` position instead, so
the output is already in ``[T, k]`` order and the sum back over the k slots is a plain reduction.

Every weight-like operand is addressed through its three strides, so transposed and interleaved views need no copy:
the backward reuses the kernel for ``dH = dY W_down`` (``W_downᵀ`` as a view), gpt-oss's ``[E, H, 2I]`` storage is
the view ``transpose(1, 2)``, and its interleaved gate / up rows are ``[:, 0::2]`` / ``[:, 1::2]`` views.

transformers 4.x keeps each expert's projections as separate tensors; with an
:class:`~fastft.kernels.moe_expert_table.ExpertTable` as the weight (``TABLE``), ``w_ptr`` is an int64 table of the
experts' base addresses, loaded per program and cast to a pointer (no stacked copy of the weights). Gate's and up's
tables are the two parts of gate | up: columns ``[0, split)`` read part 0, the rest part 1; in the transposed view the
backward reads (``dX = dGU W``) the parts split K instead, walked as two K loops (``SPLIT_K``).

Programs: axis 0 walks the row blocks of :func:`fastft.kernels.moe_route.block_table` (each block one expert's rows,
the program reads its expert from the table; unused slots exit at once), axis 1 the ``BLOCK_N`` column blocks.

The torch reference (the CPU path) is the same function through ``torch._grouped_mm``, which runs on CPU in
fp32 / fp16 / bf16 when every stride is a multiple of 16 bytes; for other strides (odd ranks or widths) it falls
back to one matmul per expert with rows, a loop over experts that only the reference takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastft.kernels import dispatch, targets
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.moe_expert_table import ExpertTable
from fastft.kernels.moe_route import MoERouting, block_table

# A weight operand: one [E, n, K] tensor (any strides), or per-expert tensors through an address table.
Weight = torch.Tensor | ExpertTable


@triton.jit
def _k_loop(acc, x_tile, w_tile, row_ok, col_ok, K, stride_wk, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc += X[:, :K] W[:K, :]`` for the tile pointers at K index 0."""
    offs_k = tl.arange(0, BLOCK_K)
    # The tile pointers advance by one K step per iteration instead of being rebuilt from 64-bit offsets: fewer live
    # registers, which the FMA dot of sm_75 (and fp32 operands anywhere) needs to stay clear of spilling.
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_tile += BLOCK_K
        w_tile += BLOCK_K * stride_wk
    return acc


@triton.jit(do_not_specialize=["K", "n", "r", "split", "table_hi"])
def _moe_gemm_kernel(
    x_ptr,
    src_ptr,
    w_ptr,
    xa_ptr,
    b_ptr,
    bias_ptr,
    row_scale_ptr,
    y_ptr,
    dst_ptr,
    block_expert_ptr,
    block_start_ptr,
    offsets_ptr,
    K,
    n,
    r,
    scale,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_xam,
    stride_be,
    stride_bn,
    stride_br,
    stride_bias_e,
    stride_bias_n,
    split,
    table_hi,
    GATHER: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SCATTER: tl.constexpr,
    TABLE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    start = tl.load(block_start_ptr + block)
    end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    src = tl.load(src_ptr + rows, mask=row_ok, other=0) if GATHER else rows
    # int64 offsets: N · K and E · n · K pass 2**31 for the larger models.
    offs_k = tl.arange(0, BLOCK_K)
    cols64 = cols.to(tl.int64)
    x_tile = x_ptr + src.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    k_first = K
    if TABLE:
        # Per-expert tensors (transformers 4.x's expert modules): w_ptr is an int64 table of base addresses, part 0's
        # E then (for gate | up) part 1's; table_hi is 0 with one part, so both loads read part 0.
        element = tl.pointer_type(y_ptr.dtype.element_ty)
        low = tl.load(w_ptr + expert).to(element)
        high = tl.load(w_ptr + table_hi + expert).to(element)
        if SPLIT_K:
            # The transposed view: part 0 holds K indices [0, split), part 1 the rest (a second loop below).
            w_cols = low + cols64 * stride_wn
            k_first = split
        else:
            # Columns [0, split) are part 0's rows, the others part 1's (split is n with one part).
            w_cols = tl.where(cols < split, low + cols64 * stride_wn, high + (cols64 - split) * stride_wn)
    else:
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols64 * stride_wn
    w_tile = w_cols[None, :] + offs_k.to(tl.int64)[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_loop(acc, x_tile, w_tile, row_ok, col_ok, k_first, stride_wk, PRECISION, BLOCK_K)
    if SPLIT_K:
        w_tile = (high + cols64 * stride_wn)[None, :] + offs_k.to(tl.int64)[:, None] * stride_wk
        acc = _k_loop(acc, x_tile + split, w_tile, row_ok, col_ok, K - split, stride_wk, PRECISION, BLOCK_K)

    if HAS_LORA:
        # This expert's s · (X A_eᵀ) B_eᵀ for the tile, added while the accumulator is in registers.
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < r
        xa = tl.load(
            xa_ptr + rows.to(tl.int64)[:, None] * stride_xam + offs_r[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr
            + expert.to(tl.int64) * stride_be
            + cols.to(tl.int64)[None, :] * stride_bn
            + offs_r[:, None] * stride_br,
            mask=r_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(xa, b, input_precision=PRECISION) * tl.cast(scale, tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_e + cols * stride_bias_n, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if ROW_SCALE:
        # The router's weight of each row, applied to the finished row as the stock layer does.
        weight = tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    dst = tl.load(dst_ptr + rows, mask=row_ok, other=0) if SCATTER else rows
    y = y_ptr + dst.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of the grouped GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles(device: torch.device, dtype: torch.dtype) -> Tiles:
    """The tiles for a device and operand dtype, each checked free of spills on its targets by the static compile
    check: 64 × 64 for 16-bit tensor-core dots; 32 × 32 where the dot has no tensor cores (sm_75, FMA, also a shorter K
    step) or takes fp32 operands in IEEE mode, whose accumulator and operand tiles would otherwise spill. The
    interpreter gets small row blocks (fewer wasted rows per expert)."""
    if device.type == "cpu":
        return Tiles(16, 32, 32, 4, 1)
    if targets.capability(device) < 80:
        return Tiles(32, 32, 16, 4, 2)
    if dtype == torch.float32:
        return Tiles(32, 32, 32, 4, 2)
    return Tiles(64, 64, 32, 4, 2)


def _stride3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _weight_arguments(weight: Weight) -> tuple[torch.Tensor, tuple[int, int, int], int, int, bool, bool]:
    """``(w_ptr, strides, split, table_hi, TABLE, SPLIT_K)`` of the kernel for a weight operand."""
    if not isinstance(weight, ExpertTable):
        return weight, _stride3(weight), 0, 0, False, False
    experts, n, _ = weight.shape
    two = len(weight.parts) == 2
    split_k = two and weight.split_k is not None
    split = (weight.split_k if split_k else weight.split) if two else n
    return weight.table, (0, *weight.strides), split, experts if two else 0, True, split_k


def grouped_gemm_triton(
    x: torch.Tensor,
    weight: Weight,
    routing: MoERouting,
    *,
    gather: bool = False,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 0.0,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    scatter: bool = False,
) -> torch.Tensor:
    """Launch the kernel (see the module docstring); arguments as :func:`grouped_gemm`."""
    n, k = weight.shape[1], weight.shape[2]
    rows = routing.rows
    out = dispatch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    config = tiles(x.device, x.dtype)
    block_expert, block_start = block_table(routing, config.block_m)
    if x.stride(-1) != 1:
        x = x.contiguous()
    has_lora = xa is not None and xa.shape[1] > 0
    if has_lora and xa.stride(-1) != 1:
        xa = xa.contiguous()
    r = xa.shape[1] if has_lora else 0
    b_strides = _stride3(lora_b) if has_lora else (0, 0, 0)
    bias_strides = (bias.stride(0), bias.stride(1)) if bias is not None else (0, 0)
    w_ptr, w_strides, split, table_hi, table, split_k = _weight_arguments(weight)
    grid = (block_expert.shape[0], triton.cdiv(n, config.block_n))
    _moe_gemm_kernel[grid](
        x,
        routing.token if gather else block_start,
        w_ptr,
        xa if has_lora else x,
        lora_b if has_lora else x,
        bias if bias is not None else x,
        row_scale if row_scale is not None else x,
        out,
        routing.order if scatter else block_start,
        block_expert,
        block_start,
        routing.offsets,
        k,
        n,
        r,
        float(scale),
        x.stride(0),
        *w_strides,
        xa.stride(0) if has_lora else 0,
        *b_strides,
        *bias_strides,
        split,
        table_hi,
        GATHER=gather,
        HAS_LORA=has_lora,
        HAS_BIAS=bias is not None,
        ROW_SCALE=row_scale is not None,
        SCATTER=scatter,
        TABLE=table,
        SPLIT_K=split_k,
        # None: triton's default for 16-bit operands; fp32 is multiplied in IEEE fp32 as torch does by default.
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_R=max(16, triton.next_power_of_2(r)) if has_lora else 16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


# torch reference -----------------------------------------------------------------------------------------------------

_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: a unit stride in one of the last two dims and every other
    stride (and the address) a multiple of 16 bytes."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16:
            return False
        last = t.stride()[-2:]
        if 1 not in last:
            return False
        if any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


def use_grouped_mm(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return first.device.type == "cpu" and first.dtype in _GROUPED_MM_DTYPES and _aligned(*tensors)


def group_ends(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:].to(torch.int32)


def group_bounds(offsets: torch.Tensor) -> list[int]:
    # The loop fallback needs the ranges on the host; the grouped op reads them on the device.
    return offsets.tolist()


def grouped_mm(a: torch.Tensor, weight: Weight, offsets: torch.Tensor) -> torch.Tensor:
    """``a[m] @ weight[e(m)]ᵀ`` for the sorted rows ``a [N, K]`` and ``weight [E, n, K]`` (any strides, or an
    :class:`~fastft.kernels.moe_expert_table.ExpertTable`, read one expert's tensors at a time): ``[N, n]``."""
    if isinstance(weight, ExpertTable):
        out = a.new_empty((a.shape[0], weight.shape[1]))
        bounds = group_bounds(offsets)
        for e in range(weight.shape[0]):
            if bounds[e + 1] > bounds[e]:
                out[bounds[e] : bounds[e + 1]] = weight.matmul(a[bounds[e] : bounds[e + 1]], e)
        return out
    b = weight.transpose(1, 2)
    if a.shape[0] and use_grouped_mm(a, b):
        return torch._grouped_mm(a, b, offs=group_ends(offsets))
    out = a.new_empty((a.shape[0], weight.shape[1]))
    bounds = group_bounds(offsets)
    for e in range(weight.shape[0]):
        if bounds[e + 1] > bounds[e]:
            torch.mm(a[bounds[e] : bounds[e + 1]], b[e], out=out[bounds[e] : bounds[e + 1]])
    return out


def grouped_gemm_reference(
    x: torch.Tensor,
    weight: Weight,
    routing: MoERouting,
    *,
    gather: bool = False,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 0.0,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    scatter: bool = False,
) -> torch.Tensor:
    """:func:`grouped_gemm_triton` with torch's grouped matmul; arguments as :func:`grouped_gemm`."""
    rows = x[routing.token] if gather else x
    out = grouped_mm(rows, weight, routing.offsets)
    del rows
    if xa is not None and xa.shape[1] > 0:
        out.add_(grouped_mm(xa, lora_b, routing.offsets), alpha=scale)
    if bias is not None:
        out.add_(bias[routing.expert])
    if row_scale is not None:
        out.mul_(row_scale.to(out.dtype)[:, None])
    return out[routing.inverse] if scatter else out


def grouped_gemm(
    x: torch.Tensor,
    weight: Weight,
    routing: MoERouting,
    *,
    gather: bool = False,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 0.0,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    scatter: bool = False,
) -> torch.Tensor:
    """The grouped GEMM on Triton or the torch reference (:func:`fastft.kernels.dispatch.use_triton`).

    Args:
        x: ``[T, K]`` tokens when ``gather`` (row ``m`` reads token ``routing.token[m]``), else ``[N, K]`` sorted rows;
            the last dim contiguous.
        weight: ``[E, n, K]`` in x's dtype, any strides (a transposed or sliced view of the stored weight), or an
            :class:`~fastft.kernels.moe_expert_table.ExpertTable` of per-expert tensors (or its transpose).
        routing: The expert-sorted rows.
        gather: Read x's rows through ``routing.token``.
        xa: ``[N, r]`` LoRA-A products of the sorted rows, or None for no LoRA term.
        lora_b: ``[E, n, r]`` in x's dtype (any strides), with ``xa``.
        scale: The LoRA scale.
        bias: ``[E, n]`` in x's dtype, or None.
        row_scale: ``[N]`` per-row factors applied last (the router's weights), or None.
        scatter: Store row ``m`` at its flat ``(token, slot)`` position ``routing.order[m]``.

    Returns:
        ``[N, n]`` in x's dtype, rows in sorted order (or ``(token, slot)`` order with ``scatter``).
    """
    implementation = grouped_gemm_triton if dispatch.use_triton(x) else grouped_gemm_reference
    return implementation(
        x,
        weight,
        routing,
        gather=gather,
        xa=xa,
        lora_b=lora_b,
        scale=scale,
        bias=bias,
        row_scale=row_scale,
        scatter=scatter,
    )


__all__ = [
    "Tiles",
    "group_bounds",
    "group_ends",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_gemm_triton",
    "grouped_mm",
    "tiles",
    "use_grouped_mm",
]
