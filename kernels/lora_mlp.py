"""LoRA-MLP: Llama's MLP ``down(silu(gate(x)) * up(x))`` with LoRA on all three projections, fused.

gate and up run as one two-segment launch of :mod:`fastft.kernels.lora_gemm` (LoRA in the epilogue), SwiGLU is
the :mod:`fastft.kernels.swiglu` kernel, and down is a one-segment launch. Forward saves X, the gate and up
pre-activations and the small X Aᵀ / H A_downᵀ; the product ``H = silu(gate) · up`` (as wide as gate) is not
saved but recomputed in backward, where the SwiGLU gradients are then written over the saved gate / up buffers.
Stock autograd keeps gate, silu(gate), up and H, so this saves half of the MLP's wide activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_projection import (
    LoRAWeights,
    autocast_off,
    check_group,
    compute_dtype,
    function_inputs,
    group_backward,
    group_forward,
    quant_state_of,
    rebuild,
    weight_shape,
)
from fastft.kernels.swiglu import swiglu_backward_, swiglu_forward


class LoRAMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_mlp`; arguments ``(x, projections, Wg, Wu, Wd, Ag, Au, Ad, Bg, Bu, Bd)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, projections: tuple[LoRAWeights, ...], *tensors: Any) -> torch.Tensor:
        gate, up, down = rebuild(projections, tensors)
        x2d = x.reshape(-1, x.shape[-1])
        (gate_out, up_out), xa_gate_up = group_forward(x2d, [gate, up], "gate_up")
        hidden = swiglu_forward(gate_out, up_out)
        (out,), xa_down = group_forward(hidden, [down], "down")
        ctx.x_shape = x.shape
        ctx.scales = [float(p.scale) for p in (gate, up, down)]
        ctx.quant_states = [quant_state_of(p) for p in (gate, up, down)]
        ctx.save_for_backward(x2d, xa_gate_up, gate_out, up_out, xa_down, *tensors)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        x2d, xa_gate_up, gate_out, up_out, xa_down, *tensors = ctx.saved_tensors
        gate, up, down = (
            LoRAWeights(tensors[i], tensors[3 + i], tensors[6 + i], ctx.scales[i], ctx.quant_states[i])
            for i in range(3)
        )
        needs = ctx.needs_input_grad
        needs_lora = [needs[5 + i] or needs[8 + i] for i in range(3)]

        hidden = swiglu_forward(gate_out, up_out)
        grad_hidden, (grad_a_down,), (grad_b_down,) = group_backward(
            hidden, xa_down, [down], [grad], True, [needs_lora[2]]
        )
        del hidden
        grad_gate, grad_up = swiglu_backward_(grad_hidden, gate_out, up_out)
        del grad_hidden
        grad_x, (grad_a_gate, grad_a_up), (grad_b_gate, grad_b_up) = group_backward(
            x2d, xa_gate_up, [gate, up], [grad_gate, grad_up], needs[0], needs_lora[:2]
        )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return (
            grad_x,
            None,
            None,
            None,
            None,
            grad_a_gate,
            grad_a_up,
            grad_a_down,
            grad_b_gate,
            grad_b_up,
            grad_b_down,
        )


def lora_mlp(x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights) -> torch.Tensor:
    """Llama's SwiGLU MLP with LoRA on gate, up and down, fused (:class:`LoRAMLPFunction`).

    Args:
        x: Hidden states ``[..., hidden]`` (fp32 / fp16 / bf16); under autocast, cast to its dtype first.
        gate: gate_proj: base ``[intermediate, hidden]`` (dense or NF4), optional A / B.
        up: up_proj, the same shapes as gate.
        down: down_proj: base ``[hidden, intermediate]``, optional A / B.

    Returns:
        ``down(silu(gate(x)) * up(x))`` as ``[..., hidden]`` in the compute dtype. Gradients flow to x and every
        A and B; the base weights are frozen.

    Raises:
        ShapeContractError: A weight or adapter that does not fit x or the other projections (named, with both
            shapes).
        TypeError: Activations or weights of an unsupported dtype.
    """
    check_group("lora_mlp", ("gate_proj", "up_proj"), x, (gate, up))
    intermediate = weight_shape(gate)[0]
    if weight_shape(up)[0] != intermediate:
        raise ShapeContractError(
            f"lora_mlp: up_proj must be [intermediate, hidden] = {list(weight_shape(gate))} like gate_proj, got "
            f"{list(weight_shape(up))}; gate and up of one MLP share the intermediate size."
        )
    # down reads H = silu(gate) * up, [..., intermediate]; a meta tensor checks that without allocating it.
    check_group(
        "lora_mlp",
        ("down_proj",),
        x.new_empty((1, intermediate), device="meta"),
        (down,),
        x_name=f"its input H = silu(gate) * up (gate_proj's out_features {intermediate})",
    )
    dtype = compute_dtype(x)
    projections = (gate, up, down)
    with autocast_off(x):
        return LoRAMLPFunction.apply(x.to(dtype), projections, *function_inputs(projections))


__all__ = ["LoRAMLPFunction", "lora_mlp"]
