"""LoRA-MLP: the gated MLP ``down(act(gate(x)) * up(x))`` with LoRA on all three projections, fused.

``act`` is ``silu`` (SwiGLU: Llama, Mistral, SmolLM) or ``gelu_tanh`` (GeGLU: Gemma's ``gelu_pytorch_tanh``).
gate and up run as one two-segment launch of :mod:`fastft.kernels.lora_gemm` (LoRA in the epilogue), the gate is
the :mod:`fastft.kernels.swiglu` or :mod:`fastft.kernels.geglu` kernel, and down is a one-segment launch. Forward
saves X, the gate and up pre-activations and the small X Aᵀ / H A_downᵀ; the product ``H = act(gate) · up`` (as wide
as gate) is not saved but recomputed in backward, where the gate's gradients are then written over the saved
gate / up buffers. Stock autograd keeps gate, act(gate), up and H, so this saves half of the MLP's wide activations.

A patch holds a :class:`LoRAMLP` (two :class:`~fastft.kernels.lora_group.LoRAGroup`\\ s and the activation, checked
once) per layer; :func:`lora_mlp` and :func:`lora_gate_up_mlp` build one per call. Eager calls apply
:class:`LoRAMLPFunction`; under ``torch.compile`` the custom op ``fastft::lora_mlp`` runs the same math
(:mod:`fastft.kernels.lora_mlp_math`, which also gives the op schemas).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels import lora_mlp_math
from fastft.kernels.custom_ops import below_autograd, compiling, direct_apply, math_backward
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_group import LoRAGroup
from fastft.kernels.lora_mlp_math import ACTIVATIONS, GATES, gate_functions
from fastft.kernels.lora_projection import (
    FLOAT_DTYPES,
    LoRAWeights,
    autocast_dtype,
    autocast_off,
    frozen_error,
    quant_state_of,
    x_dtype_error,
    x_shape_error,
)
from fastft.kernels.traced_reference import mlp_output, traces_reference


class LoRAMLP:
    """A gated MLP with LoRA on its projections: a gate / up group, the activation, a down group; checked once,
    applied per call.

    Args:
        gate_up: The gate and up projections as a two-projection group (``LoRAGroup("lora_mlp", ("gate_proj",
            "up_proj"), [gate, up], "gate_up")``), or a packed gate_up as a one-projection group whose first half of
            rows is gate's and second up's (``LoRAGroup("lora_gate_up_mlp", ("gate_up_proj",), [w], "gate_up")``).
        down: down_proj as a one-projection group (``LoRAGroup("lora_mlp", ("down_proj",), [d], "down")``).
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, transformers' ``gelu_pytorch_tanh``).

    Raises:
        ValueError: An unknown activation, or groups of the wrong size or with a split.
        ShapeContractError: gate and up of different widths, an odd packed gate_up, or a down_proj whose in_features
            is not the intermediate size (named, with both shapes).
    """

    def __init__(self, gate_up: LoRAGroup, down: LoRAGroup, activation: str = "silu") -> None:
        gate_functions(activation)  # an unknown activation fails first, as lora_mlp's does
        for role, group in (("gate_up", gate_up), ("down", down)):
            if not isinstance(group, LoRAGroup) or group.split is not None:
                raise ValueError(
                    f"LoRAMLP: {role} must be a LoRAGroup without split=, got {group!r}; build it with "
                    "LoRAGroup(function, names, projections, group)."
                )
        shapes = gate_up.shapes
        if len(shapes) == 2:
            intermediate = shapes[0][0]
            if shapes[1][0] != intermediate:
                raise ShapeContractError(
                    f"{gate_up.function}: {gate_up.names[1]} must be [intermediate, hidden] = {list(shapes[0])} like "
                    f"{gate_up.names[0]}, got {list(shapes[1])}; gate and up of one MLP share the intermediate size."
                )
            source = f"{gate_up.names[0]}'s out_features"
        elif len(shapes) == 1:
            if shapes[0][0] % 2:
                raise ShapeContractError(
                    f"{gate_up.function}: {gate_up.names[0]} must be [2 · intermediate, hidden], got "
                    f"{list(shapes[0])} with an odd number of rows; it holds gate's rows then up's, so its "
                    "out_features must be even."
                )
            intermediate = shapes[0][0] // 2
            source = f"half of {gate_up.names[0]}'s out_features"
        else:
            raise ValueError(
                f"LoRAMLP: gate_up must hold gate and up, or one packed gate_up, got {len(shapes)} projections "
                f"{list(gate_up.names)}."
            )
        if len(down.shapes) != 1:
            raise ValueError(f"LoRAMLP: down must hold down_proj only, got {len(down.shapes)} projections.")
        ((out_features, in_features),) = down.shapes
        if in_features != intermediate:
            # down reads H = act(gate) * up, [..., intermediate]; a meta stand-in names its shape.
            h = torch.empty((1, intermediate), device="meta")
            name = f"its input H = {activation}(gate) * up ({source} {intermediate})"
            raise x_shape_error(f"{down.function}: {down.names[0]}", h, out_features, in_features, name)
        values = {
            "gate_up": gate_up,
            "down": down,
            "activation": activation,
            "_adapters": (
                *gate_up._adapters[: gate_up._lora_count],
                *down._adapters[: down._lora_count],
                *gate_up._adapters[gate_up._lora_count :],
                *down._adapters[down._lora_count :],
            ),
            "_lora_count": gate_up._lora_count + down._lora_count,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"LoRAMLP is immutable; build a new one instead of setting {name!r}.")

    @classmethod
    def from_projections(cls, projections: Sequence[LoRAWeights], activation: str = "silu") -> LoRAMLP:
        """The MLP of :func:`lora_mlp`'s ``(gate, up, down)`` or :func:`lora_gate_up_mlp`'s ``(gate_up, down)``,
        checked as those functions check them."""
        gate_functions(activation)
        *gate_up, down = projections
        if len(gate_up) == 2:
            group = LoRAGroup("lora_mlp", ("gate_proj", "up_proj"), gate_up, "gate_up")
        else:
            group = LoRAGroup("lora_gate_up_mlp", ("gate_up_proj",), gate_up, "gate_up")
        return cls(group, LoRAGroup("lora_mlp", ("down_proj",), (down,), "down"), activation)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x [..., hidden]``; under autocast x is cast to its dtype first.

        Returns:
            ``down(act(gate(x)) * up(x))`` as ``[..., hidden]`` in the compute dtype. Gradients flow to x and to
            every A and B; base weights and biases are frozen.

        Raises:
            TypeError: x is not float32 / float16 / bfloat16.
            ShapeContractError: x's last dim is not gate_proj's in_features.
            ValueError: A base weight or bias requires grad while autograd is on (it would get no gradient).
        """
        self.gate_up.check_input(x)
        down = self.down
        if torch.is_grad_enabled() and any(t.requires_grad for t in down._frozen):
            raise frozen_error(f"{down.function}: {down.names[0]}", down.projections[0])
        dtype = autocast_dtype(x)
        if dtype is None:
            return self._apply(x)
        with autocast_off(x):
            return self._apply(x.to(dtype))

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if compiling():
            traced = mlp_output(self, x, GATES[self.activation]) if traces_reference(x) else None
            if traced is not None:
                return traced
            return lora_mlp_math.op(x, **self.op_arguments(x.dtype))[0]
        return _apply_mlp(x, self, *self._adapters)

    def op_arguments(self, dtype: torch.dtype) -> dict[str, Any]:
        """The custom op ``fastft::lora_mlp``'s keyword arguments after x (see :mod:`fastft.kernels.lora_mlp_math`)."""
        gate_up, down = self.gate_up.op_arguments(dtype), self.down.op_arguments(dtype)
        arguments: dict[str, Any] = {name: gate_up[name] + down[name] for name in gate_up}
        arguments.update(activation=self.activation, gate_up_group=self.gate_up.group, down_group=self.down.group)
        return arguments

    def __repr__(self) -> str:
        return f"LoRAMLP({self.gate_up!r}, {self.activation}, {self.down!r})"


