"""llama.cpp's K-quants Q4_K, Q5_K and Q6_K, written in numpy (the ``gguf`` package decodes them but cannot write them).

Each row is cut into super-blocks of ``QK_K = 256`` values, and every super-block is encoded on its own, in ggml's
byte layout (``block_q4_K`` ... in ggml-common.h):

- **Q4_K** (144 bytes, 4.5 bits per weight): fp16 ``d`` and ``dmin``, 12 bytes holding eight 6-bit scales and eight
  6-bit mins (one of each per sub-block of 32), 128 bytes of 4-bit quants. A value is ``d * sc * q - dmin * m``.
- **Q5_K** (176 bytes, 5.5 bits): as Q4_K, with a 32-byte plane of fifth bits between the scales and the low nibbles.
- **Q6_K** (210 bytes, 6.5625 bits): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen int8 scales (one
  per sub-block of 16) and an fp16 ``d``. A value is ``d * sc * (q - 32)``.

The scales follow the choice llama.cpp's reference quantiser makes when it is given no importance matrix (what
``llama-quantize`` does without ``--imatrix``): for Q4_K / Q5_K, per sub-block, a weighted least-squares fit of scale
and min over a range of trial inverse scales, keeping the one of least weighted squared error (weights
``rms(x) + |x|``); for Q6_K, a symmetric fit with weights ``x²`` over 19 trial scales around ``-32 / max``. The
sub-block scales are then quantised to 6 (8) bits against the super-block's largest one, and every value is rounded
once more against the scale it will actually be decoded with.

Everything is vectorised over super-blocks: the trial scales are a loop of about twenty numpy passes over a chunk of
super-blocks, never a Python loop over blocks, and chunks run in parallel threads. Chunks of :data:`_CHUNK_BLOCKS`
super-blocks keep the temporaries in cache and bound the memory to a few MB per thread whatever the tensor's size.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fastft.contracts import ShapeContractError

QK_K = 256
# Bytes per super-block, as ggml's GGML_QUANT_SIZES has them.
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
K_TYPES = tuple(BLOCK_BYTES)
# 1024 super-blocks (256K values, 1 MB of float32) per pass: large enough that numpy's per-call cost vanishes, small
# enough that the few temporaries of a pass stay in cache.
_CHUNK_BLOCKS = 1024
# numpy releases the GIL inside its array operations, so chunks encode in parallel threads (as llama-quantize uses
# every core); at most 8, beyond which the Python between operations dominates.
_THREADS = max(1, min(8, os.cpu_count() or 1))
# ggml's GROUP_MAX_EPS: below this the Q6_K sub-block (and super-block) counts as all zero.
_GROUP_MAX_EPS = np.float32(1e-15)
_F32 = np.float32


def _round(values: np.ndarray) -> np.ndarray:
    # ggml's nearest_int rounds half to even (it adds 1.5 * 2^23 in float32), as np.rint does.
    return np.rint(values)


def _fit_scale_min(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Per column of ``x`` [32, S] (one sub-block per column): the scale, min and levels (0..nmax) that best fit
    ``x ≈ scale * L - min``.

    Mirrors llama.cpp's ``make_qkx2_quants`` (weights ``rms(x) + |x|``, squared error): start from the plain
    min / max grid, then for each trial inverse scale ``(nmax + rmin + rdelta * i) / (max - min)`` solve the
    weighted least squares for scale and offset (offset clamped to <= 0) and keep the one of least error. As there,
    ``min`` is the best offset so far: each trial's grid starts from the offset the previous winner found.
    Sub-blocks run along the columns: every sum is then a float32 sum of whole rows, accumulated in the order
    llama.cpp's loops accumulate, so that the same candidates win (a float64 fit ranks them differently where a
    large value makes the float32 sums cancel, and llama.cpp's choice is the one whose error it has measured).

    Returns:
        ``scale`` [S], ``min`` [S] (>= 0, subtracted on decode) and ``levels`` [32, S] (float32, integral).
    """
    weights = np.sqrt((x * x).sum(axis=0) / _F32(32)) + np.abs(x)
    low = np.minimum(x.min(axis=0), _F32(0))
    high = x.max(axis=0)
    flat = high == low
    high = np.where(flat, low + 1, high)
    sum_w = weights.sum(axis=0)
    sum_x = (weights * x).sum(axis=0)
    trial = np.empty_like(x)
    weighted = np.empty_like(x)
    product = np.empty_like(x)

    def grid(inverse: np.ndarray, offset: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.subtract(x, offset, out=out)
        np.multiply(out, inverse, out=out)
        np.rint(out, out=out)  # ggml's nearest_int rounds half to even, as rint does
        return np.clip(out, _F32(0), _F32(nmax), out=out)

    def error(levels: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
        np.multiply(levels, scale, out=product)
        np.add(product, offset, out=product)
        np.subtract(product, x, out=product)
        np.multiply(product, product, out=product)
        return np.multiply(product, weights, out=product).sum(axis=0)

    inverse = _F32(nmax) / (high - low)
    levels = grid(inverse, low, np.empty_like(x))
    scale = _F32(1) / inverse
    offset = low
    best = error(levels, scale, offset)
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            grid((_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / (high - offset), offset, trial)
            np.multiply(weights, trial, out=weighted)
            sum_l = weighted.sum(axis=0)
            sum_l2 = np.multiply(weighted, trial, out=product).sum(axis=0)
            sum_xl = np.multiply(weighted, x, out=product).sum(axis=0)
            det = sum_w * sum_l2 - sum_l * sum_l
            trial_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            trial_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
            # An offset above zero would add to every value: llama.cpp pins it at zero and refits the scale alone.
            positive = trial_offset > 0
            trial_offset = np.where(positive, _F32(0), trial_offset)
            trial_scale = np.where(positive, sum_xl / sum_l2, trial_scale)
            trial_error = error(trial, trial_scale, trial_offset)
            better = (det > 0) & (trial_error < best)
            if better.any():
                np.copyto(levels, trial, where=better)
                scale = np.where(better, trial_scale, scale)
                offset = np.where(better, trial_offset, offset)
                best = np.where(better, trial_error, best)
    # A constant sub-block (or an all-zero one) is its min alone: scale and levels zero, as llama.cpp writes it.
    scale = np.where(flat, _F32(0), scale)
    offset = np.where(flat, low, offset)
    levels[:, flat] = 0
    return scale, -offset, levels


def _fit_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per column of ``x`` [n, S]: the scale and levels (-nmax..nmax-1) that best fit ``x ≈ scale * L``.

    Mirrors llama.cpp's ``make_qx_quants`` with ``rmse_type = 1`` (weights ``x²``): the grid through the value of
    largest magnitude, then 18 trial inverse scales ``-(nmax ± 0.1 i) / max``, each with its least-squares scale,
    keeping the one that explains most of the weighted energy (``(Σwxl)² / Σwl²``).

    Returns:
        ``scale`` [S] (signed: it carries the sign of the largest value) and ``levels`` [n, S] (float32, integral).
    """
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=0)[None], axis=0)[0]
    zero = np.abs(peak) < _GROUP_MAX_EPS
    peak = np.where(zero, _F32(1), peak)
    weights = x * x
    weighted_x = weights * x
    trial = np.empty_like(x)
    product = np.empty_like(x)

    def fit(inverse: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(x, inverse, out=out)
        np.rint(out, out=out)
        np.clip(out, -nmax, nmax - 1, out=out)
        sum_lx = np.multiply(weighted_x, out, out=product).sum(axis=0)
        np.multiply(weights, out, out=product)
        sum_l2 = np.multiply(product, out, out=product).sum(axis=0)
        return sum_lx, sum_l2

    levels = np.empty_like(x)
    sum_lx, sum_l2 = fit(_F32(-nmax) / peak, levels)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sum_l2 > 0, sum_lx / sum_l2, _F32(0))
        best = scale * sum_lx
        for step in (*range(-9, 0), *range(1, 10)):
            trial_lx, trial_l2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(step)) / peak, trial)
            better = (trial_l2 > 0) & (trial_lx * trial_lx > best * trial_l2)
            if better.any():
                np.copyto(levels, trial, where=better)
                scale = np.where(better, trial_lx / trial_l2, scale)
                best = np.where(better, scale * trial_lx, best)
    scale = np.where(zero, _F32(0), scale)
    levels[:, zero] = 0
    return scale, levels


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` rounded to float16 (nearest even, as ggml's FP32_TO_FP16), and that rounding read back as float32."""
    half = values.astype(np.float16)
    return half, half.astype(np.float32)


def _pack_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins per super-block ([B, 8] each) as ggml's 12 bytes (get_scale_min_k4):
    bytes 0-3 / 4-7 hold sub-blocks 0-3's scale / min and, in their top two bits, the high bits of 4-7's; bytes
    8-11 hold 4-7's low nibbles, scale below min."""
    packed = np.empty((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    return packed


def _kx_blocks(blocks: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The shared part of Q4_K and Q5_K for super-blocks [B, 256]: fp16 d and dmin, the packed scales and mins, and
    the levels [B, 256] (0..nmax) rounded against the decoded scales."""
    count = blocks.shape[0]
    columns = np.ascontiguousarray(blocks.reshape(count * 8, 32).T)
    scale, low, levels = _fit_scale_min(columns, nmax, rmin, 0.1, nstep)
    scale, low, levels = scale.reshape(count, 8), low.reshape(count, 8), levels.T.reshape(count, 8, 32)
    max_scale = np.maximum(scale.max(axis=1), 0)
    max_min = np.maximum(low.max(axis=1), 0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    q_scale = np.clip(_round(inv_scale[:, None] * scale), 0, 63).astype(np.uint8)
    q_min = np.clip(_round(inv_min[:, None] * low), 0, 63).astype(np.uint8)
    d_half, d = _fp16(max_scale / _F32(63))
    dmin_half, dmin = _fp16(max_min / _F32(63))
    sub_d = d[:, None] * q_scale.astype(np.float32)
    sub_m = dmin[:, None] * q_min.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_round((blocks.reshape(count, 8, 32) + sub_m[..., None]) / sub_d[..., None]), 0, nmax)
    # A sub-block whose decoded scale is zero keeps the levels of its fit (they multiply zero), as llama.cpp's do.
    levels = np.where((sub_d != 0)[..., None], requant, levels).astype(np.uint8).reshape(count, QK_K)
    return d_half, dmin_half, _pack_scales_mins(q_scale, q_min), levels


def _nibbles_q4(levels: np.ndarray) -> np.ndarray:
    # Each 64 values: the first 32 in the low nibbles of 32 bytes, the next 32 in their high nibbles.
    quads = levels.reshape(-1, 4, 2, 32)
    return ((quads[:, :, 0] & 0xF) | ((quads[:, :, 1] & 0xF) << 4)).reshape(-1, 128)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _kx_blocks(blocks, 15, -1.0, 20)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales,
                           _nibbles_q4(levels)], axis=1)  # fmt: skip


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _kx_blocks(blocks, 31, -0.5, 15)
    # The fifth bits: value j + 64c (first half of chunk c) sets bit 2c of byte j, value j + 64c + 32 sets bit 2c+1.
    high = (levels >> 4).reshape(-1, 8, 32).astype(np.uint8)
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    plane = np.bitwise_or.reduce(high << shifts, axis=1).astype(np.uint8)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, plane,
                           _nibbles_q4(levels)], axis=1)  # fmt: skip


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    count = blocks.shape[0]
    sub = blocks.reshape(count, 16, 16)
    scale, levels = _fit_symmetric(np.ascontiguousarray(sub.reshape(count * 16, 16).T), 32)
    scale, levels = scale.reshape(count, 16), levels.T.reshape(count, 16, 16)
    # The sub-block scale of largest magnitude (the first of equals), with its sign: it maps to -128.
    pick = np.abs(scale).argmax(axis=1)
    max_scale = np.take_along_axis(scale, pick[:, None], axis=1)[:, 0]
    empty = np.abs(max_scale) < _GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        inverse = np.where(empty, _F32(0), _F32(-128) / np.where(empty, _F32(1), max_scale))
        d_half, d = _fp16(np.where(empty, _F32(0), _F32(1) / inverse))
    q_scale = np.minimum(_round(inverse[:, None] * scale), 127).astype(np.int8)
    sub_d = d[:, None] * q_scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_round(sub / sub_d[..., None]), -32, 31) + 32
    # A zero decoded scale keeps the fit's levels (already offset by 32), as llama.cpp's do.
    levels = np.where((sub_d != 0)[..., None], requant, levels + 32).astype(np.uint8).reshape(count, 2, 4, 32)
    # A super-block with nothing above GROUP_MAX_EPS is written as all-zero bytes.
    levels[empty] = 0
    q_scale[empty] = 0
    # Per 128 values (4 runs of 32): low nibbles of runs 0 / 1 with runs 2 / 3 above them; the high 2-bit pairs of
    # the four runs in one byte, run r at bits 2r.
    low = (levels & 0xF).astype(np.uint8)
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    top = levels >> 4
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(count, 128), qh.reshape(count, 64), q_scale.view(np.uint8), d_half.view(np.uint8).reshape(-1, 2)],
        axis=1,
    )


_ENCODERS = {"Q4_K": _encode_q4_k, "Q5_K": _encode_q5_k, "Q6_K": _encode_q6_k}


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes one row of ``row_length`` values takes in ``type_name`` (a multiple of :data:`QK_K` values)."""
    return row_length // QK_K * BLOCK_BYTES[type_name]


def quantize(rows: np.ndarray, type_name: str) -> np.ndarray:
    """Encode rows of float32 values as a K-quant.

    Args:
        rows: ``[n, k]`` (or ``[k]``) float values; ``k`` a multiple of :data:`QK_K` (256).
        type_name: ``"Q4_K"``, ``"Q5_K"`` or ``"Q6_K"`` (``gguf.GGMLQuantizationType`` member names).

    Returns:
        ``[n, k / 256 * block bytes]`` uint8: each row's super-blocks in ggml's layout, which
        ``gguf.quants.dequantize`` and llama.cpp decode.

    Raises:
        ValueError: An unknown type name (with the list).
        ShapeContractError: A row length that is not a multiple of 256 (the caller picks llama.cpp's fallback type
            for such a tensor, see :mod:`fastft.export.gguf_mixtures`).
    """
    encoder = _ENCODERS.get(type_name)
    if encoder is None:
        raise ValueError(f"fastft.export.kquants: type {type_name!r} is not one of {list(K_TYPES)}.")
    values = np.asarray(rows, dtype=np.float32)
    if values.ndim == 1:
        values = values[None]
    if values.ndim != 2 or values.shape[1] % QK_K:
        raise ShapeContractError(
            f"fastft.export.kquants: {type_name} encodes rows whose length is a multiple of {QK_K}; got rows of shape "
            f"{tuple(values.shape)} (expected (n, k) with k % {QK_K} == 0). Store such a tensor in a 32-block type "
            "(llama.cpp's fallback: Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K)."
        )
    count, length = values.shape
    blocks = np.ascontiguousarray(values).reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[type_name]), dtype=np.uint8)
    starts = range(0, blocks.shape[0], _CHUNK_BLOCKS)

    def encode(start: int) -> None:
        out[start : start + _CHUNK_BLOCKS] = encoder(blocks[start : start + _CHUNK_BLOCKS])

    if len(starts) > 1 and _THREADS > 1:
        with ThreadPoolExecutor(max_workers=min(_THREADS, len(starts))) as pool:
            # list() re-raises the first exception a chunk raised.
            list(pool.map(encode, starts))
    else:
        for start in starts:
            encode(start)
    return out.reshape(count, row_bytes(type_name, length))


__all__ = ["BLOCK_BYTES", "K_TYPES", "QK_K", "quantize", "row_bytes"]
