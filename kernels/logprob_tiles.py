"""The row kernels of :mod:`fastft.kernels.linear_logprobs`: one fp32 tile of transformed logits folded into per-token
running statistics (online log-sum-exp, entropy, Σp², Σz, first argmax), and a tile turned in place into the gradient
with respect to its raw logits. Each as a Triton kernel and its torch twin (the reference and the CPU path), which
:mod:`~fastft.kernels.linear_logprobs` picks between per call; the math is in that module's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastft.kernels.cross_entropy import _tanh_softcap
from fastft.kernels.dispatch import tl, triton

# Columns one program handles per step of its loop (forward) / per program (backward).
_FOLD_BLOCK = 2048
_GRAD_BLOCK = 1024


@dataclass(frozen=True)
class Transform:
    """The per-column logit transform and the options of one call."""

    logit_scale: float
    softcap: float | None
    inv_temperature: float
    ignore_index: int
    entropy: bool
    sum_sq: bool
    mean: bool
    top1: bool


@dataclass
class Stats:
    """Per-token running statistics (views of [T] buffers); the optional ones are None when not asked for."""

    max: torch.Tensor  # running max m of z
    sum: torch.Tensor  # s = Σ exp(z − m)
    target: torch.Tensor  # z at the target column
    entropy: torch.Tensor | None  # Σ exp(z − m) (z − m)
    sum_sq: torch.Tensor | None  # Σ exp(2 (z − m))
    logit_sum: torch.Tensor | None  # Σ z
    argmax: torch.Tensor | None  # first column of the max, int32

    def rows(self, start: int, stop: int) -> Stats:
        return Stats(*(None if t is None else t[start:stop] for t in vars(self).values()))


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _logprobs_fold_kernel(
    logits_ptr,
    logits_row_stride,
    bias_ptr,
    targets_ptr,
    max_ptr,
    sum_ptr,
    target_ptr,
    entropy_ptr,
    sum_sq_ptr,
    logit_sum_ptr,
    argmax_ptr,
    col_start,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    SUM_SQ: tl.constexpr,
    MEAN: tl.constexpr,
    TOP1: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per token: fold one tile of its raw logits (columns ``col_start ..``) into its running statistics.

    The tile starting at column 0 initialises the statistics; later tiles load them, rescale and add. Ignored tokens
    return at once (their statistics stay unwritten; the caller masks them).
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        return
    # Python float arguments are plain floats in the interpreter (no .to()); tl.cast works in both.
    scale = tl.cast(logit_scale, tl.float32)
    inv_t = tl.cast(inv_temperature, tl.float32)
    if SOFTCAP:
        cap = tl.cast(softcap, tl.float32)
    logits_row = logits_ptr + row * logits_row_stride
    offsets = tl.arange(0, BLOCK)

    first = col_start == 0
    m = tl.where(first, float("-inf"), tl.load(max_ptr + row))
    s = tl.where(first, 0.0, tl.load(sum_ptr + row))
    ent = 0.0
    sq = 0.0
    zsum = 0.0
    best = 0
    if ENTROPY:
        ent = tl.where(first, 0.0, tl.load(entropy_ptr + row))
    if SUM_SQ:
        sq = tl.where(first, 0.0, tl.load(sum_sq_ptr + row))
    if MEAN:
        zsum = tl.where(first, 0.0, tl.load(logit_sum_ptr + row))
    if TOP1:
        best = tl.where(first, 0, tl.load(argmax_ptr + row))

    for start in range(0, n_cols, BLOCK):
        cols = start + offsets
        mask = cols < n_cols
        raw = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            raw += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = raw * scale
        if SOFTCAP:
            z, _ = _tanh_softcap(z, cap)
        z = z * inv_t
        if MEAN:
            zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        # Every block holds at least one real column, so block_max and new_m are finite.
        block_max = tl.max(z, axis=0)
        new_m = tl.maximum(m, block_max)
        if TOP1:
            # The first column of the block's max; it replaces the running argmax only if strictly larger, so ties
            # keep the earlier column.
            block_arg = tl.min(tl.where(z == block_max, cols, n_cols), axis=0)
            best = tl.where(block_max > m, col_start + block_arg, best)
        rescale = tl.exp(m - new_m)  # 0 while m is still -inf
        # Masked columns: shift 0 and weight 0, never -inf (0 · -inf would be NaN).
        shifted = tl.where(mask, z - new_m, 0.0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        if ENTROPY:
            # Σ e^{z−m'} (z − m') = r (b + (m − m') s) over the old columns; s = 0 while m = -inf, where the
            # product would be (-inf) · 0.
            moved = tl.where(s > 0.0, m - new_m, 0.0) * s
            ent = rescale * (ent + moved) + tl.sum(e * shifted, axis=0)
        if SUM_SQ:
            sq = sq * rescale * rescale + tl.sum(e * e, axis=0)
        s = s * rescale + tl.sum(e, axis=0)
        m = new_m

    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    if ENTROPY:
        tl.store(entropy_ptr + row, ent)
    if SUM_SQ:
        tl.store(sum_sq_ptr + row, sq)
    if MEAN:
        tl.store(logit_sum_ptr + row, zsum)
    if TOP1:
        tl.store(argmax_ptr + row, best)

    local = target - col_start
    if (local >= 0) & (local < n_cols):
        raw_t = tl.load(logits_row + local).to(tl.float32)
        if HAS_BIAS:
            raw_t += tl.load(bias_ptr + local).to(tl.float32)
        z_t = raw_t * scale
        if SOFTCAP:
            z_t, _ = _tanh_softcap(z_t, cap)
        tl.store(target_ptr + row, z_t * inv_t)


@triton.jit
def _logprobs_grad_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    bias_ptr,
    targets_ptr,
    log_z_ptr,
    entropy_ptr,
    grad_log_probs_ptr,
    grad_entropy_ptr,
    col_start,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOG_PROB_GRAD: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token, column block): the gradient with respect to one block of the raw logits tile.

    ``g_lp (onehot − p) − g_H p (log p + H)``, times ``1 / temperature``, the cap's derivative and ``logit_scale``;
    zero for an ignored token. ``grad_ptr`` may be ``logits_ptr`` (in place) or a 16-bit buffer for the GEMMs.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    grad_row = grad_ptr + row * grad_row_stride
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        tl.store(grad_row + cols, tl.zeros([BLOCK], dtype=tl.float32).to(grad_ptr.dtype.element_ty), mask=mask)
        return
    scale = tl.cast(logit_scale, tl.float32)
    inv_t = tl.cast(inv_temperature, tl.float32)
    raw = tl.load(logits_ptr + row * logits_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z = raw * scale
    if SOFTCAP:
        z, slope = _tanh_softcap(z, tl.cast(softcap, tl.float32))
    z = z * inv_t
    log_p = z - tl.load(log_z_ptr + row)
    p = tl.exp(log_p)
    grad = tl.zeros([BLOCK], dtype=tl.float32)
    if LOG_PROB_GRAD:
        g = tl.load(grad_log_probs_ptr + row)
        grad += g * (tl.where(cols + col_start == target, 1.0, 0.0) - p)
    if ENTROPY_GRAD:
        g = tl.load(grad_entropy_ptr + row)
        grad -= g * p * (log_p + tl.load(entropy_ptr + row))
    grad = grad * inv_t
    if SOFTCAP:
        grad = grad * slope
    grad = grad * scale
    tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def fold_triton(
    tile: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    stats: Stats,
    col_start: int,
    options: Transform,
) -> None:
    n_rows, n_cols = tile.shape
    if n_rows == 0:
        return
    block = min(_FOLD_BLOCK, triton.next_power_of_2(n_cols))
    _logprobs_fold_kernel[(n_rows,)](
        tile,
        tile.stride(0),
        tile if bias is None else bias,
        targets,
        stats.max,
        stats.sum,
        stats.target,
        stats.max if stats.entropy is None else stats.entropy,
        stats.max if stats.sum_sq is None else stats.sum_sq,
        stats.max if stats.logit_sum is None else stats.logit_sum,
        stats.max if stats.argmax is None else stats.argmax,
        col_start,
        n_cols,
        options.ignore_index,
        float(options.logit_scale),
        1.0 if options.softcap is None else float(options.softcap),
        float(options.inv_temperature),
        HAS_BIAS=bias is not None,
        SOFTCAP=options.softcap is not None,
        ENTROPY=options.entropy,
        SUM_SQ=options.sum_sq,
        MEAN=options.mean,
        TOP1=options.top1,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )


def grad_triton(
    tile: torch.Tensor,
    grad: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    col_start: int,
    options: Transform,
) -> None:
    n_rows, n_cols = tile.shape
    if n_rows == 0:
        return
    block = min(_GRAD_BLOCK, triton.next_power_of_2(n_cols))
    _logprobs_grad_kernel[(n_rows, triton.cdiv(n_cols, block))](
        tile,
        tile.stride(0),
        grad,
        grad.stride(0),
        tile if bias is None else bias,
        targets,
        log_z,
        log_z if entropy is None else entropy,
        log_z if grad_log_probs is None else grad_log_probs,
        log_z if grad_entropy is None else grad_entropy,
        col_start,
        n_cols,
        options.ignore_index,
        float(options.logit_scale),
        1.0 if options.softcap is None else float(options.softcap),
        float(options.inv_temperature),
        HAS_BIAS=bias is not None,
        SOFTCAP=options.softcap is not None,
        LOG_PROB_GRAD=grad_log_probs is not None,
        ENTROPY_GRAD=grad_entropy is not None,
        BLOCK=block,
        num_warps=4,
    )


# --------------------------------------------------------------------------------------------------------------------
# The torch reference of the two kernels (the CPU path): same arguments, same results, a whole tile at a time.


def transform_torch(tile: torch.Tensor, bias: torch.Tensor | None, options: Transform, slope: bool):
    """The logit transform in place over the fp32 ``tile``; with ``slope``, also the cap's derivative (or None)."""
    z = tile
    if bias is not None:
        z.add_(bias.float())
    z.mul_(options.logit_scale)
    derivative = None
    if options.softcap is not None:
        z.div_(options.softcap)
        if slope:
            # sech²(u) = 1 / cosh²(u): accurate where tanh is close to ±1; cosh overflowing gives the limit 0.
            derivative = torch.cosh(z).square_().reciprocal_()
        z.tanh_().mul_(options.softcap)
    return z.mul_(options.inv_temperature), derivative


