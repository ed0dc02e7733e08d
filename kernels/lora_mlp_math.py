"""The math of the fused LoRA-MLP ``down(act(gate(x)) * up(x))``, and its custom ops.

Shared by the eager :class:`~fastft.kernels.lora_mlp.LoRAMLPFunction` and the ops ``torch.compile`` sees. Forward:
the gate / up group (two segments, or one packed gate_up cut in halves), the gate kernel (:mod:`fastft.kernels.swiglu`
or :mod:`fastft.kernels.geglu`), then the down group. It keeps X, the gate and up pre-activations and the small
X Aᵀ / H A_downᵀ; ``H = act(gate) · up`` is recomputed in backward. In eager, backward writes the gate's gradients
over the saved gate / up buffers; the backward op works on copies (a custom op must not write into its inputs, and
the compiler plans the memory itself).

Schemas (``weights`` ... ``scales`` as in :mod:`fastft.kernels.lora_group`, over the segments gate, up, down or
gate_up, down; the last segment is down)::

    fastft::lora_mlp(Tensor x, Tensor[] weights, Tensor[] lora_a, Tensor[] lora_b, Tensor[] biases, Tensor[] nf4,
                     SymInt[] layout, float[] scales, str activation, str gate_up_group, str down_group) -> Tensor[]
        # [out [..., hidden], X A_gate_upᵀ [M, Σ r], gate [M, I], up [M, I], H A_downᵀ [M, r_down]]
    fastft::lora_mlp_backward(Tensor grad, Tensor x, Tensor xa_gate_up, Tensor gate, Tensor up, Tensor xa_down,
                              Tensor[] weights, Tensor[] lora_a, Tensor[] lora_b, Tensor[] nf4, SymInt[] layout,
                              float[] scales, str activation, str gate_up_group, str down_group,
                              bool[] needs) -> Tensor[]
        # dX ([0] when needs[0] is False), then dA and dB per LoRA segment ([0] where not needed)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastft.kernels import dispatch, lora_backward, lora_math, lora_op_args
from fastft.kernels.custom_ops import define, register_autograd
from fastft.kernels.geglu import geglu, geglu_backward_, geglu_backward_with_hidden, geglu_forward
from fastft.kernels.lora_math import LAYOUT_FIELDS, Spec
from fastft.kernels.swiglu import swiglu, swiglu_backward_, swiglu_backward_with_hidden, swiglu_forward

GateForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GateBackward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# activation name -> (H = act(gate) * up, the backward that writes d gate / d up over the gate / up buffers).
ACTIVATIONS: dict[str, tuple[GateForward, GateBackward]] = {
    "silu": (swiglu_forward, swiglu_backward_),
    "gelu_tanh": (geglu_forward, geglu_backward_),
}


# activation name -> the public gate kernel (autograd, torch.compile): what an MLP the fused kernel cannot serve runs
# between its projections, and what the traced reference path traces.
GATES: dict[str, GateForward] = {"silu": swiglu, "gelu_tanh": geglu}


# activation name -> (dH, gate, up, in_place) -> (H, d gate, d up): the backward that also rewrites the forward's H.
HIDDEN_BACKWARDS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "silu": swiglu_backward_with_hidden,
    "gelu_tanh": geglu_backward_with_hidden,
}


def gate_functions(activation: object) -> tuple[GateForward, GateBackward]:
    """The gate kernel's forward and in-place backward for an activation name.

    Raises:
        ValueError: An activation other than ``"silu"`` or ``"gelu_tanh"``.
    """
    functions = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if functions is None:
        accepted = ", ".join(repr(name) for name in ACTIVATIONS)
        raise ValueError(
            f"lora_mlp: activation must be one of {accepted} (silu: SwiGLU, as in Llama; gelu_tanh: GeGLU with "
            f"transformers' gelu_pytorch_tanh, as in Gemma), got {activation!r}"
        )
    return functions


# One group's per-call tensors for lora_math: (weights, quant_states, lora_a, lora_b, biases).
Tensors = tuple[Sequence[torch.Tensor], Sequence[Any], Sequence[torch.Tensor], Sequence[torch.Tensor], Any]


def forward(
    gate_up: Spec,
    down: Spec,
    x2d: torch.Tensor,
    gate_up_tensors: Tensors,
    down_tensors: Tensors,
    activation: str,
    casts: tuple[dict[str, Any], dict[str, Any]] | None = None,
    output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(out [M, hidden], xa_gate_up, gate [M, I], up [M, I], xa_down)`` for ``x2d [M, hidden]``. ``casts``: the
    two groups' adapter casts, kept for the eager node's backward (:func:`fastft.kernels.lora_math.forward`).

    With ``output`` False, ``out`` is None and only what the backward reads is computed: no down GEMM (the largest
    of the MLP's three), and no ``H`` at all where down has no LoRA (the backward recomputes H for itself)."""
    gate_up_casts, down_casts = casts or (None, None)
    outputs, xa_gate_up = lora_math.forward(gate_up, x2d, *gate_up_tensors, gate_up_casts)
    if len(outputs) == 2:
        gate, up = outputs
    else:
        # A packed gate_up (Phi-3): rows of gate, then of up. The gate kernel reads (and backward writes) contiguous
        # halves; clone, not contiguous(): with one row a half is already contiguous and would alias the other.
        gate, up = (half.clone(memory_format=torch.contiguous_format) for half in outputs[0].chunk(2, dim=1))
    if not output and not down.lora:
        return None, xa_gate_up, gate, up, None
    hidden = ACTIVATIONS[activation][0](gate, up)
    if not output:
        _, _, lora_a, lora_b, _ = down_tensors
        return None, xa_gate_up, gate, up, lora_math.forward_xa(down, hidden, lora_a, lora_b, down_casts)[0]
    (out,), xa_down = lora_math.forward(down, hidden, *down_tensors, down_casts)
    return out, xa_gate_up, gate, up, xa_down


