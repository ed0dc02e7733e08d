"""GeGLU, the gate of Gemma's MLP: ``h = gelu_tanh(gate) * up`` with ``gate = gate_proj(x)`` and ``up = up_proj(x)``.

``gelu_tanh`` is the tanh approximation of GELU that transformers calls ``gelu_pytorch_tanh``
(``torch.nn.functional.gelu(x, approximate="tanh")``):

    gelu_tanh(g) = 0.5 g (1 + tanh(z)),  z = sqrt(2 / pi) (g + 0.044715 g³)

The kernels (:mod:`fastft.kernels.gate_kernels`, shared with SwiGLU) use the identity
``0.5 (1 + tanh(z)) = sigmoid(2 z)``, so they need one ``tl.exp`` and no libdevice ``tanh``: the same code runs under
the Triton interpreter and compiled for CUDA, and it does not lose precision to ``1 + tanh(z)`` cancelling for very
negative ``g``. With ``s = sigmoid(2 z)``:

    gelu_tanh(g)  = g s
    d gelu_tanh/dg = s + g s (1 - s) · 2 dz/dg = s + g s (1 - s) sqrt(8 / pi) (1 + 3 · 0.044715 g²)

    d_gate = dh * up * d gelu_tanh/dg
    d_up   = dh * gelu_tanh(gate)

Forward computes in fp32 and stores ``h`` in the input dtype. It saves ``gate`` and ``up`` only, and backward writes
the two input gradients over the saved buffers, with exactly the buffer rules of :mod:`fastft.kernels.swiglu`:

- a non-contiguous input is copied to a private contiguous buffer at forward (the kernels index flat memory);
- a leaf input is never overwritten: its gradient goes to a fresh buffer;
- an input whose gradient is not needed is never written;
- when ``gate`` and ``up`` overlap in memory (``geglu(t, t)``) neither is written;
- every buffer written in place gets its autograd version bumped (:func:`dispatch.mark_overwritten`), so another node
  that saved the same tensor, or a second backward through this one, raises "modified by an inplace operation"
  instead of reading gradients as activations.

The torch reference path follows the same buffer rules, so what happens to the caller's tensors does not depend on
the device. Under ``torch.compile`` :func:`geglu` is the custom op ``fastft::geglu`` (backward
``fastft::geglu_backward``, which allocates); eager calls take :class:`GeGLUFunction`. Both are built from this
file's kernels by :func:`fastft.kernels.swiglu.register_gate`, the machinery SwiGLU uses too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastft.kernels import dispatch, gate_kernels

# The same input checks, buffer rules, ops and Function as SwiGLU: one implementation of them.
from fastft.kernels.swiglu import (
    GatedActivation,
    _check_inputs,
    gate_forward,
    gate_gradients,
    gate_gradients_and_hidden,
    register_gate,
)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-torch GeGLU, differentiable by autograd: ``gelu_tanh(gate) * up`` in fp32, returned in gate's dtype.

    It matches the kernel's arithmetic (one rounding to the input dtype at the end). In fp32 it is bitwise the
    expression transformers' Gemma MLP uses, ``ACT2FN["gelu_pytorch_tanh"](gate) * up``; in fp16 / bf16
    transformers rounds ``gelu_tanh(gate)`` to the input dtype before the product, so the two differ by that rounding.

    Args:
        gate: ``gate_proj(x)``, any shape.
        up: ``up_proj(x)``, the same shape and dtype as ``gate``.

    Returns:
        ``gelu_tanh(gate) * up`` with gate's shape and dtype.

    Raises:
        ShapeContractError: ``gate`` and ``up`` have different shapes.
        TypeError: ``gate`` and ``up`` have different dtypes.
    """
    _check_inputs("geglu_reference", gate, up)
    return (_gelu_tanh(gate.float()) * up.float()).to(gate.dtype)


def _launch_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = dispatch.empty_like(gate)
    gate_kernels.launch_forward(gate, up, out, gelu=True)
    return out


