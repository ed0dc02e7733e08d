"""What the fused LoRA Functions share: the weights of one projection, and the grouped forward and backward math.

For a frozen base weight ``W [out, in]``, an optional frozen base bias ``b [out]`` (Qwen2's q / k / v), LoRA
``A [r, in]``, ``B [out, r]`` and scale ``s``:

    Y  = X Wᵀ + b + s (X Aᵀ) Bᵀ
    dX = dY W + s (dY B) A
    dA = s (dY B)ᵀ X
    dB = s dYᵀ (X Aᵀ)

No gradient depends on ``b``, so the bias is added in forward's GEMM epilogue and backward never reads it.

A group is one to three projections of the same ``X`` (q, k, v; gate, up; o; down). Forward runs one small GEMM for
every segment's ``X Aᵀ`` at once (the A's stacked), then the base GEMM with the LoRA term, on torch's matmul (cuBLAS)
or the fused Triton kernel of :mod:`fastft.kernels.lora_gemm`, whichever :mod:`fastft.kernels.gemm_tuner` picks for
the device and shape. Backward adds
every segment's ``dY W`` into one ``dX`` buffer (``addmm_``), then the low-rank part of all segments in one more
``addmm_`` against the stacked A's. Only ``X`` and the small ``X Aᵀ`` are kept for backward, never ``Y``.

An NF4 base (bitsandbytes ``Params4bit``) is dequantised, for forward and again for backward, into one buffer per
device and dtype that every layer reuses: the segments' rows side by side, so the dense weights cost one layer's
q | k | v (or gate | up) at a time instead of a copy per layer. Kernels on one CUDA stream run in order, so the
next layer's dequantisation cannot overwrite a buffer a GEMM is still reading. The Triton forward can also decode
the NF4 tiles inside the GEMM (:mod:`fastft.kernels.lora_gemm_nf4`): one more candidate for the tuner, or forced with
``FASTFT_NF4_DEQUANT=kernel``; backward always uses the buffer (its ``dY W`` runs in torch's matmul).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastft.kernels import gemm_tuner, targets
from fastft.kernels.compiled import usage
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.gemm_tuner import NF4_DEQUANT_ENV, Candidate
from fastft.kernels.lora_gemm import last_kernel, lora_gemm_reference, lora_gemm_triton
from fastft.kernels.lora_gemm_nf4 import lora_gemm_nf4_triton
from fastft.kernels.nf4 import dequantize_nf4

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def check_group(
    function: str,
    names: Sequence[str],
    x: torch.Tensor,
    projections: Sequence[LoRAWeights],
    x_name: str = "x",
) -> None:
    """Check every projection against x before any matmul: dtypes, ``[out, in]``, the bias ``[out]``, ``A [r, in]``,
    ``B [out, r]``, and that neither the base weight nor the bias wants a gradient.

    ``x_name`` is what the message calls the input (``"H = silu(gate) * up"`` for down_proj, say)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{function}: x must be float32, float16 or bfloat16, got {x.dtype}; cast the activations.")
    for name, projection in zip(names, projections, strict=True):
        where = f"{function}: {name}"
        try:
            out_features, in_features = weight_shape(projection)
        except ShapeContractError as error:
            raise ShapeContractError(f"{where}: {error}") from None
        if x.shape[-1] != in_features:
            # A stand-in input (meta) only knows its last dim.
            actual = list(x.shape) if not x.is_meta else f"[..., {x.shape[-1]}]"
            raise ShapeContractError(
                f"{where}: {x_name} must be [..., in_features] = [..., {in_features}] for a base weight of shape "
                f"[{out_features}, {in_features}], got {x_name} of shape {actual}; pass the activations "
                "this projection reads."
            )
        if not is_packed(projection) and projection.weight.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{where}: the base weight must be float32 / float16 / bfloat16 or a packed NF4 Params4bit, got "
                f"{projection.weight.dtype}."
            )
        if projection.weight.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{where}: the base weight requires grad, but the fused LoRA kernels treat base weights as frozen and "
                "would give it no gradient; freeze it (weight.requires_grad_(False)) for LoRA, or run the module's "
                "own forward to train it."
            )
        _check_bias(where, projection.bias, out_features, in_features)
        a, b = projection.lora_a, projection.lora_b
        if (a is None) != (b is None):
            raise ValueError(f"{where}: pass both lora_a and lora_b, or neither (got only one).")
        if a is None:
            continue
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
    if bias.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{where}: the bias must be float32 / float16 / bfloat16, got {bias.dtype}.")
    if bias.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{where}: the bias requires grad, but the fused LoRA kernels treat the base bias as frozen and would give "
            "it no gradient; freeze it (bias.requires_grad_(False)) for LoRA, or run the module's own forward to "
            "train it."
        )


