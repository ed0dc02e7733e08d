"""LoRA on a packed q | k | v projection (Phi-3, Phi-4-mini): one fused GEMM launch, then the split.

The packed ``qkv_proj`` is one projection ``[(heads + 2 · kv_heads) · head_dim, hidden]`` whose LoRA adapter spans
all three; it runs as the single-segment group of :mod:`fastft.kernels.lora_o` (X and X Aᵀ saved, never Y; the
tuner's ``"qkv"`` group), and its output is split into q, k and v at the widths the caller passes — taken from the
config (heads · head_dim, kv_heads · head_dim, kv_heads · head_dim), never derived from the hidden size. The split
is a view; autograd joins the three gradients back into the packed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_o import LoRAOFunction
from fastft.kernels.lora_projection import (
    LoRAWeights,
    autocast_off,
    check_group,
    compute_dtype,
    function_inputs,
    group_forward,
    rebuild,
    save_group,
    weight_shape,
)


class LoRAPackedQKVFunction(LoRAOFunction):
    """Autograd node of :func:`lora_packed_qkv` (arguments ``(x, projections, W, A, B)``); backward is LoRA-O's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, projections: tuple[LoRAWeights, ...], *tensors: Any) -> torch.Tensor:
        projections = rebuild(projections, tensors)
        x2d = x.reshape(-1, x.shape[-1])
        (out,), xa = group_forward(x2d, projections, "qkv")
        save_group(ctx, x, x2d, xa, projections)
        return out.view(*x.shape[:-1], out.shape[-1])


def lora_packed_qkv(x: torch.Tensor, qkv: LoRAWeights, widths: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The packed q | k | v projection with its LoRA adapter, fused, split into ``(Q, K, V)``.

    Args:
        x: Hidden states ``[..., hidden]`` (fp32 / fp16 / bf16); under autocast, cast to its dtype first.
        qkv: qkv_proj: base ``[sum(widths), hidden]`` (dense or NF4), optional frozen bias, optional A / B.
        widths: The out widths of q, k and v, in the packed order.

    Returns:
        ``(Q, K, V)``, views of one ``[..., sum(widths)]`` output. Gradients flow to x and the adapter.

    Raises:
        ShapeContractError: The widths do not add up to qkv_proj's out_features (both named, with the fix).
    """
    check_group("lora_packed_qkv", ("qkv_proj",), x, (qkv,))
    packed = weight_shape(qkv)[0]
    if sum(widths) != packed or any(width <= 0 for width in widths):
        raise ShapeContractError(
            f"lora_packed_qkv: qkv_proj has out_features {packed}, but the q / k / v widths {list(widths)} add up to "
            f"{sum(widths)}; the widths are heads · head_dim, kv_heads · head_dim, kv_heads · head_dim from the "
            "config, so the checkpoint's qkv_proj does not fit its config.json."
        )
    dtype = compute_dtype(x)
    with autocast_off(x):
        out = LoRAPackedQKVFunction.apply(x.to(dtype), (qkv,), *function_inputs((qkv,)))
    return tuple(out.split(list(widths), dim=-1))


__all__ = ["LoRAPackedQKVFunction", "lora_packed_qkv"]