def _launch_backward(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dgate: torch.Tensor | None,
    dup: torch.Tensor | None,
    hidden: torch.Tensor | None = None,
) -> None:
    gate_kernels.launch_backward(dh, gate, up, dgate, dup, gelu=True, hidden=hidden)


def _gelu_tanh_backward(grad: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    # aten's fused gelu_backward is the d_gate formula in one pass, as stock autograd computes it.
    if out is None:
        return torch.ops.aten.gelu_backward.default(grad, gate, approximate="tanh")
    return torch.ops.aten.gelu_backward.grad_input(grad, gate, approximate="tanh", grad_input=out)


GEGLU = GatedActivation("geglu", _gelu_tanh, _gelu_tanh_backward, _launch_forward, _launch_backward)
_GEGLU_OPS = register_gate(
    GEGLU,
    "GeGLUFunction",
    __name__,
    """``gelu_tanh(gate) * up`` whose backward writes the input gradients over the saved ``gate`` / ``up`` buffers.

    See the module docstring for which buffers are written in place and which get fresh ones. Once backward has
    run, an intermediate ``gate`` / ``up`` passed in holds its own gradient, not its activation. The eager entry to
    the op ``fastft::geglu``: ``GeGLUFunction.apply(gate, up) -> h``.
    """,
)
GeGLUFunction = _GEGLU_OPS.function
geglu_op = _GEGLU_OPS.op
geglu_backward_op = _GEGLU_OPS.backward_op


def geglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of two contiguous same-shape buffers, no autograd (for Functions that own the
    buffers)."""
    return gate_forward(GEGLU, gate, up)


def geglu_backward_(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``d gate`` over ``gate`` and ``d up`` over ``up`` (contiguous, non-overlapping buffers the caller owns)
    and return them; no autograd."""
    return gate_gradients(GEGLU, dh, gate, up, True, True, True, True)


def geglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` in new tensors, ``gate`` and ``up`` untouched; no autograd (the out-of-place
    :func:`geglu_backward_`, for a caller that is being compiled and so may not write its inputs)."""
    return gate_gradients(GEGLU, dh, gate, up, True, True, False, False)


def geglu_backward_with_hidden(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, d gate, d up)`` in one pass, ``h`` the forward's ``gelu_tanh(gate) * up``; the gradients written over
    ``gate`` / ``up`` when ``in_place`` (see :func:`fastft.kernels.swiglu.gate_gradients_and_hidden`); no autograd."""
    return gate_gradients_and_hidden(GEGLU, dh, gate, up, in_place)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU ``gelu_tanh(gate) * up`` for Gemma's MLP, Triton on CUDA (and under the interpreter), torch on CPU.

    ``gelu_tanh`` is transformers' ``gelu_pytorch_tanh`` (``F.gelu(x, approximate="tanh")``). Backward overwrites
    the saved ``gate`` and ``up`` with their gradients when they are autograd intermediates (the outputs of
    gate_proj / up_proj), so do not read them after backward, and do not save them in another op that runs its
    backward later: that op raises "modified by an inplace operation". Leaves, inputs that need no gradient, and
    non-contiguous inputs (copied privately at forward) are left untouched. Under ``torch.compile`` it is the custom
    op ``fastft::geglu``, whose backward allocates and writes nothing in place.

    Args:
        gate: ``gate_proj(x)``, any shape, fp32 / fp16 / bf16.
        up: ``up_proj(x)``, the same shape and dtype as ``gate``.

    Returns:
        ``gelu_tanh(gate) * up``, computed in fp32, with gate's shape and dtype (contiguous).

    Raises:
        ShapeContractError: ``gate`` and ``up`` have different shapes.
        TypeError: ``gate`` and ``up`` have different dtypes.
    """
    return _GEGLU_OPS.call(gate, up)


__all__ = [
    "GeGLUFunction",
    "geglu",
    "geglu_backward",
    "geglu_backward_",
    "geglu_backward_with_hidden",
    "geglu_forward",
    "geglu_reference",
]
