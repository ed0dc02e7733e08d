"""LoRA-O: attention's output projection with its LoRA adapter, the low-rank term in the GEMM epilogue.

``Y = X Wᵀ + b + s (X Aᵀ) Bᵀ`` over a 16-bit or NF4 base weight, the frozen bias ``b`` optional; the single-segment
case of :mod:`fastft.kernels.lora_qkv`, with the same rules: X and X Aᵀ saved, never Y; the base weight and bias
frozen.
"""

from __future__ import annotations

import torch

from fastft.kernels.lora_group import FUNCTIONS, LoRAGroup, LoRAGroupFunction
from fastft.kernels.lora_projection import FLOAT_DTYPES, LoRAWeights, x_dtype_error


class LoRAOFunction(LoRAGroupFunction):
    """Eager autograd node of a ``"lora_o"`` group (:func:`lora_o`); arguments ``(x, group, A, B)``."""


FUNCTIONS["lora_o"] = LoRAOFunction


def lora_o(x: torch.Tensor, o: LoRAWeights) -> torch.Tensor:
    """One projection with its LoRA adapter, fused (:class:`LoRAOFunction`); used for attention's o_proj.

    Builds (and checks) a :class:`~fastft.kernels.lora_group.LoRAGroup` per call; code that calls it every step
    should hold the group instead.

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
    if x.dtype not in FLOAT_DTYPES:
        raise x_dtype_error("lora_o", x)
    (out,) = LoRAGroup("lora_o", ("o_proj",), (o,), "o")(x)
    return out


__all__ = ["LoRAOFunction", "lora_o"]
