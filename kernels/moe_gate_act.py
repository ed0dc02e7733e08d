"""The gated activation of the grouped experts, read straight from the packed gate | up rows, forward and backward.

The gate_up GEMM writes ``GU [N, 2I]`` in the weight's own row order: gate's I columns then up's (Qwen3-MoE, Mixtral
in transformers 5), or gate and up interleaved column by column (gpt-oss). Column ``j`` of gate is at
``gate_start + j · step`` and of up at ``up_start + j · step`` (``step`` 1 or 2), so neither order is copied apart.

Activations (``act`` a compile-time flag):

- ``silu`` (SwiGLU): ``H = silu(g) · u``.
- ``gpt_oss``: gpt-oss's clamped SwiGLU: ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``,
  ``H = (u' + 1) · g' · sigmoid(alpha · g')``; a clamped input gets no gradient, as torch's ``clamp`` gives none.

Backward takes ``dH`` before the router weight (``dH_u``) and the per-row weight ``w``, so ``dH = w · dH_u`` is
formed in registers, and writes d gate and d up over the GU buffer itself (each element is read before it is written,
by the same program): the gate | up gradient has the layout of GU, which the next GEMM reads as it is. A backward
program owns whole rows, so it also sums ``<dH_u, H>`` per row from the H it recomputes: the router weight's gradient
without another pass over ``[N, I]``.
"""

from __future__ import annotations

import torch

from fastft.kernels import dispatch
from fastft.kernels.dispatch import tl, triton

# Activation ids of the kernels' ACT flag.
SILU, GPT_OSS = 0, 1
ACTIVATIONS = {"silu": SILU, "gpt_oss": GPT_OSS}
BLOCK = 1024
# Backward: whole rows per program (for the per-row sum), in column chunks.
BLOCK_ROWS, BLOCK_COLS = 4, 256


@triton.jit
def _gate_up_offsets(offsets, inter, row_stride, step, gate_start, up_start):
    row = offsets // inter
    col = offsets % inter
    base = row * row_stride + col * step
    return row, base + gate_start, base + up_start


