"""LoRA-QKV: the q, k and v projections of attention, LoRA included, in one GEMM launch with a hand-written backward.

``Q, K, V = X W_iᵀ + b_i + s_i (X A_iᵀ) B_iᵀ`` for i in q, k, v, over 16-bit or NF4 base weights, with an optional
frozen bias ``b_i`` (Qwen2 / Qwen2.5 carry one on q, k and v), added in the GEMM epilogue; the widths may differ
(GQA). Forward saves X and the small X Aᵀ (never Q, K or V); backward gathers the three ``dX`` contributions in one
buffer and returns dA, dB per projection; the base weights get no gradient. A patch holds a
:class:`~fastft.kernels.lora_group.LoRAGroup` per layer; :func:`lora_qkv` builds one per call. The math is in
:mod:`fastft.kernels.lora_math`, the kernel in :mod:`fastft.kernels.lora_gemm`.
"""

from __future__ import annotations

import torch

from fastft.kernels.lora_group import FUNCTIONS, LoRAGroup, LoRAGroupFunction
from fastft.kernels.lora_projection import FLOAT_DTYPES, LoRAWeights, x_dtype_error

_NAMES = ("q_proj", "k_proj", "v_proj")


class LoRAQKVFunction(LoRAGroupFunction):
    """Eager autograd node of a ``"lora_qkv"`` group (:func:`lora_qkv`); arguments ``(x, group, *A's, *B's)``."""


FUNCTIONS["lora_qkv"] = LoRAQKVFunction


def lora_qkv(
    x: torch.Tensor, q: LoRAWeights, k: LoRAWeights, v: LoRAWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v projections with their LoRA adapters in one fused launch (:class:`LoRAQKVFunction`).

    Builds (and checks) a :class:`~fastft.kernels.lora_group.LoRAGroup` per call; code that calls it every step
    should hold the group instead.

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
    if x.dtype not in FLOAT_DTYPES:
        raise x_dtype_error("lora_qkv", x)
    return LoRAGroup("lora_qkv", _NAMES, (q, k, v), "qkv")(x)


__all__ = ["LoRAQKVFunction", "lora_qkv"]
