"""RMSNorm as Llama (and Gemma) compute it, forward and backward (dX and dW), in Triton with a plain-torch reference.

The default casting rule is transformers' ``LlamaRMSNorm``: the row is normalised in fp32, the result is cast back to
the input's dtype, and only then multiplied by the weight, so the output dtype is the promotion of the weight's and
the input's dtypes. Both paths keep that rounding step, so a fp16 model gives the same numbers as the stock module.

Two keywords give the other variants transformers has:

- ``offset``: the scale is ``offset + weight`` (added in fp32). Gemma 1, 2 and 3 and Qwen3-Next store a
  zero-centred weight and scale by ``1.0 + weight``.
- ``cast_before_weight=False``: the scale multiplies the fp32 normalised row and the product is cast to the input's
  dtype once, at the end (``Gemma3RMSNorm``: ``(x̂ * (1.0 + weight.float())).type_as(x)``; Gemma 3n and OLMo 2 do
  the same with ``offset=0``). The output dtype is then the input's.

So ``rms_norm(x, w, eps)`` is Llama's norm and ``rms_norm(x, w, eps, offset=1.0, cast_before_weight=False)`` is
Gemma's. dW is the same for ``offset + w`` as for ``w``.

Backward saves ``x``, ``weight`` and the per-row ``rstd`` (fp32, one value per row, shaped ``[..., 1]`` so that it
broadcasts over ``x``), never the output. dW is accumulated in fp32: each Triton program sums its share of rows into
one row of a ``[programs, hidden]`` buffer, which is reduced by one ``sum`` afterwards (no atomics, so the result does
not depend on scheduling).

The kernel is registered as the custom ops ``fastft::rms_norm`` (returns the output and rstd) and
``fastft::rms_norm_backward`` (see :mod:`fastft.kernels.custom_ops`): :func:`rms_norm` calls the op while
``torch.compile`` traces and :class:`RMSNormFunction` otherwise; both run the same forward and backward code.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import compiling, define, direct_apply, math_backward, pick, register_autograd
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.traced_reference import traces_reference

# One program holds a whole row in registers. Every released model's hidden size fits far below this; a wider row
# takes the torch reference rather than a kernel that would spill.
MAX_FUSED_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    x_col_stride,
    w_ptr,
    w_stride,
    y_ptr,
    rstd_ptr,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
):
    # int64 row offsets: rows * hidden passes 2**31 at long contexts.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.math.rsqrt(variance + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = x * rstd
    if CAST_BEFORE_WEIGHT:
        # Llama rounds the normalised row to the input dtype before the weight multiply; keep that rounding.
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols * w_stride, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET != 0.0:
        w = w + WEIGHT_OFFSET
    y = w * normed
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    dy_row_stride,
    dy_col_stride,
    x_ptr,
    x_row_stride,
    x_col_stride,
    w_ptr,
    w_stride,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    res_ptr,
    res_row_stride,
    res_col_stride,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols * w_stride, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET != 0.0:
        w = w + WEIGHT_OFFSET
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    # The last program's share may run past the end. Bound the loop rather than masking per row: the interpreter
    # turns `block_mask & (scalar < n)` into an int32 array that tl.load rejects ("mask has unsupported dtype").
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for row in range(first_row, last_row):
        x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        if COMPUTE_DW:
            if CAST_BEFORE_WEIGHT:
                # The forward multiplied the weight by the row rounded to the input dtype: that is dy/dw.
                dw_acc += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw_acc += dy * x_hat
        if COMPUTE_DX:
            # The casts to the input dtype are treated as identity, as autograd does for .to().
            dn = dy * w
            dot = tl.sum(dn * x_hat, axis=0) / n_cols
            dx = (rstd * (dn - x_hat * dot)).to(dx_ptr.dtype.element_ty)
            if ADD_RESIDUAL:
                # The residual stream's other gradient, added as `dx.add_(residual)` would add it: dx rounded to
                # the output dtype first, the sum in fp32, rounded once more (so bitwise the separate add's result,
                # without its launch and its extra pass over both tensors).
                res = tl.load(res_ptr + row * res_row_stride + cols * res_col_stride, mask=mask, other=0.0)
                dx = (dx.to(tl.float32) + res.to(tl.float32)).to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + row * n_cols + cols, dx, mask=mask)
    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> torch.Tensor:
    """RMSNorm in plain torch, op for op as ``LlamaRMSNorm.forward`` (by default) or ``Gemma3RMSNorm.forward``
    (``offset=1.0, cast_before_weight=False``), bit-identical to either.

    Args:
        x: Input ``[..., hidden]``.
        weight: Scale ``[hidden]``.
        eps: Added to the mean of squares before the reciprocal square root.
        offset: Added to the weight, in fp32, before it scales the row (Gemma: 1.0).
        cast_before_weight: True (Llama): the normalised row is cast to ``x.dtype`` before the scale multiplies it.
            False (Gemma): the product is formed in fp32 and cast to ``x.dtype`` once.

    Returns:
        ``(offset + weight) * (x / rms(x))`` with the chosen rounding; dtype is the promotion of ``weight.dtype``
        and ``x.dtype`` when ``cast_before_weight``, else ``x.dtype``. Differentiable by autograd.
    """
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if not cast_before_weight:
        return (hidden * (offset + weight.float())).to(input_dtype)
    if offset != 0.0:
        return ((offset + weight.float()) * hidden.to(input_dtype)).to(torch.promote_types(weight.dtype, input_dtype))
    return weight * hidden.to(input_dtype)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        hidden = x.shape[-1] if x.dim() >= 1 else "?"
        raise ShapeContractError(
            f"rms_norm: weight must be 1-D of size hidden = x.shape[-1], i.e. [{hidden}], "
            f"but weight has shape {list(weight.shape)} and x has shape {list(x.shape)}; "
            "pass the norm's own weight vector and a tensor whose last dimension is the hidden size."
        )


def _check_variant(offset: float, cast_before_weight: bool) -> None:
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not math.isfinite(offset):
        raise ValueError(
            f"rms_norm: offset must be a finite number, got {offset!r}; pass 0.0 for Llama-style norms or 1.0 for "
            "Gemma-style ones, whose weight is stored as (scale - 1)."
        )
    if not isinstance(cast_before_weight, bool):
        raise ValueError(
            f"rms_norm: cast_before_weight must be True or False, got {cast_before_weight!r}; True for Llama's "
            "rounding (normalised row cast to x.dtype, then scaled), False for Gemma's (scaled in fp32, cast once)."
        )


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, cast_before_weight: bool) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if cast_before_weight else x.dtype


def _rstd_shape(x: torch.Tensor) -> tuple[int, ...]:
    # One value per row, shaped to broadcast over x: the reference multiplies by it without a view.
    return (*x.shape[:-1], 1)


class _Plan(NamedTuple):
    """What a call's shapes, dtypes and variant decide, worked out once per signature."""

    out_dtype: torch.dtype
    rstd_shape: tuple[int, ...]
    # Llama's variant in fp32 (x and weight): torch's fused CPU op computes it bit for bit.
    fused_cpu: bool
    normalized_shape: tuple[int]