@triton.jit(do_not_specialize=["n_elements"])
def _moe_act_forward_kernel(
    gu_ptr,
    h_ptr,
    n_elements,
    inter,
    row_stride,
    step,
    gate_start,
    up_start,
    alpha,
    limit,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    _, gate_at, up_at = _gate_up_offsets(offsets, inter, row_stride, step, gate_start, up_start)
    g = tl.load(gu_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + up_at, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        lim = tl.cast(limit, tl.float32)
        g = tl.minimum(g, lim)
        u = tl.minimum(tl.maximum(u, -lim), lim)
        h = (u + 1.0) * g * tl.sigmoid(tl.cast(alpha, tl.float32) * g)
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _moe_act_backward_kernel(
    dh_ptr,
    row_scale_ptr,
    gu_ptr,
    rowdot_ptr,
    rows,
    inter,
    row_stride,
    step,
    gate_start,
    up_start,
    alpha,
    limit,
    ACT: tl.constexpr,
    ROWDOT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # A program owns whole rows, so the router weight's gradient <dH_u, H> of each row is summed here, in registers,
    # from the H this kernel recomputes anyway, instead of from a second [N, I] pass.
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < rows
    weight = tl.load(row_scale_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
    total = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for c0 in range(0, inter, BLOCK_COLS):
        col = c0 + tl.arange(0, BLOCK_COLS)
        mask = row_ok[:, None] & (col < inter)[None, :]
        base = row[:, None] * row_stride + col[None, :] * step
        dh_u = tl.load(dh_ptr + row[:, None] * inter + col[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gu_ptr + base + gate_start, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + base + up_start, mask=mask, other=0.0).to(tl.float32)
        dh = dh_u * weight[:, None]
        if ACT == 1:
            lim = tl.cast(limit, tl.float32)
            a = tl.cast(alpha, tl.float32)
            gc = tl.minimum(g, lim)
            uc = tl.minimum(tl.maximum(u, -lim), lim)
            s = tl.sigmoid(a * gc)
            glu = gc * s
            h = (uc + 1.0) * glu
            dg = tl.where(g <= lim, dh * (uc + 1.0) * (s + a * gc * s * (1.0 - s)), 0.0)
            du = tl.where((u >= -lim) & (u <= lim), dh * glu, 0.0)
        else:
            s = tl.sigmoid(g)
            h = g * s * u
            dg = dh * u * s * (1.0 + g * (1.0 - s))
            du = dh * g * s
        if ROWDOT:
            # H rounded to its dtype, as the reference's H is.
            total += tl.sum(dh_u * h.to(gu_ptr.dtype.element_ty).to(tl.float32), axis=1)
        tl.store(gu_ptr + base + gate_start, dg.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptr + base + up_start, du.to(gu_ptr.dtype.element_ty), mask=mask)
    if ROWDOT:
        tl.store(rowdot_ptr + row, total, mask=row_ok)


def layout(gu: torch.Tensor, interleaved: bool) -> tuple[int, int, int, int]:
    """``(I, step, gate_start, up_start)`` of a ``[N, 2I]`` gate | up buffer (contiguous rows)."""
    inter = gu.shape[1] // 2
    return (inter, 2, 0, 1) if interleaved else (inter, 1, 0, inter)


def _gate_up_views(gu: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    return gu.chunk(2, dim=1)


def act_forward_reference(gu: torch.Tensor, interleaved: bool, act: int, alpha: float, limit: float) -> torch.Tensor:
    """``H [N, I]`` from ``GU [N, 2I]`` in torch, computed in fp32 and rounded once (as the kernel does)."""
    gate, up = (t.float() for t in _gate_up_views(gu, interleaved))
    if act == GPT_OSS:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return ((up + 1.0) * gate * torch.sigmoid(gate * alpha)).to(gu.dtype)
    return (torch.nn.functional.silu(gate) * up).to(gu.dtype)


def act_backward_reference_(
    dh: torch.Tensor,
    row_scale: torch.Tensor,
    gu: torch.Tensor,
    interleaved: bool,
    act: int,
    alpha: float,
    limit: float,
    rowdot: bool = False,
) -> torch.Tensor | None:
    """:func:`act_backward_` in torch."""
    gate_view, up_view = _gate_up_views(gu, interleaved)
    g, u = gate_view.float(), up_view.float()
    d = dh.float() * row_scale.float()[:, None]
    if act == GPT_OSS:
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(alpha * gc)
        h = (uc + 1.0) * gc * s
        dg = torch.where(g <= limit, d * (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)), 0.0)
        du = torch.where((u >= -limit) & (u <= limit), d * gc * s, 0.0)
    else:
        s = torch.sigmoid(g)
        h = g * s * u
        dg = d * u * s * (1.0 + g * (1.0 - s))
        du = d * g * s
    sums = torch.linalg.vecdot(dh.float(), h.to(gu.dtype).float()) if rowdot else None
    gate_view.copy_(dg)
    up_view.copy_(du)
    return sums


def act_forward(gu: torch.Tensor, interleaved: bool, act: int, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation of a contiguous ``GU [N, 2I]``: ``H [N, I]`` in its dtype (Triton or torch)."""
    if not dispatch.use_triton(gu):
        return act_forward_reference(gu, interleaved, act, alpha, limit)
    inter, step, gate_start, up_start = layout(gu, interleaved)
    h = dispatch.empty((gu.shape[0], inter), dtype=gu.dtype, device=gu.device)
    n_elements = h.numel()
    if n_elements:
        grid = (triton.cdiv(n_elements, BLOCK),)
        scalars = (n_elements, inter, gu.stride(0), step, gate_start, up_start, float(alpha), float(limit))
        _moe_act_forward_kernel[grid](gu, h, *scalars, ACT=act, BLOCK=BLOCK)
    return h


def act_backward_(
    dh: torch.Tensor,
    row_scale: torch.Tensor,
    gu: torch.Tensor,
    interleaved: bool,
    act: int,
    alpha: float,
    limit: float,
    rowdot: bool = False,
) -> torch.Tensor | None:
    """Write the gate | up gradient for ``dH = row_scale[:, None] · dh`` (``dh [N, I]`` contiguous) over ``gu``.

    Returns:
        With ``rowdot``, ``<dh[m], H[m]>`` per row as fp32 ``[N]`` (the router weight's gradient before the bias term);
        else None.
    """
    if not dispatch.use_triton(gu):
        return act_backward_reference_(dh, row_scale, gu, interleaved, act, alpha, limit, rowdot)
    inter, step, gate_start, up_start = layout(gu, interleaved)
    rows = dh.shape[0]
    sums = dispatch.empty((rows,), dtype=torch.float32, device=gu.device) if rowdot else None
    if rows and inter:
        _moe_act_backward_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            dh,
            row_scale,
            gu,
            sums if rowdot else row_scale,
            rows,
            inter,
            gu.stride(0),
            step,
            gate_start,
            up_start,
            float(alpha),
            float(limit),
            ACT=act,
            ROWDOT=rowdot,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=BLOCK_COLS,
        )
    elif rowdot:
        sums.zero_()
    return sums


__all__ = [
    "ACTIVATIONS",
    "GPT_OSS",
    "SILU",
    "act_backward_",
    "act_backward_reference_",
    "act_forward",
    "act_forward_reference",
    "layout",
]
