"""LoRA on a packed q | k | v projection (Phi-3, Phi-4-mini): one fused GEMM launch, then the split.

The packed ``qkv_proj`` is one projection ``[(heads + 2 · kv_heads) · head_dim, hidden]`` whose LoRA adapter spans
all three; it runs as a single-segment :class:`~fastft.kernels.lora_group.LoRAGroup` (X and X Aᵀ saved, never Y; the
tuner's ``"qkv"`` group) built with ``split=``, and its output is split into q, k and v at the widths the caller
passes — taken from the config (heads · head_dim, kv_heads · head_dim, kv_heads · head_dim), never derived from the
hidden size. The split is a view; autograd joins the three gradients back into the packed one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastft.kernels.lora_group import FUNCTIONS, LoRAGroup, LoRAGroupFunction
from fastft.kernels.lora_projection import FLOAT_DTYPES, LoRAWeights, x_dtype_error


class LoRAPackedQKVFunction(LoRAGroupFunction):
    """Eager autograd node of a ``"lora_packed_qkv"`` group (:func:`lora_packed_qkv`); arguments
    ``(x, group, A, B)``, one packed output (the group splits it)."""


FUNCTIONS["lora_packed_qkv"] = LoRAPackedQKVFunction


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
    if x.dtype not in FLOAT_DTYPES:
        raise x_dtype_error("lora_packed_qkv", x)
    return LoRAGroup("lora_packed_qkv", ("qkv_proj",), (qkv,), "qkv", split=widths)(x)


__all__ = ["LoRAPackedQKVFunction", "lora_packed_qkv"]
