"""Rotary position embedding, Llama's rotate-half convention, for queries and keys in one launch.

The function is transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``::

    out = x * cos + rotate_half(x) * sin,    rotate_half(x) = cat(-x2, x1)

with ``x1`` / ``x2`` the first and second half of ``head_dim``. Per pair ``(x1[i], x2[i])`` that is

    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2

(``cos1`` = ``cos[..., i]``, ``cos2`` = ``cos[..., i + head_dim // 2]``, same for sin). Llama's tables repeat their
halves, so this is a plane rotation by θ and its gradient is the rotation by −θ. The backward here uses the exact
transpose of the map above, ``dx1 = dy1 * cos1 + dy2 * sin2``, ``dx2 = dy2 * cos2 - dy1 * sin1``: the same kernel
with sin negated and its halves swapped, which is the rotation by −θ for Llama's tables and still the right
gradient for tables whose halves differ. Backward needs only cos / sin (and position_ids), never q or k.

Layouts: q is [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] (transformers' layout, usually
transposed views of [batch, seq, heads, head_dim]; every stride is passed to the kernel, nothing is copied). cos /
sin are either gathered per token, [batch or 1, seq, head_dim] (what ``LlamaRotaryEmbedding`` returns), or, with
``position_ids`` [batch or 1, seq], whole tables [max_positions, head_dim] that the kernel indexes per token, so
packed rows whose positions restart mid-row need no gathered copy.

The kernel is registered as the custom ops ``fastft::rope`` and ``fastft::rope_backward`` (see
:mod:`fastft.kernels.custom_ops`): :func:`apply_rope` calls the op while ``torch.compile`` traces and
:class:`RoPEFunction` otherwise, both running the same forward and backward code.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import compiling, define, direct_apply, math_backward, pick, register_autograd
from fastft.kernels.dispatch import tl, triton
from fastft.kernels.rope_checks import _check, _checked
from fastft.kernels.traced_reference import traces_reference


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, b, s, n_heads, half,
    x_sb, x_sh, x_ss, x_sd, y_sb, y_sh, y_ss, y_sd,
    c1, c2, t1, t2,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = d < half
    x_base = x_ptr + b * x_sb + s * x_ss
    y_base = y_ptr + b * y_sb + s * y_ss
    # A loop rather than one block over all heads keeps the tile small for 64+ head models; cos / sin stay loaded.
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        mask = (h < n_heads)[:, None] & d_mask[None, :]
        x_rows = x_base + h[:, None] * x_sh
        # Both halves are loaded before either is stored, so in-place (y_ptr == x_ptr) reads no rotated values.
        x1 = tl.load(x_rows + d[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + (d[None, :] + half) * x_sd, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1[None, :] - x2 * t1[None, :]
        y2 = x2 * c2[None, :] + x1 * t2[None, :]
        y_rows = y_base + h[:, None] * y_sh
        tl.store(y_rows + d[None, :] * y_sd, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_rows + (d[None, :] + half) * y_sd, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    seq_len, n_q_heads, n_k_heads, half,
    q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
    qo_sb, qo_sh, qo_ss, qo_sd, ko_sb, ko_sh, ko_ss, ko_sd,
    cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd, pos_sb, pos_ss,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per token, covering all of its q heads and then all of its k heads: the launch rotates both, and
    # the token's cos / sin row is read once for Hq + Hk heads.
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token % seq_len
    if HAS_POS:
        row = tl.load(pos_ptr + b * pos_sb + s * pos_ss).to(tl.int64)
        cos_row = cos_ptr + row * cos_ss
        sin_row = sin_ptr + row * sin_ss
    else:
        cos_row = cos_ptr + b * cos_sb + s * cos_ss
        sin_row = sin_ptr + b * sin_sb + s * sin_ss
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = d < half
    c1 = tl.load(cos_row + d * cos_sd, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + (d + half) * cos_sd, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d * sin_sd, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + (d + half) * sin_sd, mask=d_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward map: sin negated and its halves swapped (the rotation by -theta).
        t1 = -s2
        t2 = -s1
    else:
        t1 = s1
        t2 = s2
    _rotate_heads(
        q_ptr, q_out_ptr, b, s, n_q_heads, half, q_sb, q_sh, q_ss, q_sd, qo_sb, qo_sh, qo_ss, qo_sd,
        c1, c2, t1, t2, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, b, s, n_k_heads, half, k_sb, k_sh, k_ss, k_sd, ko_sb, ko_sh, ko_ss, ko_sd,
        c1, c2, t1, t2, BLOCK_H, BLOCK_D,
    )  # fmt: skip


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch.promote_types(dtype, float32) for a floating dtype, without its aten op: fp32 at least, and float64 stays
    # float64 (so the reference also serves as a float64 oracle).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _gather(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin as [batch or 1, 1, seq, head_dim], ready to broadcast over heads."""
    if position_ids is not None:
        cos, sin = cos[position_ids.long()], sin[position_ids.long()]
    return cos.unsqueeze(1), sin.unsqueeze(1)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k with plain torch ops (differentiable by autograd, including through cos and sin).

    Args:
        q: Queries [batch, heads, seq, head_dim], any strides.
        k: Keys [batch, kv_heads, seq, head_dim], any strides.
        cos: Gathered [batch or 1, seq, head_dim], or a table [max_positions, head_dim] when position_ids is given.
        sin: Same shape as cos.
        position_ids: Optional integer [batch or 1, seq]: the table row each token reads.

    Returns:
        The rotated (q, k) in their input dtypes, computed in fp32 (or wider); in fp32 bit-for-bit equal to
        transformers' ``apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids])``.

    Raises:
        ShapeContractError: The shapes do not fit (see :func:`apply_rope`).
    """
    _checked("rope_reference", q, k, cos, sin, position_ids)
    cos, sin = _gather(cos, sin, position_ids)
    compute = _compute_dtype(q.dtype)
    cos, sin = cos.to(compute), sin.to(compute)
    # For fp32 inputs the casts are no-ops and the expression is transformers' own.
    return tuple(((x.to(compute) * cos) + (_rotate_half(x.to(compute)) * sin)).to(x.dtype) for x in (q, k))


@functools.cache
def _sign(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[-1] * half + [+1] * half``: ``rotate_half(x) == roll(x, half) * sign``; made once per head_dim and dtype."""
    return torch.tensor([-1.0] * (head_dim // 2) + [1.0] * (head_dim // 2), dtype=dtype, device=device)


def _reference_tables(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, compute: torch.dtype, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the factor of roll(x, half) for the kernel's CPU path, [batch or 1, 1, seq, head_dim] in ``compute``.

    Forward, ``rotate_half(x) * sin == roll(x, half) * (sign * sin)``: negating a factor is exact, so
    ``x * cos + roll(x, half) * (sign * sin)`` has transformers' bits while costing two aten ops per tensor fewer
    than slicing, negating and concatenating. Backward, the transpose of that map is
    ``dy * cos + roll(dy, half) * roll(sign * sin, half)`` (per pair ``dx1 = dy1 cos1 + dy2 sin2``,
    ``dx2 = dy2 cos2 - dy1 sin1``), the same expression with the factor rolled.
    """
    # Every layer of a forward (and of its backward) reads the same cos / sin objects: the tables are made once and
    # handed to the rest. The entry keeps its key tensors alive, so no new tensor can take their ids meanwhile, and
    # their version counters tell an in-place change of the tables.
    if cos.is_inference() or sin.is_inference() or (position_ids is not None and position_ids.is_inference()):
        # Inference tensors keep no version counter to validate a kept entry with (inference_mode: a forward only).
        return _make_tables(cos, sin, position_ids, compute, backward)
    entry = _TABLES.get(backward)
    versions = (cos._version, sin._version, None if position_ids is None else position_ids._version)
    if (
        entry is not None
        and entry[0] is cos
        and entry[1] is sin
        and entry[2] is position_ids
        and entry[3] == versions
        and entry[4] == compute
    ):
        return entry[5]
    tables = _make_tables(cos, sin, position_ids, compute, backward)
    _TABLES[backward] = (cos, sin, position_ids, versions, compute, tables)
    return tables


def _make_tables(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None, compute: torch.dtype, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _gather(cos, sin, position_ids)
    cos, sin = cos.to(compute), sin.to(compute)
    factor = sin * _sign(sin.shape[-1], compute, sin.device)
    return cos, (factor.roll(factor.shape[-1] // 2, -1) if backward else factor)


# backward flag -> (cos, sin, position_ids, their versions, compute dtype, tables): the latest tables of each kind.
_TABLES: dict[bool, tuple[Any, ...]] = {}


def _rotate(x: torch.Tensor, cos: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # Always a new tensor (never x itself), so incoming gradients stay untouched and the op's outputs alias nothing.
    same = x.dtype == cos.dtype
    xc = x if same else x.to(cos.dtype)
    out = (xc * cos) + (xc.roll(x.shape[-1] // 2, -1) * factor)
    return out if same else out.to(x.dtype)


def _launch(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    q_out: torch.Tensor | None,
    k_out: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    backward: bool,
) -> None:
    """Rotate q into q_out and k into k_out in one launch; a None pair (a gradient nobody produced) is skipped."""
    present = q if q is not None else k
    batch, _, seq, head_dim = present.shape
    if batch * seq == 0:
        return
    # An absent pair gets zero heads, so its loop never runs; any tensor serves as its (unread) pointer.
    n_q = q.shape[1] if q is not None else 0
    n_k = k.shape[1] if k is not None else 0
    q, q_out = (q, q_out) if q is not None else (present, present)
    k, k_out = (k, k_out) if k is not None else (present, present)
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    # About 2K elements per half-tile: few loop trips for GQA head counts without spilling registers.
    block_h = max(1, min(triton.next_power_of_2(max(n_q, n_k, 1)), 2048 // block_d))
    if position_ids is not None:
        cos_strides = (0, cos.stride(0), cos.stride(1))
        sin_strides = (0, sin.stride(0), sin.stride(1))
        pos_strides = (position_ids.stride(0) if position_ids.shape[0] > 1 else 0, position_ids.stride(1))
        pos = position_ids
    else:
        # A batch-1 cos / sin broadcasts over the batch: stride 0.
        cos_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))
        sin_strides = (sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1), sin.stride(2))
        pos_strides = (0, 0)
        pos = cos  # unread when HAS_POS is off
    _rope_kernel[(batch * seq,)](
        q, k, q_out, k_out, cos, sin, pos,
        seq, n_q, n_k, half,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        *cos_strides, *sin_strides, *pos_strides,
        HAS_POS=position_ids is not None, BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def _rope_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    inplace: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked, rotated (q, k) on the dispatched path: q and k themselves when in place, new tensors otherwise."""
    _checked("apply_rope", q, k, cos, sin, position_ids)
    if dispatch.use_triton(q):
        q_out, k_out = (q, k) if inplace else (dispatch.empty_like(q), dispatch.empty_like(k))
        _launch(q, k, q_out, k_out, cos, sin, position_ids, backward=False)
        return q_out, k_out
    cos, factor = _reference_tables(cos, sin, position_ids, _compute_dtype(q.dtype), backward=False)
    q_rot, k_rot = _rotate(q, cos, factor), _rotate(k, cos, factor)
    # Out of place the reference's own results are returned: copying them into fresh buffers would cost a pass.
    return (q.copy_(q_rot), k.copy_(k_rot)) if inplace else (q_rot, k_rot)


def _rope_backward(
    grad_q: torch.Tensor | None,
    grad_k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of q and k (None where the output's gradient is None), in one launch on the Triton path."""
    # Fresh buffers, never grad_q / grad_k rotated in place: autograd may hand one gradient tensor to several
    # consumers (an add passes it to both operands; AccumulateGrad may keep it as .grad), so writing would corrupt them.
    if grad_q is None and grad_k is None:
        return None, None
    if dispatch.use_triton(cos):
        dq = None if grad_q is None else dispatch.empty(grad_q.shape, dtype=grad_q.dtype, device=grad_q.device)
        dk = None if grad_k is None else dispatch.empty(grad_k.shape, dtype=grad_k.dtype, device=grad_k.device)
        _launch(grad_q, grad_k, dq, dk, cos, sin, position_ids, backward=True)
        return dq, dk
    compute = _compute_dtype((grad_q if grad_q is not None else grad_k).dtype)
    cos, factor = _reference_tables(cos, sin, position_ids, compute, backward=True)
    dq = None if grad_q is None else _rotate(grad_q, cos, factor)
    dk = None if grad_k is None else _rotate(grad_k, cos, factor)
    return dq, dk


def _forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _rope_forward(q, k, cos, sin, position_ids, inplace=False)
    # The fake promises contiguous outputs; the reference's follow q's layout, so a transposed q is copied here.
    return q_out.contiguous(), k_out.contiguous()


def _backward_op(
    grad_q: torch.Tensor | None,
    grad_k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dk = _rope_backward(grad_q, grad_k, cos, sin, position_ids)
    # An op has no optional outputs: a missing gradient is an empty placeholder that autograd never sees.
    return tuple(cos.new_empty(0) if d is None else d.contiguous() for d in (dq, dk))


# The fakes: shapes and dtypes only (contiguous, as the implementations return them).
rope_op = define("rope", _forward_op, fake=lambda q, k, cos, sin, pos: (q.new_empty(q.shape), k.new_empty(k.shape)))
rope_backward_op = define(
    "rope_backward",
    _backward_op,
    fake=lambda grad_q, grad_k, cos, sin, pos: tuple(
        cos.new_empty(0) if g is None else g.new_empty(g.shape) for g in (grad_q, grad_k)
    ),
)


def _save(ctx: Any, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    ctx.save_for_backward(cos, sin, position_ids)
    # An output nobody used arrives as None instead of a zero tensor, and its half of the launch is skipped.
    ctx.set_materialize_grads(False)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _save(ctx, *inputs[2:5])


def _grad(
    ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
    """Gradients for (q, k, cos, sin, position_ids): no gradient flows to the tables (see :func:`apply_rope`)."""
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = pick(rope_backward_op, _rope_backward)(grad_q, grad_k, cos, sin, position_ids)
    return (None if grad_q is None else dq), (None if grad_k is None else dk), None, None, None


register_autograd(rope_op, _setup_context, _grad)


class RoPEFunction(torch.autograd.Function):
    """Rotary embedding of q and k with a gradient that saves only cos / sin (and position_ids).

    ``RoPEFunction.apply(q, k, cos, sin, position_ids, inplace) -> (q_out, k_out)``: the eager entry to the op
    ``fastft::rope`` (its forward and backward code without the dispatcher), plus the in-place mode an op cannot
    have. No gradient flows to cos or sin (they come from a no-grad rotary embedding); :func:`apply_rope` sends
    learnable tables to the reference. With ``inplace=True`` q and k must not be views while autograd records (a
    torch limit, see :func:`apply_rope`, which handles views).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None,
        inplace: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotated = _rope_forward(q, k, cos, sin, position_ids, inplace)
        _save(ctx, cos, sin, position_ids)
        if inplace:
            ctx.mark_dirty(q, k)
        return rotated

    @staticmethod
    @math_backward
    def backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (*_grad(ctx, grad_q, grad_k), None)


class _RoPEInPlaceQ(torch.autograd.Function):
    """In-place rotation of views, first half: one launch rotates q and k; this node owns q's history."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        # k is rotated here too; _RoPEInPlaceK, applied right after, tells autograd (no other op runs between).
        _rope_forward(q, k, cos, sin, position_ids, inplace=True)
        _save(ctx, cos, sin, position_ids)
        ctx.mark_dirty(q)
        return q

    @staticmethod
    @math_backward
    def backward(ctx: Any, grad_q: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _grad(ctx, grad_q, None)[0], None, None, None, None


class _RoPEInPlaceK(torch.autograd.Function):
    """In-place rotation of views, second half: k was rotated by _RoPEInPlaceQ's launch; this owns k's history."""

    @staticmethod
    def forward(
        ctx: Any, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        _save(ctx, cos, sin, position_ids)
        ctx.mark_dirty(k)
        return k

    @staticmethod
    @math_backward
    def backward(ctx: Any, grad_k: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _grad(ctx, None, grad_k)[1], None, None, None


_apply_rope = direct_apply(RoPEFunction)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their positions (Llama's rotate-half RoPE), both in one kernel launch.

    Args:
        q: Queries [batch, heads, seq, head_dim]; any strides (typically a transpose of [batch, seq, heads, hd]).
        k: Keys [batch, kv_heads, seq, head_dim]; kv_heads may differ from heads (GQA). Same dtype as q.
        cos: Gathered [batch or 1, seq, head_dim] (``LlamaRotaryEmbedding``'s output; batch 1 broadcasts), or,
            with position_ids, a table [max_positions, head_dim]. Any float dtype; used in fp32.
        sin: Same shape as cos.
        position_ids: Optional integer [batch or 1, seq]: the table row of each token, so packed rows whose
            positions restart mid-row work. Checked against the table length on the host (one sync).
        inplace: Rotate q and k in their own storage and return them (for callers that own the buffers; not
            for leaves that require grad). Values and gradients are the same either way.

    Returns:
        (q_rotated, k_rotated) with q's dtype; out of place they are new tensors of q's / k's shape (contiguous
        on the Triton path).

    Raises:
        ShapeContractError: Not 4-d, q / k batch or seq or head_dim mismatch, odd head_dim, cos / sin of the wrong
            shape, non-integer position_ids or ones outside the tables.
        ValueError: inplace=True with cos / sin that require grad.
    """
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        # A gradient for the tables needs q and k, which RoPEFunction deliberately does not keep.
        if inplace:
            raise ValueError(
                "fastft.kernels.rope.apply_rope: inplace=True cannot differentiate cos / sin (their gradient needs "
                "the unrotated q and k); detach the tables or use inplace=False"
            )
        return rope_reference(q, k, cos, sin, position_ids)
    if compiling():
        # Checked at trace time; position_ids are range-checked inside the op, when the data exists.
        _check("apply_rope", q, k, cos, sin, position_ids)
        # Gathered by position_ids, the tables stay inside the op, which range-checks the ids when they exist.
        traced = position_ids is None and traces_reference(q)
        q_rot, k_rot = (rope_reference if traced else rope_op)(q, k, cos, sin, position_ids)
        if inplace:
            # An op may not return its inputs: the graph rotates out of place and writes the result back, which the
            # compiler's functionalization turns into whatever in-place update it can prove safe.
            return q.copy_(q_rot), k.copy_(k_rot)
        return q_rot, k_rot
    if inplace and (q._base is not None or k._base is not None):
        # torch refuses a Function that modifies a view in place and returns more than one tensor (one view's history
        # per node), and transformers' q / k are views: one node launches and returns q, a compute-free one returns k.
        rotated_q = _RoPEInPlaceQ.apply(q, k, cos, sin, position_ids)
        return rotated_q, _RoPEInPlaceK.apply(k, cos, sin, position_ids)
    return _apply_rope(q, k, cos, sin, position_ids, inplace)


__all__ = ["RoPEFunction", "apply_rope", "rope_reference"]