def backward(
    gate_up: Spec,
    down: Spec,
    x2d: torch.Tensor,
    xa_gate_up: torch.Tensor | None,
    gate: torch.Tensor,
    up: torch.Tensor,
    xa_down: torch.Tensor | None,
    grad: torch.Tensor,
    gate_up_tensors: Tensors,
    down_tensors: Tensors,
    activation: str,
    needs_x: bool,
    needs_lora: Sequence[bool],
    in_place: bool,
    casts: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """``(dX, [dA], [dB])`` over the LoRA segments (gate / up ones, then down's). ``in_place`` writes the gate's
    gradients over ``gate`` and ``up`` (the eager Function owns them); otherwise they go to new buffers."""
    count = len(gate_up.lora)
    gate_up_casts, down_casts = casts or (None, None)
    weights, states, lora_a, lora_b, _ = down_tensors
    # dH needs only dY; the down projection's dA needs H = act(gate) * up, which the gate's backward kernel writes
    # while it reads gate and up for their gradients, instead of a forward launch of its own before it.
    grad_hidden, pending = lora_backward.backward_input(
        down, gate, xa_down, weights, states, lora_a, lora_b, [grad], True, needs_lora[count:], down_casts
    )
    if pending.needs_x:
        hidden, grad_gate, grad_up = HIDDEN_BACKWARDS[activation](grad_hidden, gate, up, in_place)
    else:
        hidden = None
        if not in_place:
            gate, up = gate.clone(), up.clone()
        grad_gate, grad_up = ACTIVATIONS[activation][1](grad_hidden, gate, up)
    if in_place:
        # The gradients now sit in the forward's gate / up buffers (by a Triton kernel, or by torch below autograd):
        # their bumped versions make a second backward through this node fail loudly instead of reading them.
        dispatch.mark_overwritten(gate, up)
    del grad_hidden
    grad_a_down, grad_b_down = pending.finish(hidden)
    del hidden
    grads = [grad_gate, grad_up] if len(gate_up.widths) == 2 else [torch.cat([grad_gate, grad_up], dim=1)]
    weights, states, lora_a, lora_b, _ = gate_up_tensors
    grad_x, pending = lora_backward.backward_input(
        gate_up, x2d, xa_gate_up, weights, states, lora_a, lora_b, grads, needs_x, needs_lora[:count], gate_up_casts
    )
    grad_a, grad_b = pending.finish(x2d)
    return grad_x, grad_a + grad_a_down, grad_b + grad_b_down


# The custom ops -----------------------------------------------------------------------------------------------------


def _split(
    layout: Sequence[int],
    scales: Sequence[float],
    weights: Sequence[torch.Tensor],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    nf4: Sequence[torch.Tensor],
    groups: tuple[str, str],
) -> tuple[tuple[Spec, Tensors], tuple[Spec, Tensors]]:
    """The op's flat arguments cut into the gate / up group and the down group (the last segment): ``(spec,
    tensors)`` each."""
    head, tail = layout[:-LAYOUT_FIELDS], layout[-LAYOUT_FIELDS:]
    parts = lora_op_args.segments(head)
    n = len(parts)
    count = sum(part[2] >= 0 for part in parts)
    n_biases = sum(bool(part[3]) for part in parts)
    # Per NF4 segment: absmax, then state2.absmax, state2.code and the offset when double-quantised.
    n_nf4 = sum((4 if part[5] else 1) if part[4] else 0 for part in parts)

    def group_of(name, part_layout, part_scales, part_weights, a, b, part_biases, part_nf4):
        spec = lora_op_args.op_spec(name, part_layout, part_scales)
        states = lora_op_args.quant_states_from(part_layout, part_nf4)
        return spec, (part_weights, states, a, b, lora_op_args.biases_from(part_layout, part_biases))

    return (
        group_of(
            groups[0], head, scales[:n], weights[:n], lora_a[:count], lora_b[:count], biases[:n_biases], nf4[:n_nf4]
        ),
        group_of(
            groups[1], tail, scales[n:], weights[n:], lora_a[count:], lora_b[count:], biases[n_biases:], nf4[n_nf4:]
        ),
    )


def _lora_mlp(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    activation: str,
    gate_up_group: str,
    down_group: str,
) -> list[torch.Tensor]:
    (gate_up, gate_up_tensors), (down, down_tensors) = _split(
        layout, scales, weights, lora_a, lora_b, biases, nf4, (gate_up_group, down_group)
    )
    x2d = x.reshape(-1, x.shape[-1])
    out, xa_gate_up, gate, up, xa_down = forward(gate_up, down, x2d, gate_up_tensors, down_tensors, activation)
    rows = x2d.shape[0]
    if xa_gate_up is None:
        xa_gate_up = x2d.new_empty((rows, 0))
    if xa_down is None:
        xa_down = x2d.new_empty((rows, 0))
    return [out.view(*x.shape[:-1], out.shape[1]), xa_gate_up, gate, up, xa_down]


def _lora_mlp_fake(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    activation: str,
    gate_up_group: str,
    down_group: str,
) -> list[torch.Tensor]:
    *gate_up, down = lora_op_args.segments(layout)
    intermediate = gate_up[0][0] if len(gate_up) == 2 else gate_up[0][0] // 2
    rows = math.prod(x.shape[:-1])
    rank = sum(max(part[2], 0) for part in gate_up)
    return [
        x.new_empty((*x.shape[:-1], down[0])),
        x.new_empty((rows, rank)),
        x.new_empty((rows, intermediate)),
        x.new_empty((rows, intermediate)),
        x.new_empty((rows, max(down[2], 0))),
    ]


def _lora_mlp_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    xa_gate_up: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    xa_down: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    activation: str,
    gate_up_group: str,
    down_group: str,
    needs: list[bool],
) -> list[torch.Tensor]:
    (gate_up, gate_up_tensors), (down, down_tensors) = _split(
        layout, scales, weights, lora_a, lora_b, [], nf4, (gate_up_group, down_group)
    )
    grad_x, grad_a, grad_b = backward(
        gate_up,
        down,
        x.reshape(-1, x.shape[-1]),
        xa_gate_up,
        gate,
        up,
        xa_down,
        grad,
        gate_up_tensors,
        down_tensors,
        activation,
        needs[0],
        needs[1:],
        in_place=False,
    )
    return lora_op_args.gradient_list(x, grad_x, grad_a, grad_b)


