"""The Triton kernels of both gated activations, SwiGLU's ``silu(gate) * up`` and GeGLU's ``gelu_tanh(gate) * up``:
one forward and one backward (which can also write the forward's output), the activation a compile-time flag.

What differs between the two is only the factor ``s`` with ``act(g) = g · s`` (``sigmoid(g)``, or ``sigmoid(2 z)``
for the tanh GELU, see :mod:`fastft.kernels.geglu`) and the derivative ``d act / dg`` built from it; loading, the
fp32 arithmetic, the in-place stores and which gradient is written are the same code. Each activation keeps its own
expressions, term for term, so both compute what their separate kernels computed.
"""

from __future__ import annotations

import torch

from fastft.kernels.dispatch import tl, triton

# Elementwise work: one block of this many elements per program; large enough to keep loads wide on a GPU, small
# enough that the odd tail block of a short input costs little.
BLOCK = 1024

# GELU's constants are written as literals (a jit function may only read constexpr globals):
#   2 z     = g (1.5957691216057308 + 0.07135481627260025 g²)    [2 sqrt(2/pi), 2 sqrt(2/pi) · 0.044715]
#   2 dz/dg = 1.5957691216057308 + 0.21406444881780076 g²        [2 sqrt(2/pi) · 3 · 0.044715]


@triton.jit
def _sigmoid_2z(g, g2):
    # s = sigmoid(2 z) = 0.5 (1 + tanh(z)) and s (1 - s), from e = exp(-|2 z|) <= 1: exp never overflows (no inf, no
    # numpy overflow warning under the interpreter), and 1 - s is e / (1 + e) for 2 z >= 0 instead of 1 - s rounded
    # near 1, so d gelu_tanh keeps its precision where s is close to 1.
    t = g * (1.5957691216057308 + 0.07135481627260025 * g2)
    e = tl.exp(-tl.abs(t))
    r = 1.0 / (1.0 + e)
    s = tl.where(t >= 0.0, r, e * r)
    return s, e * r * r


@triton.jit
def _gate_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, GELU: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: a long-context MLP activation passes 2**31 elements.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        s, _ = _sigmoid_2z(g, g * g)
    else:
        s = tl.sigmoid(g)
    h = g * s * u
    tl.store(out_ptr + offsets, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_backward_kernel(
    dh_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    h_ptr,
    n_elements,
    GELU: tl.constexpr,
    WRITE_DGATE: tl.constexpr,
    WRITE_DUP: tl.constexpr,
    WRITE_H: tl.constexpr,
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
    if GELU:
        g2 = g * g
        s, s_one_minus_s = _sigmoid_2z(g, g2)
    else:
        s = tl.sigmoid(g)
    if WRITE_H:
        # The forward's h, recomputed term for term as _gate_forward_kernel forms it (so bitwise the same), from the
        # gate and up this program has loaded anyway: the LoRA gradient of down_proj needs it, and a separate forward
        # launch would read gate and up once more.
        tl.store(h_ptr + offsets, (g * s * u).to(h_ptr.dtype.element_ty), mask=mask)
    if WRITE_DUP:
        tl.store(dup_ptr + offsets, (dh * g * s).to(dup_ptr.dtype.element_ty), mask=mask)
    if WRITE_DGATE:
        if GELU:
            dg = dh * u * (s + g * s_one_minus_s * (1.5957691216057308 + 0.21406444881780076 * g2))
        else:
            dg = dh * u * s * (1.0 + g * (1.0 - s))
        tl.store(dgate_ptr + offsets, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def launch_forward(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, gelu: bool) -> None:
    """``out = act(gate) * up`` over contiguous tensors of one shape (SwiGLU, or GeGLU with ``gelu``)."""
    n_elements = gate.numel()
    if n_elements:
        _gate_forward_kernel[(triton.cdiv(n_elements, BLOCK),)](gate, up, out, n_elements, GELU=gelu, BLOCK=BLOCK)


def launch_backward(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    d_gate: torch.Tensor | None,
    d_up: torch.Tensor | None,
    gelu: bool,
    hidden: torch.Tensor | None = None,
) -> None:
    """Write ``d_gate`` and ``d_up`` (either may be None: not written, its work skipped); they may be ``gate`` /
    ``up`` themselves. ``hidden``, when given (a buffer of its own), also gets the forward's ``act(gate) * up``."""
    n_elements = gate.numel()
    if not n_elements:
        return
    # An unused gradient slot still needs a pointer; the constexpr flag keeps it from being written.
    _gate_backward_kernel[(triton.cdiv(n_elements, BLOCK),)](
        dh,
        gate,
        up,
        gate if d_gate is None else d_gate,
        up if d_up is None else d_up,
        gate if hidden is None else hidden,
        n_elements,
        GELU=gelu,
        WRITE_DGATE=d_gate is not None,
        WRITE_DUP=d_up is not None,
        WRITE_H=hidden is not None,
        BLOCK=BLOCK,
    )


__all__ = ["BLOCK", "launch_backward", "launch_forward"]
