"""What the fused LoRA kernels share: the weights of one projection, their checks, and the NF4 dequantisation buffer.

For a frozen base weight ``W [out, in]``, an optional frozen base bias ``b [out]`` (Qwen2's q / k / v), LoRA
``A [r, in]``, ``B [out, r]`` and scale ``s``:

    Y  = X Wᵀ + b + s (X Aᵀ) Bᵀ
    dX = dY W + s (dY B) A
    dA = s (dY B)ᵀ X
    dB = s dYᵀ (X Aᵀ)

No gradient depends on ``b``, so the bias is added in forward's GEMM epilogue and backward never reads it.

A group is one to three projections of the same ``X`` (q, k, v; gate, up; o; down): :class:`LoRAWeights` describes
one, :func:`check_projection` validates it once (when a :class:`~fastft.kernels.lora_group.LoRAGroup` is built), and
:func:`x_shape_error` / :func:`frozen_error` are the per-call checks of what only the call knows (x, grad mode). The
math lives in :mod:`fastft.kernels.lora_math`.

An NF4 base (bitsandbytes ``Params4bit``) is dequantised, for forward and again for backward, into one buffer per
device and dtype that every layer reuses (:func:`shared_buffer`): the segments' rows side by side, so the dense
weights cost one layer's q | k | v (or gate | up) at a time instead of a copy per layer. Kernels on one CUDA stream
run in order, so the next layer's dequantisation cannot overwrite a buffer a GEMM is still reading.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastft.kernels import gemm_tuner
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.gemm_tuner import NF4_DEQUANT_ENV

# The activation, weight and bias dtypes the fused kernels take.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LoRAWeights:
    """One projection for the fused LoRA Functions.

    Attributes:
        weight: The frozen base weight: dense ``[out, in]`` (fp32 / fp16 / bf16), or a bitsandbytes NF4
            ``Params4bit`` (packed bytes) whose ``quant_state`` (or ``quant_state=``) describes ``[out, in]``.
        lora_a: LoRA A ``[r, in]``, or None for a projection without an adapter.
        lora_b: LoRA B ``[out, r]``, or None (together with ``lora_a``).
        scale: The LoRA scale (``lora_alpha / r``, or peft's ``scaling[adapter]``).
        quant_state: The NF4 quant_state; None reads ``weight.quant_state`` for a uint8 weight.
        bias: The frozen base bias ``[out]`` (fp32 / fp16 / bf16), or None. Like the base weight it gets no gradient:
            it is not an autograd input of the fused Functions.
    """

    weight: torch.Tensor
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    scale: float = 1.0
    quant_state: Any = None
    bias: torch.Tensor | None = None


def quant_state_of(projection: LoRAWeights) -> Any:
    """The NF4 quant_state of a packed base weight, or None for a dense one."""
    if projection.quant_state is not None:
        return projection.quant_state
    return getattr(projection.weight, "quant_state", None)


def is_packed(projection: LoRAWeights) -> bool:
    """Whether the base weight is packed 4-bit (bitsandbytes stores NF4 bytes as a uint8 [n, 1] tensor)."""
    return quant_state_of(projection) is not None or projection.weight.dtype == torch.uint8


def weight_shape(projection: LoRAWeights) -> tuple[int, int]:
    """The base weight's logical ``[out, in]``, read from the quant_state for a packed weight."""
    if is_packed(projection):
        state = quant_state_of(projection)
        shape = tuple(getattr(state, "shape", None) or ())
        if len(shape) != 2:
            raise ShapeContractError(
                f"fastft.kernels.lora: a packed 4-bit weight of shape {list(projection.weight.shape)} needs a "
                f"quant_state describing [out, in], got quant_state.shape {list(shape)}; pass the Params4bit with its "
                "quant_state."
            )
        return int(shape[0]), int(shape[1])
    return int(projection.weight.shape[0]), int(projection.weight.shape[1])


def projection_shape(where: str, projection: LoRAWeights) -> tuple[int, int]:
    """:func:`weight_shape`, its error prefixed with ``where`` (``"lora_qkv: q_proj"``)."""
    try:
        return weight_shape(projection)
    except ShapeContractError as error:
        raise ShapeContractError(f"{where}: {error}") from None


def x_shape_error(where: str, x: torch.Tensor, out_features: int, in_features: int, x_name: str = "x") -> Exception:
    """The error for an input whose last dim is not the projection's in_features."""
    # A stand-in input (meta) only knows its last dim.
    actual = list(x.shape) if not x.is_meta else f"[..., {x.shape[-1]}]"
    return ShapeContractError(
        f"{where}: {x_name} must be [..., in_features] = [..., {in_features}] for a base weight of shape "
        f"[{out_features}, {in_features}], got {x_name} of shape {actual}; pass the activations "
        "this projection reads."
    )


def x_dtype_error(function: str, x: torch.Tensor) -> Exception:
    """The error for activations of a dtype the fused kernels do not take."""
    return TypeError(f"{function}: x must be float32, float16 or bfloat16, got {x.dtype}; cast the activations.")


def frozen_error(where: str, projection: LoRAWeights) -> Exception | None:
    """The error for a base weight or bias that requires grad while autograd is on, or None when both are frozen
    (or autograd is off: inference needs no gradient, so there a trainable weight is fine)."""
    if not torch.is_grad_enabled():
        return None
    if projection.weight.requires_grad:
        return ValueError(
            f"{where}: the base weight requires grad, but the fused LoRA kernels treat base weights as frozen and "
            "would give it no gradient; freeze it (weight.requires_grad_(False)) for LoRA, or run the module's "
            "own forward to train it."
        )
    bias = projection.bias
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        return ValueError(
            f"{where}: the bias requires grad, but the fused LoRA kernels treat the base bias as frozen and would give "
            "it no gradient; freeze it (bias.requires_grad_(False)) for LoRA, or run the module's own forward to "
            "train it."
        )
    return None


def check_projection(where: str, projection: LoRAWeights) -> tuple[int, int]:
    """Every check of one projection that does not depend on x or on grad mode: the base weight's ``[out, in]`` and
    dtype, the bias ``[out]`` and dtype, ``A [r, in]``, ``B [out, r]`` and a finite scale.

    Returns:
        The base weight's ``(out_features, in_features)``.
    """
    out_features, in_features = projection_shape(where, projection)
    _check_weight_dtype(where, projection)
    _check_bias(where, projection.bias, out_features, in_features)
    _check_adapter(where, projection, out_features, in_features)
    return out_features, in_features


def _check_weight_dtype(where: str, projection: LoRAWeights) -> None:
    if not is_packed(projection) and projection.weight.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{where}: the base weight must be float32 / float16 / bfloat16 or a packed NF4 Params4bit, got "
            f"{projection.weight.dtype}."
        )