_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _shared_buffer(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
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


def dense_weights(projections: Sequence[LoRAWeights], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every segment's base weight as a dense contiguous ``[out, in]`` in ``dtype``.

    Dense weights of that dtype are used as they are; packed NF4 weights are dequantised into the shared buffer
    (all of the group's rows side by side); dense weights of another dtype are cast (what autocast would do).
    """
    shapes = [weight_shape(p) for p in projections]
    packed_rows = sum(shape[0] * shape[1] for p, shape in zip(projections, shapes, strict=True) if is_packed(p))
    buffer = None
    if packed_rows:
        device = projections[0].weight.device
        buffer = _shared_buffer(packed_rows, device, dtype)
    dense, start = [], 0
    for projection, (out_features, in_features) in zip(projections, shapes, strict=True):
        weight = projection.weight
        if is_packed(projection):
            size = out_features * in_features
            target = buffer[start : start + size].view(out_features, in_features)
            start += size
            dense.append(dequantize_nf4(weight, quant_state_of(projection), dtype=dtype, out=target))
        else:
            dense.append(weight.detach().to(dtype).contiguous())
    return dense


def _stacked_a(projections: Sequence[LoRAWeights], dtype: torch.dtype) -> torch.Tensor | None:
    parts = [p.lora_a.detach().to(dtype) for p in projections if p.lora_a is not None]
    if not parts:
        return None
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)


def nf4_dequant_mode() -> str:
    """How a forced Triton forward decodes NF4 bases: ``"buffer"`` (default: once per call into the reused buffer,
    then the 16-bit kernel) or ``"kernel"`` (inside the GEMM's K loop), from ``FASTFT_NF4_DEQUANT``. Under the tuner
    (``FASTFT_GEMM=auto`` on a GPU) an unset variable lets both compete."""
    return gemm_tuner.nf4_decode() or "buffer"


def group_forward(
    x2d: torch.Tensor, projections: Sequence[LoRAWeights], group: str
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Forward of one group: ``(outputs, xa)`` with one ``[M, out_i]`` output per segment and ``xa = X [A_0; A_1; …]ᵀ``
    (None when no segment has LoRA). Everything is computed in x's dtype; a segment's bias, cast to it, is added in
    the GEMM's epilogue.

    The base GEMM runs where :func:`fastft.kernels.gemm_tuner.choose` says for this ``group`` (``"qkv"``, ``"o"``,
    ``"gate_up"``, ``"down"``): torch's matmul (cuBLAS) with the LoRA term added in place, or the fused Triton kernel.
    """
    dtype = x2d.dtype
    stacked = _stacked_a(projections, dtype)
    xa = None if stacked is None else torch.mm(x2d, stacked.t())
    lora_b = [None if p.lora_b is None else p.lora_b.detach().to(dtype).contiguous() for p in projections]
    scales = [float(p.scale) for p in projections]
    biases = None
    if any(p.bias is not None for p in projections):
        biases = [None if p.bias is None else p.bias.detach().to(dtype).contiguous() for p in projections]
    packed = all(is_packed(p) for p in projections)

    def run(candidate: Candidate) -> list[torch.Tensor]:
        if candidate.path == "triton-nf4":
            packed_weights = [p.weight for p in projections]
            states = [quant_state_of(p) for p in projections]
            return lora_gemm_nf4_triton(x2d, packed_weights, states, xa, lora_b, scales, candidate.config, biases)
        weights = dense_weights(projections, dtype)
        if candidate.path == "triton":
            return lora_gemm_triton(x2d, weights, xa, lora_b, scales, candidate.config, biases)
        return lora_gemm_reference(x2d, weights, xa, lora_b, scales, biases)

    def check(candidate: Candidate) -> list[str]:
        if candidate.path == "cublas":
            return []
        capability = targets.capability(x2d.device)
        return usage(last_kernel(), capability, has_dot=True, sixteen_bit=dtype != torch.float32).problems

    widths = [weight_shape(p)[0] for p in projections]
    ranks = [0 if p.lora_a is None else p.lora_a.shape[0] for p in projections]
    choice = gemm_tuner.choose(group, x2d, widths, ranks, packed, run, check)
    return run(choice.candidate), xa


def group_backward(
    x2d: torch.Tensor,
    xa: torch.Tensor | None,
    projections: Sequence[LoRAWeights],
    grads: Sequence[torch.Tensor | None],
    needs_x: bool,
    needs_lora: Sequence[bool],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Backward of one group: ``(dX, [dA_i], [dB_i])``, every LoRA gradient in its parameter's dtype.

    ``grads`` holds ``dY_i`` ([M, out_i], x's dtype) or None for an output that got no gradient. ``dX`` gathers
    every segment's ``dY_i W_i`` and ``s_i (dY_i B_i) A_i`` in one buffer; it is None when not needed.
    """
    dtype = x2d.dtype
    grads = [None if g is None else g.reshape(-1, g.shape[-1]).to(dtype) for g in grads]
    grad_x = None
    if needs_x:
        weights = dense_weights([p for p, g in zip(projections, grads, strict=True) if g is not None], dtype)
        live = [g for g in grads if g is not None]
        for grad, weight in zip(live, weights, strict=True):
            grad_x = torch.mm(grad, weight) if grad_x is None else grad_x.addmm_(grad, weight)
        if grad_x is None:
            grad_x = torch.zeros_like(x2d)

    grad_a: list[torch.Tensor | None] = []
    grad_b: list[torch.Tensor | None] = []
    scaled_dyb, stacked_a = [], []
    start = 0
    for projection, grad, wants in zip(projections, grads, needs_lora, strict=True):
        a, b = projection.lora_a, projection.lora_b
        if a is None:
            grad_a.append(None)
            grad_b.append(None)
            continue
        rank = a.shape[0]
        xa_i = xa[:, start : start + rank]
        start += rank
        if grad is None:
            grad_a.append(torch.zeros_like(a) if wants else None)
            grad_b.append(torch.zeros_like(b) if wants else None)
            continue
        scale = float(projection.scale)
        # s (dY B): the factor that both dA and the low-rank part of dX need.
        dyb = torch.mm(grad, b.detach().to(dtype)).mul_(scale)
        grad_a.append(torch.mm(dyb.t(), x2d).to(a.dtype) if wants else None)
        grad_b.append(torch.mm(grad.t(), xa_i).mul_(scale).to(b.dtype) if wants else None)
        if needs_x:
            scaled_dyb.append(dyb)
            stacked_a.append(a.detach().to(dtype))
    if needs_x and scaled_dyb:
        dyb_all = scaled_dyb[0] if len(scaled_dyb) == 1 else torch.cat(scaled_dyb, dim=1)
        a_all = stacked_a[0] if len(stacked_a) == 1 else torch.cat(stacked_a, dim=0)
        grad_x.addmm_(dyb_all, a_all)
    return grad_x, grad_a, grad_b


def save_group(ctx: Any, x: torch.Tensor, x2d: torch.Tensor, xa: torch.Tensor | None, projections) -> None:
    """Keep what :func:`load_group` needs: X (as [M, K]), the small X Aᵀ, and references to the weights. Not the
    biases: no gradient depends on them."""
    ctx.x_shape = x.shape
    ctx.count = len(projections)
    ctx.scales = [float(p.scale) for p in projections]
    # Kept beside the saved tensors: a saved-tensor hook (offloading, say) may hand back a plain tensor without it.
    ctx.quant_states = [quant_state_of(p) for p in projections]
    ctx.save_for_backward(
        x2d, xa, *[p.weight for p in projections], *[p.lora_a for p in projections], *[p.lora_b for p in projections]
    )


def load_group(ctx: Any) -> tuple[torch.Tensor, torch.Tensor | None, list[LoRAWeights]]:
    """``(x2d, xa, projections)`` as :func:`save_group` kept them (without their biases, which backward never reads)."""
    saved = ctx.saved_tensors
    x2d, xa, rest = saved[0], saved[1], saved[2:]
    n = ctx.count
    projections = [
        LoRAWeights(rest[i], rest[n + i], rest[2 * n + i], ctx.scales[i], ctx.quant_states[i]) for i in range(n)
    ]
    return x2d, xa, projections


def function_inputs(projections: Sequence[LoRAWeights]) -> list[Any]:
    """The Function's tensor arguments after x: every weight, then every A, then every B (None where absent)."""
    return [
        *[p.weight for p in projections],
        *[p.lora_a for p in projections],
        *[p.lora_b for p in projections],
    ]


def rebuild(projections: Sequence[LoRAWeights], tensors: Sequence[Any]) -> list[LoRAWeights]:
    """The projections again from a Function's arguments (the same tensors, as autograd passed them in); each bias,
    not an autograd input, is taken from its projection."""
    n = len(projections)
    return [
        LoRAWeights(tensors[i], tensors[n + i], tensors[2 * n + i], p.scale, quant_state_of(p), p.bias)
        for i, p in enumerate(projections)
    ]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """x's dtype, or the autocast dtype when autocast is on for x's device (what F.linear would compute in)."""
    device_type = x.device.type
    # meta tensors (the static compile check) have no autocast.
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for x's device while a Function runs in the dtype :func:`compute_dtype` chose."""
    if not torch.amp.is_autocast_available(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


__all__ = [
    "LoRAWeights",
    "autocast_off",
    "check_group",
    "compute_dtype",
    "dense_weights",
    "function_inputs",
    "group_backward",
    "group_forward",
    "is_packed",
    "load_group",
    "NF4_DEQUANT_ENV",
    "nf4_dequant_mode",
    "quant_state_of",
    "rebuild",
    "release_buffers",
    "save_group",
    "weight_shape",
]
