"""LoRA-O: attention's output projection with its LoRA adapter, the low-rank term in the GEMM epilogue.

``Y = X Wᵀ + b + s (X Aᵀ) Bᵀ`` over a 16-bit or NF4 base weight, the frozen bias ``b`` optional; the single-segment
case of :mod:`fastft.kernels.lora_qkv`, with the same rules: X and X Aᵀ saved, never Y; the base weight and bias
frozen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fastft.kernels.lora_projection import (
    LoRAWeights,
    autocast_off,
    check_group,
    compute_dtype,
    function_inputs,
    group_backward,
    group_forward,
    load_group,
    rebuild,
    save_group,
)


class LoRAOFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_o`; arguments ``(x, projections, W, A, B)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, projections: tuple[LoRAWeights, ...], *tensors: Any) -> torch.Tensor:
        projections = rebuild(projections, tensors)
        x2d = x.reshape(-1, x.shape[-1])
        (out,), xa = group_forward(x2d, projections, "o")
        save_group(ctx, x, x2d, xa, projections)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:
        x2d, xa, projections = load_group(ctx)
        needs = ctx.needs_input_grad
        grad_x, grad_a, grad_b = group_backward(x2d, xa, projections, [grad], needs[0], [needs[3] or needs[4]])
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, None, None, grad_a[0], grad_b[0]


def lora_o(x: torch.Tensor, o: LoRAWeights) -> torch.Tensor:
    """One projection with its LoRA adapter, fused (:class:`LoRAOFunction`); used for attention's o_proj.

    Args:
        x: Activations ``[..., in]`` (fp32 / fp16 / bf16); under autocast, cast to its dtype first.
        o: The projection: base ``[out, in]`` (dense or NF4), optional frozen bias ``[out]``, optional A ``[r, in]``
            and B ``[out, r]``.

    Returns:
        ``[..., out]``, contiguous, in the compute dtype.

    Raises:
        ShapeContractError: x, the bias or the adapter does not fit the base weight (named, with both shapes).
        TypeError: Activations, weights or biases of an unsupported dtype.
        ValueError: A base weight or bias that requires grad while autograd is on (it would get no gradient).
    """
    projections = (o,)
    check_group("lora_o", ("o_proj",), x, projections)
    dtype = compute_dtype(x)
    with autocast_off(x):
        return LoRAOFunction.apply(x.to(dtype), projections, *function_inputs(projections))


__all__ = ["LoRAOFunction", "lora_o"]
