"""LoRA-MLP: the gated MLP ``down(act(gate(x)) * up(x))`` with LoRA on all three projections, fused.

``act`` is ``silu`` (SwiGLU: Llama, Mistral, SmolLM) or ``gelu_tanh`` (GeGLU: Gemma's ``gelu_pytorch_tanh``).
gate and up run as one two-segment launch of :mod:`fastft.kernels.lora_gemm` (LoRA in the epilogue), the gate is
the :mod:`fastft.kernels.swiglu` or :mod:`fastft.kernels.geglu` kernel, and down is a one-segment launch. Forward
saves X, the gate and up pre-activations and the small X Aᵀ / H A_downᵀ; the product ``H = act(gate) · up`` (as wide
as gate) is not saved but recomputed in backward, where the gate's gradients are then written over the saved
gate / up buffers. Stock autograd keeps gate, act(gate), up and H, so this saves half of the MLP's wide activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.geglu import geglu_backward_, geglu_forward
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

GateForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GateBackward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# activation name -> (H = act(gate) * up, the backward that writes d gate / d up over the gate / up buffers).
ACTIVATIONS: dict[str, tuple[GateForward, GateBackward]] = {
    "silu": (swiglu_forward, swiglu_backward_),
    "gelu_tanh": (geglu_forward, geglu_backward_),
}


def _gate_functions(activation: object) -> tuple[GateForward, GateBackward]:
    functions = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if functions is None:
        accepted = ", ".join(repr(name) for name in ACTIVATIONS)
        raise ValueError(
            f"lora_mlp: activation must be one of {accepted} (silu: SwiGLU, as in Llama; gelu_tanh: GeGLU with "
            f"transformers' gelu_pytorch_tanh, as in Gemma), got {activation!r}"
        )
    return functions


# Input positions of LoRAMLPFunction.forward as ctx.needs_input_grad counts them (ctx excluded): x, projections,
# activation, then the n weights, n A's and n B's (n = 3, or 2 for a packed gate_up).
_X, _TENSORS = 0, 3


def _gate_and_up(
    x2d: torch.Tensor, projections: list[LoRAWeights]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """gate and up pre-activations [M, intermediate] each, contiguous, and the stacked X Aᵀ of their group."""
    if len(projections) == 2:
        (gate_out, up_out), xa = group_forward(x2d, projections, "gate_up")
        return gate_out, up_out, xa
    # A packed gate_up (Phi-3): one projection whose rows are gate's, then up's; the gate kernel reads contiguous
    # halves, and backward writes its gradients over them.
    (gate_up_out,), xa = group_forward(x2d, projections, "gate_up")
    gate_out, up_out = (half.contiguous() for half in gate_up_out.chunk(2, dim=1))
    return gate_out, up_out, xa


class LoRAMLPFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_mlp` / :func:`lora_gate_up_mlp`; arguments ``(x, projections, activation, W...,
    A..., B...)`` over (gate, up, down) or (gate_up, down), ``activation`` one of :data:`ACTIVATIONS` (``"silu"`` or
    ``"gelu_tanh"``)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, projections: tuple[LoRAWeights, ...], activation: str, *tensors: Any
    ) -> torch.Tensor:
        gate_forward, _ = _gate_functions(activation)
        *gate_up, down = rebuild(projections, tensors)
        x2d = x.reshape(-1, x.shape[-1])
        gate_out, up_out, xa_gate_up = _gate_and_up(x2d, gate_up)
        hidden = gate_forward(gate_out, up_out)
        (out,), xa_down = group_forward(hidden, [down], "down")
        ctx.activation = activation
        ctx.x_shape = x.shape
        ctx.count = len(projections)
        ctx.scales = [float(p.scale) for p in (*gate_up, down)]
        ctx.quant_states = [quant_state_of(p) for p in (*gate_up, down)]
        ctx.save_for_backward(x2d, xa_gate_up, gate_out, up_out, xa_down, *tensors)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        x2d, xa_gate_up, gate_out, up_out, xa_down, *tensors = ctx.saved_tensors
        n = ctx.count
        *gate_up, down = (
            LoRAWeights(tensors[i], tensors[n + i], tensors[2 * n + i], ctx.scales[i], ctx.quant_states[i])
            for i in range(n)
        )
        needs = ctx.needs_input_grad
        needs_lora = [needs[_TENSORS + n + i] or needs[_TENSORS + 2 * n + i] for i in range(n)]
        gate_forward, gate_backward_ = _gate_functions(ctx.activation)

        hidden = gate_forward(gate_out, up_out)
        grad_hidden, (grad_a_down,), (grad_b_down,) = group_backward(
            hidden, xa_down, [down], [grad], True, [needs_lora[-1]]
        )
        del hidden
        grad_gate, grad_up = gate_backward_(grad_hidden, gate_out, up_out)
        del grad_hidden
        grads = [grad_gate, grad_up] if n == 3 else [torch.cat([grad_gate, grad_up], dim=1)]
        grad_x, grad_a, grad_b = group_backward(x2d, xa_gate_up, gate_up, grads, needs[_X], needs_lora[:-1])
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        # x, projections, activation, the frozen weights, then every A and every B.
        return (grad_x, None, None, *[None] * n, *grad_a, grad_a_down, *grad_b, grad_b_down)


def _check_down(x: torch.Tensor, down: LoRAWeights, intermediate: int, activation: str, source: str) -> None:
    # down reads H = act(gate) * up, [..., intermediate]; a meta tensor checks that without allocating it.
    check_group(
        "lora_mlp",
        ("down_proj",),
        x.new_empty((1, intermediate), device="meta"),
        (down,),
        x_name=f"its input H = {activation}(gate) * up ({source} {intermediate})",
    )


def lora_mlp(
    x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights, activation: str = "silu"
) -> torch.Tensor:
    """A gated MLP (Llama's SwiGLU, Gemma's GeGLU) with LoRA on gate, up and down, fused (:class:`LoRAMLPFunction`).

    Args:
        x: Hidden states ``[..., hidden]`` (fp32 / fp16 / bf16); under autocast, cast to its dtype first.
        gate: gate_proj: base ``[intermediate, hidden]`` (dense or NF4), optional A / B.
        up: up_proj, the same shapes as gate.
        down: down_proj: base ``[hidden, intermediate]``, optional A / B.
        activation: ``"silu"`` (SwiGLU, transformers' ``silu``) or ``"gelu_tanh"`` (GeGLU, transformers'
            ``gelu_pytorch_tanh``, i.e. ``F.gelu(x, approximate="tanh")``).

    Returns:
        ``down(act(gate(x)) * up(x))`` as ``[..., hidden]`` in the compute dtype. Gradients flow to x and every
        A and B; the base weights are frozen.

    Raises:
        ValueError: An activation other than ``"silu"`` or ``"gelu_tanh"``.
        ShapeContractError: A weight or adapter that does not fit x or the other projections (named, with both
            shapes).
        TypeError: Activations or weights of an unsupported dtype.
    """
    _gate_functions(activation)  # an unknown activation fails here, before any shape check or launch
    check_group("lora_mlp", ("gate_proj", "up_proj"), x, (gate, up))
    intermediate = weight_shape(gate)[0]
    if weight_shape(up)[0] != intermediate:
        raise ShapeContractError(
            f"lora_mlp: up_proj must be [intermediate, hidden] = {list(weight_shape(gate))} like gate_proj, got "
            f"{list(weight_shape(up))}; gate and up of one MLP share the intermediate size."
        )
    _check_down(x, down, intermediate, activation, "gate_proj's out_features")
    dtype = compute_dtype(x)
    projections = (gate, up, down)
    with autocast_off(x):
        return LoRAMLPFunction.apply(x.to(dtype), projections, activation, *function_inputs(projections))


def lora_gate_up_mlp(
    x: torch.Tensor, gate_up: LoRAWeights, down: LoRAWeights, activation: str = "silu"
) -> torch.Tensor:
    """:func:`lora_mlp` over a packed ``gate_up_proj`` (Phi-3 / Phi-4-mini): its first half of rows is gate's, the
    second up's, and its LoRA adapter spans both.

    Args:
        x: Hidden states ``[..., hidden]``.
        gate_up: gate_up_proj: base ``[2 · intermediate, hidden]`` (dense or NF4), optional A ``[r, hidden]`` /
            B ``[2 · intermediate, r]``.
        down: down_proj: base ``[hidden, intermediate]``, optional A / B.
        activation: As for :func:`lora_mlp`.

    Returns:
        ``down(act(gate) * up)`` with ``gate, up = gate_up(x).chunk(2, -1)``, as ``[..., hidden]``.

    Raises:
        ValueError: An unknown activation.
        ShapeContractError: An odd packed width, or a weight or adapter that does not fit (named, with both shapes).
        TypeError: Activations or weights of an unsupported dtype.
    """
    _gate_functions(activation)
    check_group("lora_gate_up_mlp", ("gate_up_proj",), x, (gate_up,))
    packed = weight_shape(gate_up)[0]
    if packed % 2:
        raise ShapeContractError(
            f"lora_gate_up_mlp: gate_up_proj must be [2 · intermediate, hidden], got {list(weight_shape(gate_up))} "
            "with an odd number of rows; it holds gate's rows then up's, so its out_features must be even."
        )
    _check_down(x, down, packed // 2, activation, "half of gate_up_proj's out_features")
    dtype = compute_dtype(x)
    projections = (gate_up, down)
    with autocast_off(x):
        return LoRAMLPFunction.apply(x.to(dtype), projections, activation, *function_inputs(projections))


__all__ = ["ACTIVATIONS", "LoRAMLPFunction", "lora_gate_up_mlp", "lora_mlp"]