# torch >= 2.8 has a fused RMSNorm forward that also returns rstd; older torch runs the six-op reference.
_FUSED_RMS_NORM = getattr(torch, "_fused_rms_norm", None)


# Signature -> plan: the checks run, and torch.promote_types (an aten op) is called, once per distinct signature.
# Bounded, because a run whose sequence length changes every step would otherwise grow it without end.
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_MAX_PLANS = 256


def _make_plan(x: torch.Tensor, weight: torch.Tensor, offset: float, cast_before_weight: bool) -> _Plan:
    _check_shapes(x, weight)
    _check_variant(offset, cast_before_weight)
    fused_cpu = (
        _FUSED_RMS_NORM is not None
        and x.dtype == weight.dtype == torch.float32
        and offset == 0.0
        and cast_before_weight
        and x.shape[-1] > 0
        and x.numel() > 0
    )
    return _Plan(_output_dtype(x, weight, cast_before_weight), _rstd_shape(x), fused_cpu, (x.shape[-1],))


def _plan(x: torch.Tensor, weight: torch.Tensor, offset: float, cast_before_weight: bool) -> _Plan:
    """The checked plan for these inputs; raises ShapeContractError / ValueError as :func:`rms_norm` documents."""
    if compiling():
        # Traced once per graph, and symbolic sizes cannot key a dict.
        return _make_plan(x, weight, offset, cast_before_weight)
    # The variant's types are part of the key: True == 1 and 0 == 0.0, but only a bool / real passes the check.
    variant = (type(offset), offset, type(cast_before_weight), cast_before_weight)
    key = (x.shape, weight.shape, x.dtype, weight.dtype, variant)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable offset; the variant check names it
        return _make_plan(x, weight, offset, cast_before_weight)
    if plan is None:
        plan = _make_plan(x, weight, offset, cast_before_weight)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _rows(t: torch.Tensor, hidden: int) -> tuple[torch.Tensor, int, int]:
    """``t`` as rows of ``hidden`` for the kernels: the tensor to pass and its row and column strides."""
    if t.is_contiguous():
        # Already [rows, hidden] in memory: no view op on the hot path.
        return t, hidden, 1
    # reshape keeps a strided view whenever one exists (slices, most permutes, expanded gradients); the kernels take
    # both strides, so only a layout no 2-D view can describe is copied.
    rows = t.reshape(-1, hidden)
    return rows, rows.stride(0), rows.stride(1)


