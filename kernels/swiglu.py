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

Under ``torch.compile`` none of that applies: :func:`swiglu` calls the custom op ``fastft::swiglu`` and its backward
is the op ``fastft::swiglu_backward``, which allocates its outputs (an op may not write its inputs unannounced; the
compiler plans the memory). Eager calls take :class:`SwiGLUFunction`, the same forward and gradient code without
the dispatcher. The machinery is shared with GeGLU (:mod:`fastft.kernels.geglu`): a :class:`GatedActivation`
names what differs, :func:`register_gate` builds both ops and the eager Function from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fastft.kernels import dispatch, gate_kernels
from fastft.kernels.custom_ops import compiling, define, direct_apply, math_backward, register_autograd
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.traced_reference import traces_reference


def _check_inputs(function: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    # Two comparisons: cheaper than building a key for a per-signature cache (0.25 against 0.32 µs measured).
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


@dataclass(frozen=True)
class GatedActivation:
    """What one gate kernel ``act(gate) * up`` brings; everything else is shared by :func:`register_gate`.

    Attributes:
        name: The public function's name (``"swiglu"``): the ops are ``fastft::<name>`` and ``fastft::<name>_backward``
            and error messages start with it.
        activation: ``act`` on an fp32 tensor (the torch reference path).
        activation_backward: ``(grad, gate32, out) -> grad * act'(gate32)``, one aten op; written into ``out``
            (which may be the very buffer ``gate32`` is) when ``out`` is not None.
        launch_forward: ``(gate, up) -> act(gate) * up`` on contiguous same-shape buffers, in one Triton launch.
        launch_backward: ``(dh, gate, up, d_gate, d_up, hidden=None) -> None``, one Triton launch writing the
            gradients into the given buffers (which may be ``gate`` / ``up`` themselves); a None buffer is not
            written; ``hidden``, when given, gets the forward's ``act(gate) * up`` too.
    """

    name: str
    activation: Callable[[torch.Tensor], torch.Tensor]
    activation_backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    launch_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    launch_backward: Callable[..., None]


def gate_forward(kind: GatedActivation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of two contiguous same-shape buffers into a new tensor, no autograd."""
    if dispatch.use_triton(gate):
        return kind.launch_forward(gate, up)
    product = kind.activation(dispatch.cast(gate, torch.float32)) * dispatch.cast(up, torch.float32)
    return dispatch.cast(product, gate.dtype)


def gate_gradients(
    kind: GatedActivation,
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    needs_gate: bool,
    needs_up: bool,
    gate_in_place: bool,
    up_in_place: bool,
    activated: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d gate, d up), None where not needed, no autograd; written over ``gate`` / ``up`` where ``*_in_place``.

    An in-place buffer must be contiguous and must not overlap the other input; the caller bumps its version.
    ``activated``: act(gate) in fp32 where the caller formed it already (the torch path then does not form it again).
    """
    dh = dh.contiguous()
    if dispatch.use_triton(dh):
        gate, up = gate.contiguous(), up.contiguous()
        d_gate = (gate if gate_in_place else dispatch.empty_like(gate)) if needs_gate else None
        d_up = (up if up_in_place else dispatch.empty_like(up)) if needs_up else None
        if gate.numel():
            kind.launch_backward(dh, gate, up, d_gate, d_up)
        return d_gate, d_up
    # In fp32, g and u ARE the saved buffers: dh * u is formed before d up lands on u, and act(g) before d gate
    # lands on g. out= writes the result straight into the buffer (rounded once, as .to() would) with no copy.
    g, u, d = dispatch.cast(gate, torch.float32), dispatch.cast(up, torch.float32), dispatch.cast(dh, torch.float32)
    scaled = d * u if needs_gate else None
    d_up = d_gate = None
    if needs_up:
        act = kind.activation(g) if activated is None else activated
        d_up = torch.mul(d, act, out=up) if up_in_place else dispatch.cast(d * act, up.dtype)
    if needs_gate:
        if gate_in_place:
            d_gate = kind.activation_backward(scaled, g, gate)
        else:
            d_gate = dispatch.cast(kind.activation_backward(scaled, g, None), gate.dtype)
    return d_gate, d_up


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


def gate_gradients_and_hidden(
    kind: GatedActivation, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, d gate, d up)``, no autograd: the forward's output and both gradients, for a backward that needs ``h``
    again (the LoRA gradient of the projection it feeds) and would otherwise rerun the forward kernel for it.

    On the Triton path one launch reads ``dh``, ``gate`` and ``up`` once and writes all three (``h`` bitwise what the
    forward kernel wrote); the gradients go over ``gate`` / ``up`` when ``in_place`` (contiguous, non-overlapping
    buffers the caller owns and bumps the version of), else into new buffers. ``h`` is always a new buffer.
    """
    if dispatch.use_triton(dh):
        dh, gate, up = dh.contiguous(), gate.contiguous(), up.contiguous()
        hidden = dispatch.empty_like(gate)
        d_gate = gate if in_place else dispatch.empty_like(gate)
        d_up = up if in_place else dispatch.empty_like(up)
        if gate.numel():
            kind.launch_backward(dh, gate, up, d_gate, d_up, hidden)
        return hidden, d_gate, d_up
    # Formed before the gradients land on gate / up, with gate_forward's arithmetic; act(gate) serves d up too.
    activated = kind.activation(dispatch.cast(gate, torch.float32))
    hidden = dispatch.cast(activated * dispatch.cast(up, torch.float32), gate.dtype)
    d_gate, d_up = gate_gradients(kind, dh, gate, up, True, True, in_place, in_place, activated)
    return hidden, d_gate, d_up


@dataclass(frozen=True)
class GateOps:
    """A gate kernel's two custom ops, its eager autograd Function, and ``call``: the public function's body (the op
    while compiling, the Function otherwise; see :func:`register_gate`)."""

    op: Any
    backward_op: Any
    function: type[torch.autograd.Function]
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def register_gate(kind: GatedActivation, function_name: str, module: str, doc: str) -> GateOps:
    """Register ``fastft::<name>`` and ``fastft::<name>_backward`` for a gate kernel and build its eager Function.

    Args:
        kind: The activation's pieces.
        function_name: The eager Function's class name (``"SwiGLUFunction"``), also its grad_fn's prefix.
        module: ``__module__`` for the class (the kernel file).
        doc: The class docstring.

    Returns:
        The ops (the public function calls ``op`` while compiling) and the Function (it applies it otherwise).
    """

    def forward_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_inputs(kind.name, gate, up)
        return gate_forward(kind, gate.contiguous(), up.contiguous())

    def backward_impl(
        dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, needs_gate: bool, needs_up: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d_gate, d_up = gate_gradients(kind, dh, gate, up, needs_gate, needs_up, False, False)
        # An op has no optional outputs: a gradient nobody asked for is an empty placeholder autograd never sees.
        return tuple(gate.new_empty(0) if d is None else d.contiguous() for d in (d_gate, d_up))

    def backward_fake(
        dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, needs_gate: bool, needs_up: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gate.new_empty(gate.shape if needs_gate else 0), up.new_empty(up.shape if needs_up else 0)

    op = define(kind.name, forward_impl, fake=lambda gate, up: gate.new_empty(gate.shape))
    backward_op = define(f"{kind.name}_backward", backward_impl, fake=backward_fake)

    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)
        ctx.gate_in_place = ctx.up_in_place = False

    def grad(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        needs_gate, needs_up = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (needs_gate or needs_up):
            return None, None
        if compiling():
            # The traced backward allocates (backward_op): the compiler plans that memory.
            d_gate, d_up = backward_op(dh, gate, up, needs_gate, needs_up)
            return (d_gate if needs_gate else None), (d_up if needs_up else None)
        d_gate, d_up = gate_gradients(kind, dh, gate, up, needs_gate, needs_up, ctx.gate_in_place, ctx.up_in_place)
        dispatch.mark_overwritten(*[t for t, flag in ((gate, ctx.gate_in_place), (up, ctx.up_in_place)) if flag])
        return d_gate, d_up

    register_autograd(op, setup_context, grad)

    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_inputs(kind.name, gate, up)
        gate_buffer, up_buffer = _contiguous_buffer(gate), _contiguous_buffer(up)
        out = gate_forward(kind, gate_buffer[0], up_buffer[0])
        save_for_in_place_backward(ctx, gate, up, gate_buffer, up_buffer)
        return out

    namespace = {
        "forward": staticmethod(forward),
        "backward": staticmethod(math_backward(grad)),
        "__doc__": doc,
        "__module__": module,
    }
    function = type(function_name, (torch.autograd.Function,), namespace)
    eager = direct_apply(function)

    def call(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if compiling():
            _check_inputs(kind.name, gate, up)  # at trace time: a bad call fails while compiling
            if traces_reference(gate):
                return gate_forward(kind, gate, up)
            return op(gate, up)
        return eager(gate, up)

    return GateOps(op, backward_op, function, call)


def _launch_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = dispatch.empty_like(gate)
    gate_kernels.launch_forward(gate, up, out, gelu=False)
    return out


def _launch_backward(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    d_gate: torch.Tensor | None,
    d_up: torch.Tensor | None,
    hidden: torch.Tensor | None = None,
) -> None:
    gate_kernels.launch_backward(dh, gate, up, d_gate, d_up, gelu=False, hidden=hidden)


def _silu_backward(grad: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    # aten's fused silu_backward is the d_gate formula of the module docstring in one pass, as stock autograd uses.
    if out is None:
        return torch.ops.aten.silu_backward.default(grad, gate)
    return torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)


SWIGLU = GatedActivation("swiglu", F.silu, _silu_backward, _launch_forward, _launch_backward)
_SWIGLU_OPS = register_gate(
    SWIGLU,
    "SwiGLUFunction",
    __name__,
    """``silu(gate) * up`` whose backward writes the input gradients over the saved ``gate`` / ``up`` buffers.

    See the module docstring for which buffers are written in place and which get fresh ones. Once backward has
    run, an intermediate ``gate`` / ``up`` passed in holds its own gradient, not its activation. The eager entry to
    the op ``fastft::swiglu``: ``SwiGLUFunction.apply(gate, up) -> h``.
    """,
)
SwiGLUFunction = _SWIGLU_OPS.function
swiglu_op = _SWIGLU_OPS.op
swiglu_backward_op = _SWIGLU_OPS.backward_op


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two contiguous same-shape buffers, no autograd (for Functions that own the buffers)."""
    return gate_forward(SWIGLU, gate, up)


def swiglu_backward_(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``d gate`` over ``gate`` and ``d up`` over ``up`` (contiguous, non-overlapping buffers the caller owns)
    and return them; no autograd."""
    return gate_gradients(SWIGLU, dh, gate, up, True, True, True, True)


def swiglu_backward_with_hidden(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, d gate, d up)`` in one pass, ``h`` the forward's ``silu(gate) * up``; the gradients written over
    ``gate`` / ``up`` when ``in_place`` (see :func:`gate_gradients_and_hidden`); no autograd."""
    return gate_gradients_and_hidden(SWIGLU, dh, gate, up, in_place)


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` in new tensors, ``gate`` and ``up`` untouched; no autograd (the out-of-place
    :func:`swiglu_backward_`, for a caller that is being compiled and so may not write its inputs)."""
    return gate_gradients(SWIGLU, dh, gate, up, True, True, False, False)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` for Llama's MLP, Triton on CUDA (and under the interpreter), torch on CPU.

    Backward overwrites the saved ``gate`` and ``up`` with their gradients when they are autograd intermediates
    (the outputs of gate_proj / up_proj), so do not read them after backward, and do not save them in another op
    that runs its backward later: that op raises "modified by an inplace operation". Leaves, inputs that need no
    gradient, and non-contiguous inputs (copied privately at forward) are left untouched. Under ``torch.compile``
    it is the custom op ``fastft::swiglu``, whose backward allocates and writes nothing in place.

    Args:
        gate: ``gate_proj(x)``, any shape, fp32 / fp16 / bf16.
        up: ``up_proj(x)``, the same shape and dtype as ``gate``.

    Returns:
        ``silu(gate) * up``, computed in fp32, with gate's shape and dtype (contiguous).

    Raises:
        ShapeContractError: ``gate`` and ``up`` have different shapes.
        TypeError: ``gate`` and ``up`` have different dtypes.
    """
    return _SWIGLU_OPS.call(gate, up)


__all__ = [
    "GatedActivation",
    "SwiGLUFunction",
    "gate_forward",
    "gate_gradients",
    "gate_gradients_and_hidden",
    "register_gate",
    "swiglu",
    "swiglu_backward",
    "swiglu_backward_",
    "swiglu_backward_with_hidden",
    "swiglu_forward",
    "swiglu_reference",
]