def fold_torch(
    tile: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    stats: Stats,
    col_start: int,
    options: Transform,
) -> None:
    """:func:`_logprobs_fold_kernel` in torch ops; ``tile`` is scratch (overwritten). Ignored tokens are folded like
    the others (their target column is never read) and masked by the caller."""
    n_cols = tile.shape[1]
    z, _ = transform_torch(tile, bias, options, slope=False)
    local = targets - col_start
    in_tile = (targets != options.ignore_index) & (local >= 0) & (local < n_cols)
    target_z = z.gather(1, local.clamp(0, max(n_cols - 1, 0)).unsqueeze(1)).squeeze(1)
    stats.target.copy_(torch.where(in_tile, target_z, stats.target))
    first = col_start == 0
    if stats.logit_sum is not None:
        block_sum = z.sum(dim=1)
        stats.logit_sum.copy_(block_sum if first else stats.logit_sum + block_sum)
    # torch.max over a dim returns the first index of the maximum.
    block_max, block_arg = z.max(dim=1)
    new_m = block_max if first else torch.maximum(stats.max, block_max)
    if stats.argmax is not None:
        column = (block_arg + col_start).to(stats.argmax.dtype)
        stats.argmax.copy_(column if first else torch.where(block_max > stats.max, column, stats.argmax))
    shifted = z.sub_(new_m.unsqueeze(1))
    e = torch.exp(shifted)
    block_s = e.sum(dim=1)
    block_ent = (e * shifted).sum(dim=1) if stats.entropy is not None else None
    block_sq = e.square_().sum(dim=1) if stats.sum_sq is not None else None
    if first:
        stats.sum.copy_(block_s)
        if block_ent is not None:
            stats.entropy.copy_(block_ent)
        if block_sq is not None:
            stats.sum_sq.copy_(block_sq)
    else:
        moved = stats.max - new_m
        rescale = torch.exp(moved)
        if block_ent is not None:
            stats.entropy.copy_(rescale * (stats.entropy + moved * stats.sum) + block_ent)
        if block_sq is not None:
            stats.sum_sq.copy_(stats.sum_sq * rescale * rescale + block_sq)
        stats.sum.copy_(stats.sum * rescale + block_s)
    stats.max.copy_(new_m)


