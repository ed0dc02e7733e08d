"""One GEMM launch for up to three projections of the same input, with the LoRA term added in its epilogue.

For segment ``i`` (q, k, v; or gate, up; or a single o / down projection) with dense base weight ``W_i [N_i, K]``,
optional frozen base bias ``b_i [N_i]``, LoRA ``B_i [N_i, r_i]`` and scale ``s_i``:

    Y_i = X W_iᵀ + b_i + s_i (X A_iᵀ) B_iᵀ

``X A_iᵀ`` (``xa``, every segment's ranks side by side, [M, Σ r_i]) is a small GEMM the caller runs first; each
program of the kernel then computes one [BLOCK_M, BLOCK_N] tile of one segment: the K loop of ``X W_iᵀ`` into an
fp32 accumulator, then one more ``tl.dot`` of the tile's rows of ``xa`` with ``s_i B_iᵀ`` into the same
accumulator, then the tile's slice of the bias (``HAS_BIAS``; Qwen2's q / k / v carry one), before the single store.
No second pass reads or writes ``Y``. A launch without any bias compiles with ``HAS_BIAS=False``, the kernel without
the bias epilogue.

The column blocks of the segments are numbered one after the other, so the widths may differ (GQA: q is
``heads · head_dim`` wide, k and v ``kv_heads · head_dim``) and need not be multiples of the block; each segment keeps
its own weight and output tensors, so nothing is concatenated and each output is contiguous.

Precision: fp32 operands are multiplied in IEEE fp32 (``input_precision="ieee"``), matching torch's default of no
TF32 for matmuls; fp16 / bf16 operands accumulate in fp32 and are rounded once at the store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from fastft.kernels import dispatch
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.gemm_configs import GemmConfig


# K and the widths stay specialised: Triton then knows that K (the W row stride) and n (the output row stride) are
# multiples of 16, and only aligned loads can become asynchronous copies (cp.async), which the software pipeline
# needs. M (tokens) changes every batch and only bounds masks; the ranks only index the small epilogue loads.
@triton.jit(do_not_specialize=["M", "r0", "r1", "r2"])
def _lora_gemm_kernel(
    x_ptr,
    xa_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
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
    s0,
    s1,
    s2,
    stride_xm,
    stride_xam,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blocks0 = tl.cdiv(n0, BLOCK_N)
    blocks1 = tl.cdiv(n1, BLOCK_N)
    # Which segment this column block belongs to; every tensor of a segment is contiguous, so its row stride is its
    # width (weights, outputs) or its rank (B).
    # Every branch must give each name the same type for the compiler, so the first rank offset is r0 * 0 (a
    # runtime int32 like the others), not the constant 0.
    if pid_n < blocks0:
        w_ptr, b_ptr, y_ptr, bias_ptr = w0_ptr, b0_ptr, y0_ptr, bias0_ptr
        n, r, rank_start, scale, block, bias_n = n0, r0, r0 * 0, s0, pid_n, bias_n0
    elif pid_n < blocks0 + blocks1:
        w_ptr, b_ptr, y_ptr, bias_ptr = w1_ptr, b1_ptr, y1_ptr, bias1_ptr
        n, r, rank_start, scale, block, bias_n = n1, r1, r0, s1, pid_n - blocks0, bias_n1
    else:
        w_ptr, b_ptr, y_ptr, bias_ptr = w2_ptr, b2_ptr, y2_ptr, bias2_ptr
        n, r, rank_start, scale, block, bias_n = n2, r2, r0 + r1, s2, pid_n - blocks0 - blocks1, bias_n2

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < n
    # int64 row offsets: M · K passes 2**31 at long context.
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + offs_k
        k_ok = k_idx < K
        x = tl.load(x_rows + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k_idx[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)

    if HAS_LORA:
        acc = add_lora_term(
            acc, xa_ptr, stride_xam, b_ptr, rows, cols, row_ok, col_ok, r, rank_start, scale, PRECISION, BLOCK_R
        )
    if HAS_BIAS:
        acc = add_bias(acc, bias_ptr, cols, bias_n)
    store_tile(y_ptr, acc, rows, cols, row_ok, col_ok, n)


@triton.jit
def add_lora_term(
    acc,
    xa_ptr,
    stride_xam,
    b_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    r,
    rank_start,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The epilogue: this tile's share of s · (X Aᵀ) Bᵀ, added while the accumulator is still in registers. B is the
    segment's contiguous [n, r]; a segment without LoRA has r == 0 and every load is masked off."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < r
    xa = tl.load(
        xa_ptr + rows.to(tl.int64)[:, None] * stride_xam + (rank_start + offs_r)[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + cols.to(tl.int64)[None, :] * r + offs_r[:, None], mask=r_ok[:, None] & col_ok[None, :], other=0.0
    )
    return acc + tl.dot(xa, b, input_precision=PRECISION) * tl.cast(scale, tl.float32)


@triton.jit
def add_bias(acc, bias_ptr, cols, bias_n):
    """The epilogue's bias: this tile's columns of the segment's contiguous [n] bias (in x's dtype), added to the fp32
    accumulator. A segment without a bias in a biased launch has ``bias_n == 0``, so its load is masked off."""
    bias = tl.load(bias_ptr + cols, mask=cols < bias_n, other=0.0)
    return acc + bias.to(tl.float32)[None, :]


@triton.jit
def store_tile(y_ptr, acc, rows, cols, row_ok, col_ok, n):
    """Store one tile of a contiguous [M, n] output, rounded once to its dtype."""
    y = y_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def segment_arguments(
    x: torch.Tensor,
    outputs: list[torch.Tensor],
    lora_b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> dict[str, list]:
    """Per-slot launch arguments of the three-segment kernels, padded to three slots.

    A padded slot has width 0 (no column block) and rank 0; a segment without B gets x as a stand-in pointer of
    the same dtype (the compiler wants one pointer type per name), which rank 0 keeps from being read. Biases the
    same way: a segment without one gets x and bias width 0, which masks off every bias load.
    """
    pad = 3 - len(outputs)
    ranks = [0 if b is None else b.shape[1] for b in lora_b]
    biases = [None] * len(outputs) if biases is None else list(biases)
    return {
        "y": [*outputs, *[outputs[0]] * pad],
        "b": [b if b is not None else x for b in lora_b] + [x] * pad,
        "bias": [bias if bias is not None else x for bias in biases] + [x] * pad,
        "n": [out.shape[1] for out in outputs] + [0] * pad,
        "r": ranks + [0] * pad,
        "bias_n": [0 if bias is None else bias.shape[0] for bias in biases] + [0] * pad,
        "s": [float(v) for v in scales] + [0.0] * pad,
    }


def launch_settings(
    x: torch.Tensor,
    xa: torch.Tensor | None,
    ranks: Sequence[int],
    widths: Sequence[int],
    config: GemmConfig,
    bias_widths: Sequence[int] = (),
) -> dict:
    """Grid, block sizes and flags shared by the three-segment kernels, for one configuration."""
    has_lora = xa is not None and sum(ranks) > 0
    return {
        "grid": (triton.cdiv(x.shape[0], config.block_m), sum(triton.cdiv(w, config.block_n) for w in widths)),
        "xa": xa if has_lora else x,
        "meta": {
            "HAS_LORA": has_lora,
            "HAS_BIAS": any(bias_widths),
            # None: triton's default for 16-bit operands.
            "PRECISION": "ieee" if x.dtype == torch.float32 else None,
            "BLOCK_R": max(16, triton.next_power_of_2(max(ranks))) if has_lora else 16,
            **config.meta(),
        },
    }


_launched = threading.local()


def remember(kernel) -> None:
    """Keep the compiled kernel a launch returned: the tuner checks its resources before timing it."""
    _launched.kernel = kernel


def last_kernel():
    """The compiled kernel of this thread's last fused LoRA GEMM launch (a triton ``CompiledKernel``), or None."""
    return getattr(_launched, "kernel", None)


