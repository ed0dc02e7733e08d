"""SwiGLU, the gate of Llama's MLP: ``h = silu(gate) * up`` with ``gate = gate_proj(x)`` and ``up = up_proj(x)``.

Forward computes in fp32 and stores ``h`` in the input dtype. It saves ``gate`` and ``up`` only (never ``h`` or
``silu(gate)``), and backward recomputes the sigmoid from ``gate`` and writes the two input gradients over the saved
buffers, so the backward pass allocates nothing of the MLP's width:

    d_gate = dh * up * sig(gate) * (1 + gate * (1 - sig(gate)))
    d_up   = dh * silu(gate)

Writing over a tensor the caller produced is only safe for autograd intermediates that nothing else reads, so:

- a non-contiguous input is copied to a private contiguous buffer at forward (the kernels index flat memory);
- a leaf input (a parameter, or a tensor the caller made with ``requires_grad=True``) is never overwritten: its
  gradient goes to a fresh buffer, because a leaf's values are the caller's and its gradient would otherwise
  replace them;
- an input whose gradient is not needed is never written;
- when ``gate`` and ``up`` overlap in memory (``swiglu(t, t)``) neither is written, since one program's store would
  land on another program's input;
- every buffer written in place gets its autograd version bumped (:func:`dispatch.mark_overwritten`), so another
  node that saved the same tensor (``gate * gate`` kept beside the MLP) or a second backward through this one
  (``retain_graph=True``) raises "modified by an inplace operation" instead of reading gradients as activations.

The torch reference path follows the same buffer rules (it also writes in place), so what happens to the caller's
tensors does not depend on the device the tensors live on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastft.kernels import dispatch
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.errors import ShapeContractError

# Elementwise work: one block of this many elements per program; large enough to keep loads wide on a GPU, small
# enough that the odd tail block of a short input costs little.
_BLOCK = 1024


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    # int64 offsets: a long-context MLP activation passes 2**31 elements.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dh_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    n_elements,
    WRITE_DGATE: tl.constexpr,
    WRITE_DUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # dgate_ptr / dup_ptr may be gate_ptr / up_ptr themselves: each element is loaded before it is stored, by the
    # same program, and the caller guarantees gate and up do not overlap, so no program reads what another wrote.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    if WRITE_DUP:
        tl.store(dup_ptr + offsets, (dh * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)
    if WRITE_DGATE:
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def _check_inputs(function: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ShapeContractError(
            f"{function}: gate and up must have the same shape (expected up to be gate's {list(gate.shape)}), got "
            f"gate {list(gate.shape)} and up {list(up.shape)}; pass gate_proj(x) and up_proj(x) of the same "
            "tokens, both [..., intermediate_size]."
        )
    if gate.dtype != up.dtype:
        raise TypeError(
            f"{function}: gate and up must have the same dtype, got gate {gate.dtype} and up {up.dtype}; cast one "
            "of them (the MLP's gate_proj and up_proj should share a dtype)."
        )


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-torch SwiGLU, differentiable by autograd: ``silu(gate) * up`` computed in fp32, returned in gate's dtype.

    It matches the kernel's arithmetic (one rounding to the input dtype at the end). In fp32 it is bitwise the
    expression transformers' Llama MLP uses, ``ACT2FN["silu"](gate) * up``; in fp16 / bf16 transformers rounds
    ``silu(gate)`` to the input dtype before the product, so the two differ by that extra rounding.

    Args:
        gate: ``gate_proj(x)``, any shape.
        up: ``up_proj(x)``, the same shape and dtype as ``gate``.

    Returns:
        ``silu(gate) * up`` with gate's shape and dtype.

    Raises:
        ShapeContractError: ``gate`` and ``up`` have different shapes.
        TypeError: ``gate`` and ``up`` have different dtypes.
    """
    _check_inputs("swiglu_reference", gate, up)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _contiguous_buffer(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor to save for backward, and whether it is a private copy nobody else can see."""
    if tensor.is_contiguous():
        return tensor, False
    return tensor.contiguous(), True


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Both are contiguous here, so each covers exactly one byte range.
    if a.numel() == 0 or b.numel() == 0:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def save_for_in_place_backward(
    ctx: Any,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_buffer: tuple[torch.Tensor, bool],
    up_buffer: tuple[torch.Tensor, bool],
) -> None:
    """Save a gate kernel's two buffers and record which of them backward may overwrite with their gradients.

    ``gate_buffer`` / ``up_buffer`` are :func:`_contiguous_buffer`'s ``(buffer, private)`` for each input."""
    (gate_data, gate_private), (up_data, up_private) = gate_buffer, up_buffer
    needs_gate, needs_up = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # A leaf's storage holds the caller's values (a parameter, say), never a free scratch buffer.
    gate_in_place = needs_gate and (gate_private or not gate.is_leaf)
    up_in_place = needs_up and (up_private or not up.is_leaf)
    if _overlap(gate_data, up_data):
        gate_in_place = up_in_place = False
    ctx.gate_in_place = gate_in_place
    ctx.up_in_place = up_in_place
    ctx.save_for_backward(gate_data, up_data)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` whose backward writes the input gradients over the saved ``gate`` / ``up`` buffers.

    See the module docstring for which buffers are written in place and which get fresh ones. Once backward has
    run, an intermediate ``gate`` / ``up`` passed in holds its own gradient, not its activation.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_inputs("swiglu", gate, up)
        gate_buffer, gate_private = _contiguous_buffer(gate)
        up_buffer, up_private = _contiguous_buffer(up)

        if dispatch.use_triton(gate_buffer):
            out = dispatch.empty_like(gate_buffer)
            n_elements = gate_buffer.numel()
            if n_elements:
                grid = (triton.cdiv(n_elements, _BLOCK),)
                _swiglu_forward_kernel[grid](gate_buffer, up_buffer, out, n_elements, BLOCK=_BLOCK)
        else:
            out = (F.silu(gate_buffer.float()) * up_buffer.float()).to(gate.dtype)

        save_for_in_place_backward(ctx, gate, up, (gate_buffer, gate_private), (up_buffer, up_private))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        needs_gate, needs_up = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (needs_gate or needs_up):
            return None, None
        dh = dh.contiguous()

        if dispatch.use_triton(dh):
            dgate = (gate if ctx.gate_in_place else dispatch.empty_like(gate)) if needs_gate else None
            dup = (up if ctx.up_in_place else dispatch.empty_like(up)) if needs_up else None
            n_elements = gate.numel()
            if n_elements:
                grid = (triton.cdiv(n_elements, _BLOCK),)
                # An unused gradient slot still needs a pointer; the constexpr flag keeps it from being written.
                _swiglu_backward_kernel[grid](
                    dh,
                    gate,
                    up,
                    dgate if dgate is not None else gate,
                    dup if dup is not None else up,
                    n_elements,
                    WRITE_DGATE=needs_gate,
                    WRITE_DUP=needs_up,
                    BLOCK=_BLOCK,
                )
        else:
            g, u, d = gate.float(), up.float(), dh.float()
            # Both gradients are computed before either buffer is written: in fp32, g and u ARE the saved buffers.
            # aten's fused silu_backward is the d_gate formula above in one pass, as fast as stock autograd.
            dg = torch.ops.aten.silu_backward(d * u, g) if needs_gate else None
            du = d * F.silu(g) if needs_up else None
            dgate = gate.copy_(dg) if ctx.gate_in_place else (dg.to(gate.dtype) if needs_gate else None)
            dup = up.copy_(du) if ctx.up_in_place else (du.to(up.dtype) if needs_up else None)

        written = [t for t, flag in ((gate, ctx.gate_in_place), (up, ctx.up_in_place)) if flag]
        dispatch.mark_overwritten(*written)
        return dgate, dup


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two contiguous same-shape buffers, no autograd (for Functions that own the buffers)."""
    if dispatch.use_triton(gate):
        out = dispatch.empty_like(gate)
        if gate.numel():
            _swiglu_forward_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](gate, up, out, gate.numel(), BLOCK=_BLOCK)
        return out
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu_backward_(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``d gate`` over ``gate`` and ``d up`` over ``up`` (contiguous, non-overlapping buffers the caller owns)
    and return them; no autograd."""
    dh = dh.contiguous()
    if dispatch.use_triton(dh):
        if gate.numel():
            _swiglu_backward_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](
                dh, gate, up, gate, up, gate.numel(), WRITE_DGATE=True, WRITE_DUP=True, BLOCK=_BLOCK
            )
        return gate, up
    g, u, d = gate.float(), up.float(), dh.float()
    dg = torch.ops.aten.silu_backward(d * u, g)
    du = d * F.silu(g)
    return gate.copy_(dg), up.copy_(du)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` for Llama's MLP, Triton on CUDA (and under the interpreter), torch on CPU.

    Backward overwrites the saved ``gate`` and ``up`` with their gradients when they are autograd intermediates
    (the outputs of gate_proj / up_proj), so do not read them after backward, and do not save them in another op
    that runs its backward later: that op raises "modified by an inplace operation". Leaves, inputs that need no
    gradient, and non-contiguous inputs (copied privately at forward) are left untouched.

    Args:
        gate: ``gate_proj(x)``, any shape, fp32 / fp16 / bf16.
        up: ``up_proj(x)``, the same shape and dtype as ``gate``.

    Returns:
        ``silu(gate) * up``, computed in fp32, with gate's shape and dtype (contiguous).

    Raises:
        ShapeContractError: ``gate`` and ``up`` have different shapes.
        TypeError: ``gate`` and ``up`` have different dtypes.
    """
    return SwiGLUFunction.apply(gate, up)


__all__ = ["SwiGLUFunction", "swiglu", "swiglu_backward_", "swiglu_forward", "swiglu_reference"]