def grad_torch(
    tile: torch.Tensor,
    grad: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    col_start: int,
    options: Transform,
) -> None:
    """:func:`_logprobs_grad_kernel` in torch ops, in place over the fp32 ``tile`` (then copied into ``grad``)."""
    n_cols = tile.shape[1]
    z, slope = transform_torch(tile, bias, options, slope=True)
    log_p = z.sub_(log_z.unsqueeze(1))
    p = torch.exp(log_p)
    if grad_entropy is not None:
        out = log_p.add_(entropy.unsqueeze(1)).mul_(p).mul_(grad_entropy.neg().unsqueeze(1))
        if grad_log_probs is not None:
            out.sub_(p.mul_(grad_log_probs.unsqueeze(1)))
    else:
        out = log_p.copy_(p).mul_(grad_log_probs.neg().unsqueeze(1))
    valid = targets != options.ignore_index
    if grad_log_probs is not None:
        local = targets - col_start
        in_tile = valid & (local >= 0) & (local < n_cols)
        onehot = torch.where(in_tile, grad_log_probs, 0.0).unsqueeze(1)
        out.scatter_add_(1, local.clamp(0, max(n_cols - 1, 0)).unsqueeze(1), onehot)
    out.mul_(options.inv_temperature)
    if slope is not None:
        out.mul_(slope)
    out.mul_(options.logit_scale)
    out.masked_fill_(~valid.unsqueeze(1), 0.0)
    if grad is not out:
        grad.copy_(out)


# --------------------------------------------------------------------------------------------------------------------
# Validation, chunking, the driver loops