def lora_gemm_triton(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
    config: GemmConfig,
    biases: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Launch the kernel: ``[x @ W_iᵀ + b_i + s_i · xa_i @ B_iᵀ for each segment]``.

    Args:
        x: [M, K], rows may be strided, columns contiguous.
        weights: One to three dense contiguous [N_i, K] weights in x's dtype.
        xa: [M, Σ r_i] in x's dtype (columns contiguous), or None when no segment has LoRA.
        lora_b: Per segment a contiguous [N_i, r_i] B in x's dtype, or None for a segment without LoRA.
        scales: Per segment LoRA scale.
        config: Tile sizes, warps and stages (:mod:`fastft.kernels.gemm_configs`).
        biases: Per segment a contiguous [N_i] bias in x's dtype, or None; None for no bias at all.

    Returns:
        One new contiguous [M, N_i] tensor per segment, in x's dtype.
    """
    m, k = x.shape
    outputs = [dispatch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    if m == 0 or sum(w.shape[0] for w in weights) == 0:
        return outputs
    if k == 0:
        return bias_only(outputs, biases)
    slots = segment_arguments(x, outputs, lora_b, scales, biases)
    launch = launch_settings(x, xa, slots["r"], slots["n"], config, slots["bias_n"])
    w = [*weights, *[weights[0]] * (3 - len(weights))]
    kernel = _lora_gemm_kernel[launch["grid"]](
        x,
        launch["xa"],
        *w,
        *slots["b"],
        *slots["y"],
        *slots["bias"],
        m,
        k,
        *slots["n"],
        *slots["r"],
        *slots["bias_n"],
        *slots["s"],
        x.stride(0),
        launch["xa"].stride(0),
        **launch["meta"],
    )
    remember(kernel)
    return outputs


def bias_only(outputs: list[torch.Tensor], biases: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor]:
    """The outputs of an empty K (``x`` has no columns): every row is the segment's bias, or zeros without one."""
    biases = [None] * len(outputs) if biases is None else biases
    pairs = zip(outputs, biases, strict=True)
    return [out.zero_() if bias is None else out.copy_(bias.expand_as(out)) for out, bias in pairs]


def lora_gemm_reference(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor | None],
    scales: Sequence[float],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:func:`lora_gemm_triton` with torch's matmuls: the base GEMM, its bias taken by the GEMM itself (``addmm`` with
    the [N] bias broadcast, cuBLAS's bias epilogue on CUDA), then the low-rank term added in place (``addmm_`` into
    the same output). No extra [M, N] temporary."""
    biases = [None] * len(weights) if biases is None else biases
    outputs = []
    start = 0
    for weight, b, scale, bias in zip(weights, lora_b, scales, biases, strict=True):
        out = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        if b is not None and xa is not None:
            rank = b.shape[1]
            out.addmm_(xa[:, start : start + rank], b.t(), alpha=scale)
            start += rank
        outputs.append(out)
    return outputs


__all__ = [
    "add_bias",
    "add_lora_term",
    "bias_only",
    "last_kernel",
    "launch_settings",
    "lora_gemm_reference",
    "lora_gemm_triton",
    "remember",
    "segment_arguments",
    "store_tile",
]