def _reference_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)


def _reference_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    needs_dx: bool,
    needs_dw: bool,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's backward math in torch, in fp32, on ``x``'s own shape (``rstd`` broadcasts as ``[..., 1]``)."""
    x_hat = dispatch.cast(x, torch.float32) * rstd
    dy32 = dispatch.cast(dy, torch.float32)
    dx = dw = None
    if needs_dx:
        scale = dispatch.cast(weight, torch.float32)
        if offset != 0.0:
            scale = scale + offset
        dn = dy32 * scale
        dot = (dn * x_hat).mean(-1, keepdim=True)
        # dn - x_hat * dot in one op (the product of -1 and x_hat * dot is exact).
        dx = torch.addcmul(dn, x_hat, dot, value=-1.0) * rstd
        dx = (dx if x.dtype == torch.float32 else dx.to(x.dtype)).contiguous()
    if needs_dw:
        # d(offset + w)/dw = 1: the same dW as without the offset.
        cast = cast_before_weight and x.dtype != torch.float32
        multiplied = x_hat.to(x.dtype).to(torch.float32) if cast else x_hat
        product = dy32 * multiplied
        # sum over an empty dim list would reduce every dim: a single row is already dW.
        dw = product.sum(tuple(range(x.dim() - 1))) if x.dim() > 1 else product
        if weight.dtype != torch.float32:
            dw = dw.to(weight.dtype)
    return dx, dw


def _num_warps(block: int, backward: bool = False) -> int:
    # Backward holds x, dy, the weight and the dW row per thread: at 8 warps and a 2048-wide row it spills on sm_80
    # (python -m fastft.kernels.compile_check), at 16 it does not.
    if block >= 8192 or (backward and block >= 2048):
        return 16
    if block >= 2048:
        return 8
    return 4


def _dw_programs(rows: int, device: torch.device) -> int:
    # Enough programs to fill the GPU twice over; each one adds a [hidden] row to the fp32 reduction afterwards.
    # The interpreter runs programs one after another: a few (several rows each) keep the partial-sum path tested.
    if device.type != "cuda":
        return max(1, min(rows, 4))
    return max(1, min(rows, torch.cuda.get_device_properties(device).multi_processor_count * 2))


def _takes_triton(x: torch.Tensor) -> bool:
    return dispatch.use_triton(x) and x.shape[-1] <= MAX_FUSED_HIDDEN


def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalised tensor (contiguous, ``x``'s shape) and rstd (fp32 ``[..., 1]``); the op's implementation."""
    plan = _plan(x, weight, offset, cast_before_weight)
    offset = float(offset)
    if _takes_triton(x):
        hidden = x.shape[-1]
        y = dispatch.empty(x.shape, dtype=plan.out_dtype, device=x.device)
        rstd = dispatch.empty(plan.rstd_shape, dtype=torch.float32, device=x.device)
        if y.numel() > 0:
            rows, row_stride, col_stride = _rows(x, hidden)
            block = triton.next_power_of_2(hidden)
            _rms_norm_fwd_kernel[(rstd.numel(),)](
                rows,
                row_stride,
                col_stride,
                weight,
                weight.stride(0),
                y,
                rstd,
                hidden,
                float(eps),
                BLOCK=block,
                WEIGHT_OFFSET=offset,
                CAST_BEFORE_WEIGHT=cast_before_weight,
                num_warps=_num_warps(block),
            )
        elif rstd.numel() > 0:  # hidden == 0: nothing to normalise; fill rstd the way the reference would.
            rstd = _reference_rstd(x, eps)
        return y, rstd
    if plan.fused_cpu and x.is_cpu:
        # Llama's fp32 norm as one aten op that also returns rstd: bit-identical to the six ops below on the CPU
        # (tests/test_kernel_rms_norm.py checks it), and six dispatches fewer on every call of every layer.
        y, rstd = _FUSED_RMS_NORM(x, plan.normalized_shape, weight, eps)
        return y.contiguous(), rstd
    # LlamaRMSNorm's (or Gemma3RMSNorm's) ops on x's own shape, so still bit-identical to it, keeping rstd for
    # backward instead of computing the mean of squares a second time. contiguous() copies only a non-contiguous x.
    hidden = x.to(torch.float32)
    rstd = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    normed = hidden * rstd
    if not cast_before_weight:
        y = (normed * (offset + weight.float())).to(x.dtype)
    elif offset != 0.0:
        y = ((offset + weight.float()) * normed.to(x.dtype)).to(plan.out_dtype)
    else:
        y = weight * normed.to(x.dtype)
    return y.contiguous(), rstd.contiguous()


