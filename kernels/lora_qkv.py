"""LoRA-QKV: the q, k and v projections of attention, LoRA included, in one GEMM launch with a hand-written backward.

``Q, K, V = X W_iᵀ + b_i + s_i (X A_iᵀ) B_iᵀ`` for i in q, k, v, over 16-bit or NF4 base weights, with an optional
frozen bias ``b_i`` (Qwen2 / Qwen2.5 carry one on q, k and v), added in the GEMM epilogue; the widths may differ
(GQA). Forward saves X and the small X Aᵀ (never Q, K or V); backward gathers the three ``dX`` contributions in one
buffer and returns dA, dB per projection; the base weights get no gradient. The math is in
:mod:`fastft.kernels.lora_projection`, the kernel in :mod:`fastft.kernels.lora_gemm`.
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

_NAMES = ("q_proj", "k_proj", "v_proj")


class LoRAQKVFunction(torch.autograd.Function):
    """Autograd node of :func:`lora_qkv`; arguments ``(x, projections, Wq, Wk, Wv, Aq, Ak, Av, Bq, Bk, Bv)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, projections: tuple[LoRAWeights, ...], *tensors: Any) -> tuple[torch.Tensor, ...]:
        projections = rebuild(projections, tensors)
        x2d = x.reshape(-1, x.shape[-1])
        outputs, xa = group_forward(x2d, projections, "qkv")
        save_group(ctx, x, x2d, xa, projections)
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        x2d, xa, projections = load_group(ctx)
        n = ctx.count
        needs = ctx.needs_input_grad
        needs_lora = [needs[2 + n + i] or needs[2 + 2 * n + i] for i in range(n)]
        grad_x, grad_a, grad_b = group_backward(x2d, xa, projections, grads, needs[0], needs_lora)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return (grad_x, None, *[None] * n, *grad_a, *grad_b)


def lora_qkv(
    x: torch.Tensor, q: LoRAWeights, k: LoRAWeights, v: LoRAWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v projections with their LoRA adapters in one fused launch (:class:`LoRAQKVFunction`).

    Args:
        x: Hidden states ``[..., hidden]`` (fp32 / fp16 / bf16). Under autocast they are cast to its dtype first.
        q: The q projection: base ``[heads·head_dim, hidden]``, optional frozen bias ``[out]``, optional A
            ``[r, hidden]`` and B ``[out, r]``.
        k: The k projection (``[kv_heads·head_dim, hidden]``).
        v: The v projection (``[kv_heads·head_dim, hidden]``).

    Returns:
        ``(Q, K, V)``, each ``[..., out_i]`` and contiguous, in the compute dtype. Gradients flow to x and to every
        A and B; the base weights and biases are frozen.

    Raises:
        ShapeContractError: x's last dim is not a weight's in_features, or a bias / A / B that does not fit its base
            weight; the message names the projection and both shapes.
        TypeError: Activations, weights or biases of an unsupported dtype.
        ValueError: A base weight or bias that requires grad while autograd is on (it would get no gradient).
    """
    projections = (q, k, v)
    check_group("lora_qkv", _NAMES, x, projections)
    dtype = compute_dtype(x)
    with autocast_off(x):
        return LoRAQKVFunction.apply(x.to(dtype), projections, *function_inputs(projections))


__all__ = ["LoRAQKVFunction", "lora_qkv"]
