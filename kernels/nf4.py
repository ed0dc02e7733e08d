"""NF4 dequantisation of a bitsandbytes 4-bit weight, and a frozen 4-bit linear layer built on it.

The layout is bitsandbytes 0.50's (``bitsandbytes.functional.quantize_4bit(..., quant_type="nf4")``, which is what
``Params4bit`` and transformers' ``load_in_4bit`` store). The weight ``W`` [out, in] is read flat, row-major, as
``n = out * in`` values:

- the packed tensor holds ``ceil(n / 2)`` bytes (shape ``[ceil(n / 2), 1]``; any shape with that many bytes is
  accepted, and a non-uint8 ``quant_storage`` is reinterpreted as bytes, as bitsandbytes does). Value ``2 i`` is the
  HIGH nibble of byte ``i`` and value ``2 i + 1`` the LOW nibble; when ``n`` is odd the last low nibble is padding.
  Rows are not byte-aligned: with an odd ``in`` a byte straddles two rows;
- value ``k`` belongs to block ``k // blocksize`` of the flat weight (blocks run across row ends; the last block
  may be short) and is ``NF4[code] * absmax[block]``, multiplied in fp32 and rounded once to the output dtype;
- NF4 is the fixed 16-entry table ``bitsandbytes.functional.get_4bit_type("nf4")``. bitsandbytes'
  ``dequantize_4bit`` never reads ``quant_state.code`` (its kernels carry their own copy of the table), and neither
  does this module;
- with double quantisation (``quant_state.nested``) ``absmax`` is uint8 and the fp32 scale of block ``b`` is
  ``(state2.code[absmax[b]] * state2.absmax[b // state2.blocksize]) + offset``: one fp32 product, rounded, then one
  fp32 add (never a fused multiply-add, which is why the Triton launch turns fp fusion off).

Both paths are bit-identical to ``bitsandbytes.functional.dequantize_4bit`` wherever that is right. It is not, in
0.50.2 on CPUs with AVX-512, for a weight whose ``in`` is a multiple of 16 but not of ``blocksize`` (``in=64`` with
``blocksize=128``, say): its vectorised CPU kernel indexes absmax per row, as if every row began a block, and scales
most values by the wrong block. There this module agrees with bitsandbytes' own pure-torch backend and its CUDA
kernels, which index the flat weight.

bitsandbytes 0.50's ``Linear4bit`` repacks its weight in place on CPUs with AVX512-BF16 the first time it runs in
eval mode on an input that does not require grad (``[out, in / 2]`` bytes interleaved in 32-row tiles, absmax
transposed to bf16, ``state2`` deleted, ``quant_state.packing_format_for_cpu = True``). That layout is refused here
with an error rather than read as garbage.

``nf4_linear`` computes ``x @ W.T (+ bias)`` with ``W`` dequantised straight into x's dtype (what bitsandbytes 0.50's
``gemm_4bit`` does), by torch's matmul; backward dequantises again for ``dX = dY @ W`` instead of saving the dense
weight. The packed weight is frozen and gets no gradient; a bias that requires grad gets its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import math_backward
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.errors import ShapeContractError

# The NF4 code table, value by value as bitsandbytes writes it (get_4bit_type("nf4"), then divided by its absolute
# maximum, 1.0, which changes nothing). These Python floats round to the same fp32 values.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Packed bytes per program: each byte gives two values, so a program writes 2 * _BLOCK_BYTES outputs. Large enough
# for wide loads on a GPU and few programs under the interpreter.
_BLOCK_BYTES = 1024

_code_tables: dict[torch.device, torch.Tensor] = {}


def _nf4_table(device: torch.device) -> torch.Tensor:
    # Cached per device: building it is a host-to-device copy that would otherwise run on every call.
    table = _code_tables.get(device)
    if table is None:
        table = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        _code_tables[device] = table
    return table


@triton.jit
def _nf4_dequantize_kernel(
    packed_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    n_bytes,
    n_elements,
    blocksize,
    blocksize2,
    NESTED: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    # int64: element indices are twice the byte indices, and an LM head passes 2**31 values.
    byte_idx = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    byte_mask = byte_idx < n_bytes
    packed = tl.load(packed_ptr + byte_idx, mask=byte_mask, other=0).to(tl.int32)
    high = packed >> 4
    low = packed & 0xF

    # blocksize is even, so both nibbles of a byte share one absmax block.
    block = (byte_idx * 2) // blocksize
    if NESTED:
        qabsmax = tl.load(absmax_ptr + block, mask=byte_mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + qabsmax, mask=byte_mask, other=0.0).to(tl.float32)
        scale2 = tl.load(absmax2_ptr + block // blocksize2, mask=byte_mask, other=0.0).to(tl.float32)
        offset = tl.load(offset_ptr).to(tl.float32)
        # bitsandbytes rounds the product to fp32 before adding the offset; the launch disables fp fusion so this
        # stays two roundings on a GPU as well.
        absmax = scale * scale2 + offset
    else:
        absmax = tl.load(absmax_ptr + block, mask=byte_mask, other=0.0).to(tl.float32)

    value_high = tl.load(code_ptr + high, mask=byte_mask, other=0.0) * absmax
    value_low = tl.load(code_ptr + low, mask=byte_mask, other=0.0) * absmax
    # Interleaving puts value 2i (high nibble) before 2i + 1 (low nibble), so the store is one contiguous run.
    values = tl.interleave(value_high, value_low)
    elem_idx = tl.program_id(0).to(tl.int64) * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    if OUT_BF16:
        # Round to nearest even by hand: triton 3.9's interpreter truncates fp32 -> bf16 casts, while GPUs and
        # bitsandbytes round to nearest even. Exact for finite values (a NaN scale, never written by bitsandbytes,
        # could come out as inf).
        bits = values.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        stored = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        stored = values.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + elem_idx, stored, mask=elem_idx < n_elements)


@dataclass(frozen=True)
class _Resolved:
    """What a dequantisation needs, read from the packed tensor and its QuantState and checked."""

    bytes: torch.Tensor
    quant_state: Any
    out_features: int
    in_features: int
    dtype: torch.dtype
    nested: bool


def _shape(tensor: Any) -> list[int] | str:
    return list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__


def _resolve(function: str, packed: torch.Tensor, quant_state: Any, dtype: torch.dtype | None) -> _Resolved:
    if quant_state is None:
        quant_state = getattr(packed, "quant_state", None)
    if quant_state is None:
        raise ShapeContractError(
            f"{function}: expected a packed 4-bit weight ([out*in/2, 1] bytes) with its bitsandbytes quant_state, "
            f"got a {packed.dtype} tensor of shape {list(packed.shape)} with no quant_state. A Params4bit carries it "
            "as .quant_state, and rebuilding the parameter (p.data, p.detach(), torch.nn.Parameter(p.data), "
            "DataParallel replication) drops it; pass quant_state= explicitly (the original module's "
            "weight.quant_state) or keep the original Params4bit. The packed bytes cannot be used as a weight."
        )
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ShapeContractError(
            f"{function}: expected bitsandbytes' standard packed layout ([out*in/2, 1] bytes, flat blocks), got a "
            f"weight of shape {list(packed.shape)} in bitsandbytes' AVX512-BF16 CPU inference layout "
            "(quant_state.packing_format_for_cpu is True: Linear4bit repacks in place on its first eval-mode forward "
            "of an input that does not require grad). Undo it with "
            "bitsandbytes.functional._convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state), or "
            "keep the layer in train mode, before using the weight here."
        )
    quant_type = getattr(quant_state, "quant_type", None)
    if quant_type != "nf4":
        raise ShapeContractError(
            f"{function}: expected an NF4 weight (quant_state.quant_type 'nf4'), got quant_type {quant_type!r} for a "
            f"weight of shape {list(packed.shape)}. Only NF4 is supported (FP4 is not); quantise the model with "
            "bnb_4bit_quant_type='nf4'."
        )

    shape = tuple(getattr(quant_state, "shape", None) or ())
    if len(shape) != 2:
        raise ShapeContractError(
            f"{function}: expected quant_state.shape to be the 2-D weight shape [out, in], got {list(shape)}; this "
            "kernel dequantises linear weights only."
        )
    out_features, in_features = int(shape[0]), int(shape[1])
    n_elements = out_features * in_features

    blocksize = getattr(quant_state, "blocksize", None)
    if not isinstance(blocksize, int) or blocksize < 2 or blocksize % 2:
        raise ShapeContractError(
            f"{function}: expected quant_state.blocksize to be a positive even int (bitsandbytes uses 32 ... 4096), "
            f"got {blocksize!r} for a weight of shape {list(shape)}."
        )

    if dtype is None:
        dtype = getattr(quant_state, "dtype", None)
    if dtype not in _OUTPUT_DTYPES:
        raise TypeError(
            f"{function}: the dequantised weight's dtype must be float32, float16 or bfloat16, got {dtype}; pass "
            "dtype= (quant_state.dtype is the default)."
        )

    packed_bytes = packed.detach()
    if packed_bytes.dtype != torch.uint8:
        # quant_storage other than uint8 (bf16 storage for FSDP, say) holds the same bytes.
        packed_bytes = packed_bytes.contiguous().view(torch.uint8)
    packed_bytes = packed_bytes.reshape(-1)
    expected_bytes = (n_elements + 1) // 2
    if packed_bytes.numel() != expected_bytes:
        raise ShapeContractError(
            f"{function}: quant_state.shape {list(shape)} needs {expected_bytes} packed bytes (out*in/2, shape "
            f"[{expected_bytes}, 1]), got a {packed.dtype} tensor of shape {list(packed.shape)} "
            f"({packed_bytes.numel()} bytes); pass the packed weight together with its own quant_state."
        )

    absmax = getattr(quant_state, "absmax", None)
    n_blocks = -(-n_elements // blocksize)
    if not isinstance(absmax, torch.Tensor) or absmax.numel() != n_blocks:
        raise ShapeContractError(
            f"{function}: quant_state.absmax must hold one scale per block of {blocksize} values, expected "
            f"[{n_blocks}] for shape {list(shape)}, got {_shape(absmax)}; the quant_state does not belong to this "
            "weight."
        )

    state2 = getattr(quant_state, "state2", None)
    nested = bool(getattr(quant_state, "nested", False)) or state2 is not None
    if nested:
        offset = getattr(quant_state, "offset", None)
        absmax2 = getattr(state2, "absmax", None)
        code2 = getattr(state2, "code", None)
        blocksize2 = getattr(state2, "blocksize", None)
        if offset is None or absmax2 is None or code2 is None or not isinstance(blocksize2, int) or blocksize2 < 1:
            raise ShapeContractError(
                f"{function}: a double-quantised (nested) quant_state needs offset and state2 with absmax, code and "
                f"blocksize; for shape {list(shape)} got offset {_shape(offset)}, state2 {type(state2).__name__}. "
                "Pass the quant_state bitsandbytes built for this weight."
            )
        n_blocks2 = -(-n_blocks // blocksize2)
        if absmax.dtype != torch.uint8 or absmax2.numel() != n_blocks2 or code2.numel() != 256:
            raise ShapeContractError(
                f"{function}: a nested quant_state needs uint8 absmax [{n_blocks}], state2.absmax [{n_blocks2}] and "
                f"a 256-entry state2.code for shape {list(shape)}, got absmax {absmax.dtype} {list(absmax.shape)}, "
                f"state2.absmax {_shape(absmax2)}, state2.code {_shape(code2)}."
            )
    return _Resolved(packed_bytes, quant_state, out_features, in_features, dtype, nested)


def _offset_tensor(offset: Any, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([float(offset)], dtype=torch.float32, device=device)


def _block_absmax_reference(resolved: _Resolved) -> torch.Tensor:
    """The fp32 scale of every block, undoing double quantisation the way bitsandbytes does."""
    qs = resolved.quant_state
    if not resolved.nested:
        return qs.absmax.reshape(-1).float()
    state2 = qs.state2
    qabsmax = qs.absmax.reshape(-1)
    scale2 = state2.absmax.reshape(-1).float().repeat_interleave(state2.blocksize)[: qabsmax.numel()]
    # Product first, rounded to fp32, then the offset: bitsandbytes' dequantize_blockwise followed by "+= offset".
    absmax = state2.code.float()[qabsmax.long()] * scale2
    return absmax + _offset_tensor(qs.offset, absmax.device)


def _dequantize_reference(resolved: _Resolved, out: torch.Tensor | None = None) -> torch.Tensor:
    qs = resolved.quant_state
    n_elements = resolved.out_features * resolved.in_features
    packed = resolved.bytes
    codes = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1)[:n_elements].long()
    scales = _block_absmax_reference(resolved).repeat_interleave(qs.blocksize)[:n_elements]
    values = _nf4_table(packed.device)[codes] * scales
    dense = values.to(resolved.dtype).reshape(resolved.out_features, resolved.in_features)
    return dense if out is None else out.copy_(dense)


def _dequantize_triton(resolved: _Resolved, out: torch.Tensor | None = None) -> torch.Tensor:
    qs = resolved.quant_state
    device = resolved.bytes.device
    if out is None:
        out = dispatch.empty((resolved.out_features, resolved.in_features), dtype=resolved.dtype, device=device)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    packed = resolved.bytes.contiguous()
    if resolved.nested:
        absmax = qs.absmax.reshape(-1).contiguous()
        absmax2 = qs.state2.absmax.reshape(-1).to(torch.float32).contiguous()
        code2 = qs.state2.code.reshape(-1).to(torch.float32).contiguous()
        offset = _offset_tensor(qs.offset, device)
        blocksize2 = int(qs.state2.blocksize)
    else:
        absmax = qs.absmax.reshape(-1).to(torch.float32).contiguous()
        # Unused slots still need pointers; the NESTED constexpr keeps them from being read.
        absmax2 = code2 = offset = absmax
        blocksize2 = 1
    n_bytes = packed.numel()
    grid = (triton.cdiv(n_bytes, _BLOCK_BYTES),)
    _nf4_dequantize_kernel[grid](
        packed,
        absmax,
        _nf4_table(device),
        out,
        absmax2,
        code2,
        offset,
        n_bytes,
        n_elements,
        int(qs.blocksize),
        blocksize2,
        NESTED=resolved.nested,
        OUT_BF16=resolved.dtype == torch.bfloat16,
        BLOCK_BYTES=_BLOCK_BYTES,
        # 4 warps spill 8 bytes on sm_80 (fp16 / fp32 outputs); 8 do not (python -m fastft.kernels.compile_check).
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


def _check_out(out: torch.Tensor, resolved: _Resolved) -> None:
    expected = (resolved.out_features, resolved.in_features)
    if tuple(out.shape) != expected or out.dtype != resolved.dtype or not out.is_contiguous():
        raise ShapeContractError(
            f"dequantize_nf4: out= must be a contiguous {resolved.dtype} tensor of the weight's shape "
            f"{list(expected)}, "
            f"got a {'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} tensor of shape {list(out.shape)}; "
            "pass a row slice of a contiguous buffer, or out=None."
        )
    if out.device != resolved.bytes.device:
        raise ValueError(
            f"dequantize_nf4: out= is on {out.device} but the packed weight is on {resolved.bytes.device}; "
            "allocate the buffer on the weight's device."
        )


def dequantize_nf4(
    packed: torch.Tensor,
    quant_state: Any = None,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise a bitsandbytes NF4 weight to its dense ``[out, in]`` matrix.

    Runs the Triton kernel where :func:`fastft.kernels.dispatch.use_triton` says so, else the torch reference; both
    give bit-identical results (see the module docstring for the layout and arithmetic).

    Args:
        packed: The packed weight: a ``Params4bit`` or its bytes, ``[ceil(out*in/2), 1]`` uint8 (or any shape with
            that many bytes, in any ``quant_storage`` dtype).
        quant_state: A bitsandbytes ``QuantState`` or any object with its attributes (``absmax``, ``shape``,
            ``blocksize``, ``dtype``, ``quant_type``, ``nested``, ``offset``, ``state2``). None: ``packed.quant_state``.
        dtype: The output dtype (float32, float16 or bfloat16); None: ``quant_state.dtype``. The fp32 value is
            rounded once to it.
        out: Optional contiguous ``[out, in]`` tensor of ``dtype`` to write into (a row slice of a reused
            buffer, say) instead of allocating.

    Returns:
        The dense weight, ``[out, in]`` in ``dtype``, on packed's device (``out`` itself when given). It never
        requires grad.

    Raises:
        ShapeContractError: No quant_state (a rebuilt parameter lost it), a packed byte count other than
            ``ceil(out*in/2)``, absmax / state2 sizes that do not fit the shape, a quant_type other than NF4,
            bitsandbytes' repacked CPU inference layout, or an ``out`` of the wrong shape, dtype or layout.
        TypeError: An output dtype other than float32, float16 or bfloat16.
    """
    if out is not None and dtype is None:
        dtype = out.dtype
    resolved = _resolve("dequantize_nf4", packed, quant_state, dtype)
    if out is not None:
        _check_out(out, resolved)
    if dispatch.use_triton(resolved.bytes):
        return _dequantize_triton(resolved, out)
    return _dequantize_reference(resolved, out)


