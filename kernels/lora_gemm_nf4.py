"""The fused LoRA GEMM of :mod:`fastft.kernels.lora_gemm` reading NF4 base weights directly: each tile of ``W`` is
dequantised in registers inside the K loop, so no dense copy of the weight is ever written.

The alternative, the default, dequantises the group's weights once per call into one reused buffer and runs the
16-bit kernel over it. Which is faster depends on the device and the token count: in-kernel dequantisation saves the
buffer's write and read, but repeats the decoding for every block of rows (``M / BLOCK_M`` times), so it tends to win
for few tokens (decoding) and lose for long training batches. ``FASTFT_NF4_DEQUANT=kernel`` selects this path and
``bench/lora.py`` times both; see ``bench/README.md`` for what has been measured.

Layout (bitsandbytes NF4, see :mod:`fastft.kernels.nf4`): value ``e = row · K + col`` of the flat weight is the high
nibble of byte ``e // 2`` when ``e`` is even, else the low one, times the fp32 scale of block ``e // blocksize``. The
scales are resolved to fp32 on the host side first (one small op; it undoes double quantisation), so the kernel reads
one fp32 per block. The decoded value is rounded once to x's dtype, as the buffer path does, so both paths multiply
the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastft.kernels import dispatch
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.gemm_configs import GemmConfig
from fastft.kernels.lora_gemm import (
    add_bias,
    add_lora_term,
    bias_only,
    launch_settings,
    remember,
    segment_arguments,
    store_tile,
)
from fastft.kernels.nf4 import _block_absmax_reference, _nf4_table, _resolve


# K and the widths specialised as in the 16-bit kernel (aligned X loads and output stores); see lora_gemm.py.
@triton.jit(do_not_specialize=["M", "r0", "r1", "r2", "bs0", "bs1", "bs2"])
def _lora_gemm_nf4_kernel(
    x_ptr,
    xa_ptr,
    table_ptr,
    q0_ptr,
    q1_ptr,
    q2_ptr,
    absmax0_ptr,
    absmax1_ptr,
    absmax2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y0_ptr,
    y1_ptr,
    y2_ptr,
    bias0_ptr,
    bias1_ptr,
    bias2_ptr,
    M,
    K,
    n0,
    n1,
    n2,
    r0,
    r1,
    r2,
    bias_n0,
    bias_n1,
    bias_n2,
    bs0,
    bs1,
    bs2,
    s0,
    s1,
    s2,
    stride_xm,
    stride_xam,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE_PER_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blocks0 = tl.cdiv(n0, BLOCK_N)
    blocks1 = tl.cdiv(n1, BLOCK_N)
    # Same segment selection as the 16-bit kernel; every branch gives each name the same (runtime) type.
    if pid_n < blocks0:
        q_ptr, absmax_ptr, b_ptr, y_ptr, bias_ptr = q0_ptr, absmax0_ptr, b0_ptr, y0_ptr, bias0_ptr
        n, r, rank_start, blocksize, scale, block, bias_n = n0, r0, r0 * 0, bs0, s0, pid_n, bias_n0
    elif pid_n < blocks0 + blocks1:
        q_ptr, absmax_ptr, b_ptr, y_ptr, bias_ptr = q1_ptr, absmax1_ptr, b1_ptr, y1_ptr, bias1_ptr
        n, r, rank_start, blocksize, scale, block, bias_n = n1, r1, r0, bs1, s1, pid_n - blocks0, bias_n1
    else:
        q_ptr, absmax_ptr, b_ptr, y_ptr, bias_ptr = q2_ptr, absmax2_ptr, b2_ptr, y2_ptr, bias2_ptr
        n, r, rank_start, blocksize, scale, block, bias_n = n2, r2, r0 + r1, bs2, s2, pid_n - blocks0 - blocks1, bias_n2

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    col_start = cols.to(tl.int64)[None, :] * K
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + offs_k
        k_ok = k_idx < K
        x = tl.load(x_rows + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        element = col_start + k_idx.to(tl.int64)[:, None]
        packed = tl.load(q_ptr + element // 2, mask=w_ok, other=0).to(tl.int32)
        code = tl.where(element % 2 == 0, packed >> 4, packed & 0xF)
        if SCALE_PER_COLUMN:
            # The tile's K range lies inside one quantisation block of each column: one scale per column instead
            # of one per element, which would be a [BLOCK_K, BLOCK_N] fp32 tile in shared memory per stage.
            block_scale = tl.load(absmax_ptr + (cols.to(tl.int64) * K + k0) // blocksize, mask=col_ok, other=0.0)
            absmax = block_scale[None, :]
        else:
            absmax = tl.load(absmax_ptr + element // blocksize, mask=w_ok, other=0.0)
        value = tl.load(table_ptr + code, mask=w_ok, other=0.0) * absmax
        acc = tl.dot(x, value.to(x_ptr.dtype.element_ty), acc, input_precision=PRECISION)

    if HAS_LORA:
        acc = add_lora_term(
            acc, xa_ptr, stride_xam, b_ptr, rows, cols, row_ok, col_ok, r, rank_start, scale, PRECISION, BLOCK_R
        )
    if HAS_BIAS:
        acc = add_bias(acc, bias_ptr, cols, bias_n)
    store_tile(y_ptr, acc, rows, cols, row_ok, col_ok, n)


def lora_gemm_nf4_triton(
    x: torch.Tensor,
    packed: Sequence[torch.Tensor],
    quant_states: Sequence[object],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
    config: GemmConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """``[x @ W_iᵀ + b_i + s_i · xa_i @ B_iᵀ]`` for one to three NF4 weights ``W_i``, decoded inside the GEMM.

    Args:
        x: [M, K] on a device Triton runs on (CUDA, or CPU under the interpreter); columns contiguous.
        packed: Per segment the packed NF4 bytes (a ``Params4bit`` or its storage).
        quant_states: Per segment its bitsandbytes quant_state (shape [N_i, K], NF4).
        xa: [M, Σ r_i] in x's dtype, or None when no segment has LoRA.
        lora_b: Per segment a contiguous [N_i, r_i] B in x's dtype, or None.
        scales: Per segment LoRA scale.
        config: Tile sizes, warps and stages (:mod:`fastft.kernels.gemm_configs`).
        biases: Per segment a contiguous [N_i] bias in x's dtype, or None; None for no bias at all.

    Returns:
        One new contiguous [M, N_i] tensor per segment, in x's dtype.
    """
    resolved = [_resolve("lora_gemm_nf4", p, qs, x.dtype) for p, qs in zip(packed, quant_states, strict=True)]
    m, k = x.shape
    outputs = [dispatch.empty((m, r.out_features), dtype=x.dtype, device=x.device) for r in resolved]
    if m == 0 or sum(r.out_features for r in resolved) == 0:
        return outputs
    if k == 0:
        return bias_only(outputs, biases)
    slots = segment_arguments(x, outputs, lora_b, scales, biases)
    launch = launch_settings(x, xa, slots["r"], slots["n"], config, slots["bias_n"])
    pad = 3 - len(resolved)
    quant = [r.bytes.contiguous() for r in resolved]
    absmax = [_block_absmax_reference(r).contiguous() for r in resolved]
    blocksizes = [int(r.quant_state.blocksize) for r in resolved]
    # Every row starts a block and every K tile stays inside one (true for the models' widths, multiples of 64).
    per_column = all(k % size == 0 and size % config.block_k == 0 for size in blocksizes)
    kernel = _lora_gemm_nf4_kernel[launch["grid"]](
        x,
        launch["xa"],
        _nf4_table(x.device),
        *quant,
        *[quant[0]] * pad,
        *absmax,
        *[absmax[0]] * pad,
        *slots["b"],
        *slots["y"],
        *slots["bias"],
        m,
        k,
        *slots["n"],
        *slots["r"],
        *slots["bias_n"],
        *blocksizes,
        *[2] * pad,
        *slots["s"],
        x.stride(0),
        launch["xa"].stride(0),
        SCALE_PER_COLUMN=per_column,
        **launch["meta"],
    )
    remember(kernel)
    return outputs


__all__ = ["lora_gemm_nf4_triton"]