def _tensors(group: LoRAGroup, adapters: Sequence[torch.Tensor]) -> lora_mlp_math.Tensors:
    count = len(adapters) // 2
    return group._weights, group._quant_states, adapters[:count], adapters[count:], group._biases


def _legacy(projections: Sequence[LoRAWeights], arguments: Sequence[Any]) -> LoRAMLP:
    # (x, projections, activation, W..., A..., B...): the projections again over the tensors autograd passed in.
    activation, tensors = arguments[0], arguments[1:]
    gate_functions(activation)
    n = len(projections)
    rebuilt = [
        LoRAWeights(tensors[i], tensors[n + i], tensors[2 * n + i], p.scale, quant_state_of(p), p.bias)
        for i, p in enumerate(projections)
    ]
    return LoRAMLP.from_projections(rebuilt, activation)


class LoRAMLPFunction(torch.autograd.Function):
    """Eager autograd node of :class:`LoRAMLP`: arguments ``(x, mlp, *A's, *B's)``, the A's and B's of the gate / up
    projections that carry LoRA, then down's. The form ``(x, projections, activation, W..., A..., B...)`` over
    (gate, up, down) or (gate_up, down), ``activation`` one of :data:`ACTIVATIONS`, is accepted too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mlp: Any, *arguments: Any) -> torch.Tensor:
        ctx.legacy = 0
        if not isinstance(mlp, LoRAMLP):
            ctx.legacy = len(mlp)
            mlp = _legacy(mlp, arguments)
            arguments = mlp._adapters
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        casts: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        # x2d (saved) is made above below_autograd(): a saved view of an input shares the input's version counter.
        with below_autograd():
            out, saved = mlp_forward(mlp, x2d, arguments, casts)
            if x.dim() != 2:
                out = out.view(*x.shape[:-1], out.shape[1])
        ctx.mlp = mlp
        ctx.casts = casts
        ctx.x_shape = x.shape
        ctx.save_for_backward(x2d, *saved, *arguments)
        return out

    @staticmethod
    @math_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, xa_gate_up, gate, up, xa_down, *adapters = ctx.saved_tensors
        mlp = ctx.mlp
        total = mlp._lora_count
        needs = ctx.needs_input_grad
        if ctx.legacy:
            needs_lora = _legacy_needs(mlp, needs, ctx.legacy)
        else:
            needs_lora = [needs[2 + j] or needs[2 + total + j] for j in range(total)]
        saved = (xa_gate_up, gate, up, xa_down)
        grad_x, grad_a, grad_b = mlp_backward(mlp, x2d, saved, adapters, grad, needs[0], needs_lora, ctx.casts)
        if grad_x is not None and len(ctx.x_shape) != 2:
            grad_x = grad_x.view(ctx.x_shape)
        if not ctx.legacy:
            return (grad_x, None, *grad_a, *grad_b)
        # x, projections, activation, the frozen weights, then every A and every B (None where no adapter).
        n = ctx.legacy
        full_a, full_b = [None] * n, [None] * n
        for j, segment in enumerate(_lora_segments(mlp)):
            full_a[segment], full_b[segment] = grad_a[j], grad_b[j]
        return (grad_x, None, None, *[None] * n, *full_a, *full_b)


_apply_mlp = direct_apply(LoRAMLPFunction)

# What the backward reads besides x and the adapters: xa of gate / up, the gate and up pre-activations, xa of down.
Saved = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _split_adapters(mlp: LoRAMLP, adapters: Sequence[torch.Tensor]) -> tuple[Sequence[Any], Sequence[Any]]:
    # The MLP's adapters are every A (gate / up ones, then down's), then every B in the same order.
    count, total = mlp.gate_up._lora_count, mlp._lora_count
    gate_up = (*adapters[:count], *adapters[total : total + count])
    down = (*adapters[count:total], *adapters[total + count :])
    return _tensors(mlp.gate_up, gate_up), _tensors(mlp.down, down)


def mlp_forward(
    mlp: LoRAMLP,
    x2d: torch.Tensor,
    adapters: Sequence[torch.Tensor],
    casts: tuple[dict[str, Any], dict[str, Any]],
    output: bool = True,
) -> tuple[torch.Tensor | None, Saved]:
    """The node's forward math (shared with :mod:`fastft.kernels.lora_decoder_layer`): ``(out [M, hidden], saved)``
    for ``x2d [M, hidden]``; ``adapters`` as :attr:`LoRAMLP._adapters` orders them, ``casts`` kept for the backward.
    With ``output`` False, ``out`` is None and only ``saved`` is computed (:func:`lora_mlp_math.forward`)."""
    gate_up, down = _split_adapters(mlp, adapters)
    out, xa_gate_up, gate, up, xa_down = lora_mlp_math.forward(
        mlp.gate_up._spec, mlp.down._spec, x2d, gate_up, down, mlp.activation, casts, output
    )
    return out, (xa_gate_up, gate, up, xa_down)


def mlp_backward(
    mlp: LoRAMLP,
    x2d: torch.Tensor,
    saved: Saved,
    adapters: Sequence[torch.Tensor],
    grad: torch.Tensor,
    needs_x: bool,
    needs_lora: Sequence[bool],
    casts: tuple[dict[str, Any], dict[str, Any]],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The node's backward math: ``(dX, [dA], [dB])``; the gate's gradients are written over the saved gate / up."""
    gate_up, down = _split_adapters(mlp, adapters)
    xa_gate_up, gate, up, xa_down = saved
    return lora_mlp_math.backward(
        mlp.gate_up._spec,
        mlp.down._spec,
        x2d,
        xa_gate_up,
        gate,
        up,
        xa_down,
        grad,
        gate_up,
        down,
        mlp.activation,
        needs_x,
        needs_lora,
        in_place=True,
        casts=casts,
    )