def dequantize_nf4_reference(
    packed: torch.Tensor, quant_state: Any = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Plain-torch :func:`dequantize_nf4`: the same arguments, checks and bit-identical result, on any device."""
    return _dequantize_reference(_resolve("dequantize_nf4_reference", packed, quant_state, dtype))


def _check_linear(function: str, x: torch.Tensor, resolved: _Resolved, bias: torch.Tensor | None) -> None:
    if x.dim() == 0 or x.shape[-1] != resolved.in_features:
        raise ShapeContractError(
            f"{function}: x must be [..., in_features] = [..., {resolved.in_features}] for a 4-bit weight of shape "
            f"[{resolved.out_features}, {resolved.in_features}], got x of shape {list(x.shape)}; pass the "
            "activations this projection reads (its last dim is the weight's in_features)."
        )
    if bias is not None and tuple(bias.shape) != (resolved.out_features,):
        raise ShapeContractError(
            f"{function}: bias must be [out_features] = [{resolved.out_features}] for a 4-bit weight of shape "
            f"[{resolved.out_features}, {resolved.in_features}], got bias of shape {list(bias.shape)}."
        )


def _linear_weight_dtype(function: str, x: torch.Tensor) -> torch.dtype:
    if x.dtype not in _OUTPUT_DTYPES:
        raise TypeError(f"{function}: x must be float32, float16 or bfloat16, got {x.dtype}; cast the activations.")
    return x.dtype


def nf4_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, quant_state: Any = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch :func:`nf4_linear`, differentiable by autograd (through x and bias; the weight is frozen)."""
    dtype = _linear_weight_dtype("nf4_linear_reference", x)
    resolved = _resolve("nf4_linear_reference", packed, quant_state, dtype)
    _check_linear("nf4_linear_reference", x, resolved, bias)
    weight = _dequantize_reference(resolved)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


class NF4LinearFunction(torch.autograd.Function):
    """``x @ W.T + bias`` for a frozen NF4 weight ``W`` that is dequantised in forward and again in backward.

    Nothing dense of the weight's size is saved: backward keeps the packed bytes and the quant_state only. The
    packed weight gets no gradient; ``x`` gets ``dY @ W`` and a bias that requires grad gets ``dY`` summed over the
    tokens (accumulated in fp32).
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, packed: torch.Tensor, quant_state: Any, bias: torch.Tensor | None
    ) -> torch.Tensor:
        dtype = _linear_weight_dtype("nf4_linear", x)
        resolved = _resolve("nf4_linear", packed, quant_state, dtype)
        _check_linear("nf4_linear", x, resolved, bias)
        weight = dequantize_nf4(packed, resolved.quant_state, dtype=dtype)
        out = F.linear(x, weight, None if bias is None else bias.to(x.dtype))
        ctx.quant_state = resolved.quant_state
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(packed)
        return out

    @staticmethod
    @math_backward
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, torch.Tensor | None]:
        (packed,) = ctx.saved_tensors
        needs_x, needs_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        grad_x = grad_bias = None
        if needs_x:
            weight = dequantize_nf4(packed, ctx.quant_state, dtype=grad_out.dtype)
            grad_x = torch.matmul(grad_out, weight)
        if needs_bias:
            # fp32 accumulation: a long fp16 sum of gradients loses the small ones.
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias


def nf4_linear(
    x: torch.Tensor, packed: torch.Tensor, quant_state: Any = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a frozen bitsandbytes NF4 weight, dequantised on the fly (:class:`NF4LinearFunction`).

    ``W`` is dequantised straight into x's dtype (one rounding of the fp32 value), in forward and again in
    backward, so the dense weight lives only for the duration of each matmul.

    Args:
        x: Activations ``[..., in_features]`` (float32, float16 or bfloat16).
        packed: The packed NF4 weight (a ``Params4bit`` or its bytes), see :func:`dequantize_nf4`.
        quant_state: Its QuantState; None: ``packed.quant_state``.
        bias: Optional ``[out_features]`` bias, added in x's dtype; it gets a gradient if it requires one.

    Returns:
        ``[..., out_features]`` in x's dtype.

    Raises:
        ShapeContractError: x's last dim is not the weight's in_features, a bias of the wrong shape, or any of
            :func:`dequantize_nf4`'s errors.
        TypeError: x is not float32, float16 or bfloat16.
    """
    return NF4LinearFunction.apply(x, packed, quant_state, bias)


__all__ = [
    "NF4LinearFunction",
    "NF4_CODE",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "nf4_linear",
    "nf4_linear_reference",
]