def _check_adapter(where: str, projection: LoRAWeights, out_features: int, in_features: int) -> None:
    a, b = projection.lora_a, projection.lora_b
    if (a is None) != (b is None):
        raise ValueError(f"{where}: pass both lora_a and lora_b, or neither (got only one).")
    if a is None:
        return
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or a.shape[1] != in_features:
        raise ShapeContractError(
            f"{where}: LoRA A must be [r, in] = [r, {in_features}] for a base weight of shape "
            f"[{out_features}, {in_features}], got {list(a.shape)}; the adapter was made for another model."
        )
    if tuple(b.shape) != (out_features, rank):
        raise ShapeContractError(
            f"{where}: LoRA B must be [out, r] = [{out_features}, {rank}] for a base weight of shape "
            f"[{out_features}, {in_features}] and A of shape {list(a.shape)}, got {list(b.shape)}; the adapter "
            "was made for another model."
        )
    if not math.isfinite(float(projection.scale)):
        raise ValueError(f"{where}: the LoRA scale must be finite, got {projection.scale!r}.")


def _check_bias(where: str, bias: Any, out_features: int, in_features: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{where}: the bias must be a tensor [out] or None, got {type(bias).__name__}.")
    if tuple(bias.shape) != (out_features,):
        raise ShapeContractError(
            f"{where}: the bias must be [out] = [{out_features}] for a base weight of shape "
            f"[{out_features}, {in_features}], got a bias of shape {list(bias.shape)}; pass the base layer's own bias."
        )
    if bias.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: the bias must be float32 / float16 / bfloat16, got {bias.dtype}.")


_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def shared_buffer(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of the dequantisation buffer for ``device`` and ``dtype``, grown (never shrunk) on demand."""
    key = (device, dtype)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # Drop the old one first, so the peak is the new size, not old + new.
        _buffers.pop(key, None)
        buffer = torch.empty(numel, device=device, dtype=dtype)
        _buffers[key] = buffer
    return buffer[:numel]


def release_buffers() -> None:
    """Free the reused dequantisation buffers (they come back, sized to the largest group, on the next 4-bit call)."""
    _buffers.clear()


def nf4_dequant_mode() -> str:
    """How a forced Triton forward decodes NF4 bases: ``"buffer"`` (default: once per call into the reused buffer,
    then the 16-bit kernel) or ``"kernel"`` (inside the GEMM's K loop), from ``FASTFT_NF4_DEQUANT``. Under the tuner
    (``FASTFT_GEMM=auto`` on a GPU) an unset variable lets both compete."""
    return gemm_tuner.nf4_decode() or "buffer"


def function_inputs(projections: Sequence[LoRAWeights]) -> list[Any]:
    """The legacy argument list of :class:`~fastft.kernels.lora_mlp.LoRAMLPFunction` after x, the projections and
    the activation: every weight, then every A, then every B (None where absent)."""
    return [
        *[p.weight for p in projections],
        *[p.lora_a for p in projections],
        *[p.lora_b for p in projections],
    ]


# One flag read for "is autocast on anywhere" (about 0.1 µs against 0.9 for the per-device questions below); a torch
# without it asks those on every call.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when autocast is on for x's device, else None (the fast, common case)."""
    if not _any_autocast():
        return None
    device_type = x.device.type
    # meta tensors (the static compile check) have no autocast.
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for x's device while a Function runs in the dtype :func:`autocast_dtype` chose."""
    if not torch.amp.is_autocast_available(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


__all__ = [
    "FLOAT_DTYPES",
    "LoRAWeights",
    "NF4_DEQUANT_ENV",
    "autocast_dtype",
    "autocast_off",
    "check_projection",
    "frozen_error",
    "function_inputs",
    "is_packed",
    "nf4_dequant_mode",
    "projection_shape",
    "quant_state_of",
    "release_buffers",
    "shared_buffer",
    "weight_shape",
    "x_dtype_error",
    "x_shape_error",
]