def _lora_segments(mlp: LoRAMLP) -> list[int]:
    """The segment index (gate, up, down or gate_up, down) of each LoRA projection, in the adapters' order."""
    down_index = len(mlp.gate_up.shapes)
    return [*mlp.gate_up._spec.lora, *[down_index + i for i in mlp.down._spec.lora]]


def _legacy_needs(mlp: LoRAMLP, needs: Sequence[bool], n: int) -> list[bool]:
    # Legacy positions: x, projections, activation, n weights, n A's, n B's.
    return [needs[3 + n + i] or needs[3 + 2 * n + i] for i in _lora_segments(mlp)]


def lora_mlp(
    x: torch.Tensor, gate: LoRAWeights, up: LoRAWeights, down: LoRAWeights, activation: str = "silu"
) -> torch.Tensor:
    """A gated MLP (Llama's SwiGLU, Gemma's GeGLU) with LoRA on gate, up and down, fused (:class:`LoRAMLPFunction`).

    Builds (and checks) a :class:`LoRAMLP` per call; code that calls it every step should hold the MLP instead.

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
    gate_functions(activation)  # an unknown activation fails here, before any shape check or launch
    if x.dtype not in FLOAT_DTYPES:
        raise x_dtype_error("lora_mlp", x)
    return LoRAMLP.from_projections((gate, up, down), activation)(x)


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
    gate_functions(activation)
    if x.dtype not in FLOAT_DTYPES:
        raise x_dtype_error("lora_gate_up_mlp", x)
    return LoRAMLP.from_projections((gate_up, down), activation)(x)


__all__ = ["ACTIVATIONS", "LoRAMLP", "LoRAMLPFunction", "lora_gate_up_mlp", "lora_mlp", "mlp_backward", "mlp_forward"]
