"""Per-expert sums of outer products over the expert-sorted rows: the LoRA weight gradients of the grouped experts.

For sorted rows ``a [N, P]`` and ``b [N, Q]`` (either read through the token gather of
:mod:`fastft.kernels.moe_route`), an optional per-row factor ``w`` and a scale ``s``:

    out[e] = s · Σ_{m of expert e} a[m]ᵀ (w[m] · b[m])        [E, P, Q]

which is ``dA_e = s (dY B_e)ᵀ X_e`` and ``dB_e = s dY_eᵀ (X A_eᵀ)`` for every expert at once. Each program owns one
``[BLOCK_P, BLOCK_Q]`` tile of one expert and walks that expert's row range in ``BLOCK_M`` steps (the reduction
dimension is the token axis), so an expert no token chose writes exact zeros and nothing is shared between programs
(no atomics; the sum order is fixed).

The torch reference is ``torch._grouped_mm`` over the transposed rows where its stride rules hold (CPU, 16-byte
strides), else a loop over experts (reference only).
"""

from __future__ import annotations

import torch

from fastft.kernels import dispatch
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.moe_grouped_gemm import group_bounds, group_ends, use_grouped_mm
from fastft.kernels.moe_route import MoERouting


@triton.jit(do_not_specialize=["P", "Q"])
def _moe_outer_kernel(
    a_ptr,
    b_ptr,
    src_ptr,
    row_scale_ptr,
    out_ptr,
    offsets_ptr,
    P,
    Q,
    scale,
    stride_am,
    stride_ap,
    stride_bm,
    stride_bq,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    expert = tl.program_id(0)
    tile = tl.program_id(1)
    q_blocks = tl.cdiv(Q, BLOCK_Q)
    p_idx = (tile // q_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    q_idx = (tile % q_blocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = p_idx < P
    q_ok = q_idx < Q
    start = tl.load(offsets_ptr + expert).to(tl.int32)
    end = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        src = tl.load(src_ptr + rows, mask=row_ok, other=0) if GATHER_A or GATHER_B else rows
        a_rows = src if GATHER_A else rows
        b_rows = src if GATHER_B else rows
        a = tl.load(
            a_ptr + a_rows.to(tl.int64)[None, :] * stride_am + p_idx.to(tl.int64)[:, None] * stride_ap,
            mask=p_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + b_rows.to(tl.int64)[:, None] * stride_bm + q_idx.to(tl.int64)[None, :] * stride_bq,
            mask=row_ok[:, None] & q_ok[None, :],
            other=0.0,
        )
        if ROW_SCALE:
            # Scaled in fp32 and rounded once to the operand dtype, as the reference's scaled copy is.
            weight = tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * weight[:, None]).to(b_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    acc = acc * tl.cast(scale, tl.float32)
    out = out_ptr + expert.to(tl.int64) * P * Q + p_idx.to(tl.int64)[:, None] * Q + q_idx[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


# BLOCK_M is the reduction step: 32 rows keep the two operand tiles small enough for sm_75's FMA dot without spills.
_BLOCK_P, _BLOCK_Q, _BLOCK_M = 32, 32, 32


def grouped_outer_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: MoERouting,
    *,
    gather_a: bool = False,
    gather_b: bool = False,
    row_scale: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch the kernel; arguments as :func:`grouped_outer`."""
    p, q = a.shape[1], b.shape[1]
    experts = routing.num_experts
    out = dispatch.empty((experts, p, q), dtype=out_dtype or a.dtype, device=a.device)
    if p == 0 or q == 0 or experts == 0:
        return out
    grid = (experts, triton.cdiv(p, _BLOCK_P) * triton.cdiv(q, _BLOCK_Q))
    _moe_outer_kernel[grid](
        a,
        b,
        routing.token if gather_a or gather_b else routing.offsets,
        row_scale if row_scale is not None else a,
        out,
        routing.offsets,
        p,
        q,
        float(scale),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        GATHER_A=gather_a,
        GATHER_B=gather_b,
        ROW_SCALE=row_scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_P=_BLOCK_P,
        BLOCK_Q=_BLOCK_Q,
        BLOCK_M=_BLOCK_M,
        num_warps=4,
    )
    return out


def grouped_outer_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: MoERouting,
    *,
    gather_a: bool = False,
    gather_b: bool = False,
    row_scale: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`grouped_outer_triton` with torch's grouped matmul; arguments as :func:`grouped_outer`."""
    rows_a = a[routing.token] if gather_a else a
    rows_b = b[routing.token] if gather_b else b
    if row_scale is not None:
        rows_b = rows_b * row_scale.to(rows_b.dtype)[:, None]
    lhs = rows_a.t()
    if rows_a.shape[0] and use_grouped_mm(lhs, rows_b):
        out = torch._grouped_mm(lhs, rows_b, offs=group_ends(routing.offsets))
    else:
        out = rows_a.new_zeros((routing.num_experts, a.shape[1], b.shape[1]))
        bounds = group_bounds(routing.offsets)
        for e in range(routing.num_experts):
            if bounds[e + 1] > bounds[e]:
                torch.mm(lhs[:, bounds[e] : bounds[e + 1]], rows_b[bounds[e] : bounds[e + 1]], out=out[e])
    if scale != 1.0:
        out.mul_(scale)
    return out.to(out_dtype or a.dtype)


def grouped_outer(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: MoERouting,
    *,
    gather_a: bool = False,
    gather_b: bool = False,
    row_scale: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[e] = scale · Σ a[m]ᵀ (row_scale[m] · b[m])`` over expert ``e``'s sorted rows, on Triton or torch.

    Args:
        a: ``[N, P]`` sorted rows, or ``[T, P]`` tokens with ``gather_a``; a and b of one dtype.
        b: ``[N, Q]`` sorted rows, or ``[T, Q]`` tokens with ``gather_b``.
        routing: The expert-sorted rows.
        gather_a: Read a's rows through ``routing.token``.
        gather_b: Read b's rows through ``routing.token``.
        row_scale: ``[N]`` per-row factors, or None.
        scale: A factor on the whole sum (the LoRA scale).
        out_dtype: The result's dtype (default a's); the sums accumulate in fp32 on Triton.

    Returns:
        ``[E, P, Q]``; exactly zero for an expert without rows.
    """
    implementation = grouped_outer_triton if dispatch.use_triton(a) else grouped_outer_reference
    return implementation(
        a,
        b,
        routing,
        gather_a=gather_a,
        gather_b=gather_b,
        row_scale=row_scale,
        scale=scale,
        out_dtype=out_dtype,
    )


__all__ = ["grouped_outer", "grouped_outer_reference", "grouped_outer_triton"]