def _lora_mlp_backward_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    xa_gate_up: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    xa_down: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    activation: str,
    gate_up_group: str,
    down_group: str,
    needs: list[bool],
) -> list[torch.Tensor]:
    return lora_op_args.fake_gradient_list(x, lora_a, lora_b, needs)


op = define("lora_mlp", _lora_mlp, fake=_lora_mlp_fake)
backward_op = define("lora_mlp_backward", _lora_mlp_backward, fake=_lora_mlp_backward_fake)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, weights, lora_a, lora_b, biases, nf4, layout, scales, activation, gate_up_group, down_group = inputs
    ctx.counts = (len(weights), len(lora_a), len(biases), len(nf4))
    ctx.static = (list(layout), list(scales), activation, gate_up_group, down_group)
    _, xa_gate_up, gate, up, xa_down = output
    ctx.mark_non_differentiable(xa_gate_up, gate, up, xa_down)
    ctx.save_for_backward(x, xa_gate_up, gate, up, xa_down, *weights, *lora_a, *lora_b, *nf4)


def _grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    layout, scales, activation, gate_up_group, down_group = ctx.static
    x, xa_gate_up, gate, up, xa_down, *rest = ctx.saved_tensors
    weights, lora_a, lora_b, nf4 = lora_op_args.saved_lists(rest, ctx.counts)
    needs = lora_op_args.needs_of(ctx)
    # autograd materialises a missing output gradient as zeros, so grads[0] is a tensor. Only a compiled graph (or a
    # direct call of the op) reaches this backward, so it calls the backward op (see lora_group's _grad).
    result = backward_op(
        grads[0],
        x,
        xa_gate_up,
        gate,
        up,
        xa_down,
        list(weights),
        list(lora_a),
        list(lora_b),
        list(nf4),
        layout,
        scales,
        activation,
        gate_up_group,
        down_group,
        needs,
    )
    return lora_op_args.input_gradients(result, needs, ctx.counts, trailing=5)


register_autograd(op, _setup, _grad)


__all__ = ["ACTIVATIONS", "backward", "backward_op", "forward", "gate_functions", "op"]