def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    cast_before_weight: bool,
    needs_dx: bool,
    needs_dw: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dX, dW), None where not needed, from the saved input, weight and rstd.

    ``residual`` (x's shape and dtype, only with ``needs_dx``): a gradient to add to dX, as ``dx.add_(residual)``
    would, in the same pass: a pre-norm layer's input feeds both the norm and the residual add, so its gradient is
    the sum of the two.
    """
    if not _takes_triton(x) or x.numel() == 0:
        dx, dw = _reference_backward(dy, x, weight, rstd, needs_dx, needs_dw, offset, cast_before_weight)
        if residual is not None and dx is not None:
            # The decoder-layer node hands it in dX's shape already: no view dispatched for nothing.
            dx.add_(residual if residual.shape == dx.shape else residual.reshape(dx.shape))
        return dx, dw
    hidden = x.shape[-1]
    rows = rstd.numel()
    block = triton.next_power_of_2(hidden)
    programs = _dw_programs(rows, x.device) if needs_dw else rows
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    x2, x_row_stride, x_col_stride = _rows(x, hidden)
    dy2, dy_row_stride, dy_col_stride = _rows(dy, hidden)
    add_residual = residual is not None and needs_dx
    res2, res_row_stride, res_col_stride = _rows(residual, hidden) if add_residual else (rstd, 0, 0)
    dx = dispatch.empty(x.shape, dtype=x.dtype, device=x.device) if needs_dx else None
    dw_partial = dispatch.empty((programs, hidden), dtype=torch.float32, device=x.device) if needs_dw else None
    # An unused pointer argument still needs a tensor; rstd stands in, and the constexpr flag keeps it untouched.
    _rms_norm_bwd_kernel[(programs,)](
        dy2,
        dy_row_stride,
        dy_col_stride,
        x2,
        x_row_stride,
        x_col_stride,
        weight,
        weight.stride(0),
        rstd,
        dx if needs_dx else rstd,
        dw_partial if needs_dw else rstd,
        res2,
        res_row_stride,
        res_col_stride,
        rows,
        hidden,
        rows_per_program,
        BLOCK=block,
        COMPUTE_DX=needs_dx,
        COMPUTE_DW=needs_dw,
        ADD_RESIDUAL=add_residual,
        WEIGHT_OFFSET=offset,
        CAST_BEFORE_WEIGHT=cast_before_weight,
        num_warps=_num_warps(block, backward=True),
    )
    dw = dw_partial.sum(0).to(weight.dtype) if needs_dw else None
    return dx, dw


def _forward_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    out = x.new_empty(x.shape, dtype=_output_dtype(x, weight, cast_before_weight))
    return out, x.new_empty(_rstd_shape(x), dtype=torch.float32)


def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    cast_before_weight: bool,
    needs_dx: bool,
    needs_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _backward(dy, x, weight, rstd, offset, cast_before_weight, needs_dx, needs_dw)
    # An op has no optional outputs: a gradient nobody asked for is an empty placeholder that autograd never sees.
    return (x.new_empty(0) if dx is None else dx), (weight.new_empty(0) if dw is None else dw)


def _backward_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    cast_before_weight: bool,
    needs_dx: bool,
    needs_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape if needs_dx else 0), weight.new_empty(weight.shape if needs_dw else 0)


rms_norm_op = define("rms_norm", _forward, fake=_forward_fake)
rms_norm_backward_op = define("rms_norm_backward", _backward_op, fake=_backward_fake)


def _save(ctx: Any, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, cast: bool) -> None:
    # Only the input, the weight and one fp32 per row: the output is never kept.
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = float(offset)
    ctx.cast_before_weight = cast


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _eps, offset, cast_before_weight = inputs
    _save(ctx, x, weight, output[1], offset, cast_before_weight)
    ctx.mark_non_differentiable(output[1])


def _grad(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    x, weight, rstd = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (needs_dx or needs_dw):
        return None, None, None, None, None
    backward = pick(rms_norm_backward_op, _backward)
    dx, dw = backward(dy, x, weight, rstd, ctx.offset, ctx.cast_before_weight, needs_dx, needs_dw)
    return (dx if needs_dx else None), (dw if needs_dw else None), None, None, None


register_autograd(rms_norm_op, _setup_context, _grad)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm's eager autograd node: Triton kernels where :func:`dispatch.use_triton`, else torch math.

    ``RMSNormFunction.apply(x, weight, eps, offset=0.0, cast_before_weight=True)`` (the meanings of
    :func:`rms_norm`) returns the normalised tensor; backward returns ``(dx, dw, None, None, None)``, skipping the
    dW work when ``weight`` does not require grad (and dX when ``x`` does not). It runs the forward and backward
    of the op ``fastft::rms_norm`` without the dispatcher (rstd is saved, not returned, so it keeps the classic
    ``forward(ctx, ...)`` form). Once differentiable: a double backward raises.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float = 0.0,
        cast_before_weight: bool = True,
    ) -> torch.Tensor:
        y, rstd = _forward(x, weight, eps, offset, cast_before_weight)
        _save(ctx, x, weight, rstd, offset, cast_before_weight)
        return y

    @staticmethod
    @math_backward
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _grad(ctx, dy)


_apply_rms_norm = direct_apply(RMSNormFunction)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> torch.Tensor:
    """RMSNorm with a fused backward that also gives dW: Llama's by default, Gemma's with
    ``offset=1.0, cast_before_weight=False``.

    Under ``torch.compile`` this is the custom op ``fastft::rms_norm`` (one graph node, no graph break); in eager
    it is :class:`RMSNormFunction`, the same code without the dispatcher's cost.

    Args:
        x: Input ``[..., hidden]``, any layout, any number of rows (including one).
        weight: Scale ``[hidden]``; its gradient is computed only when it requires grad.
        eps: Added to the mean of squares before the reciprocal square root.
        offset: Added to the weight in fp32; the row is scaled by ``offset + weight``. Gemma (and Qwen3-Next)
            store ``scale - 1`` and pass 1.0. The gradient for ``weight`` is the same either way.
        cast_before_weight: True (Llama, ``LlamaRMSNorm``): the normalised row is rounded to ``x.dtype`` before the
            scale multiplies it. False (``Gemma3RMSNorm``, OLMo 2): the product is formed in fp32 and rounded to
            ``x.dtype`` once.

    Returns:
        A new contiguous tensor of ``x``'s shape; dtype ``torch.promote_types(weight.dtype, x.dtype)`` when
        ``cast_before_weight``, else ``x.dtype``.

    Raises:
        ShapeContractError: ``weight`` is not 1-D of size ``x.shape[-1]``.
        ValueError: ``offset`` is not a finite number, or ``cast_before_weight`` is not a bool.
    """
    if compiling():
        # Checked here, at trace time, so a bad call fails while compiling rather than inside the graph.
        _check_shapes(x, weight)
        _check_variant(offset, cast_before_weight)
        if traces_reference(x):
            return rms_norm_reference(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight)
        return rms_norm_op(x, weight, float(eps), float(offset), cast_before_weight)[0]
    return _apply_rms_norm(x, weight, eps, offset, cast_before_weight)


__all__ = ["MAX_FUSED_HIDDEN", "RMSNormFunction", "rms_norm", "rms_norm_reference"]
