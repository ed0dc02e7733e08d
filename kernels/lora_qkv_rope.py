"""LoRA-QKV with the rotary embedding in the same autograd node: ``q, k, v`` of an attention in the layout the
attention function reads (``[batch, heads, seq, head_dim]``), q and k already rotated.

Unfused, an attention layer runs the LoRA-QKV node, three views and three transposes (each its own autograd node),
then the RoPE node; their backward walks the same chain in reverse. Here one node does all of it: the group's math
(:mod:`fastft.kernels.lora_math`), then RoPE over the fresh q and k buffers (the Triton kernel in place, or the
reference's four ops per tensor on the CPU path), and hands out transposed views. Backward rotates ``dq`` / ``dk`` back
(the transpose of the rotation), lays the gradients out as ``[tokens, width]`` again and runs the group's backward.
Saved: X, the small X Aᵀ, the adapters and the cos / sin tables; never q, k or v.

Under ``torch.compile`` the same call composes the group's custom op, the views and ``fastft::rope``, which the
compiler fuses itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import below_autograd, compiling, direct_apply, math_backward
from fastft.kernels.lora_group import LoRAGroup
from fastft.kernels.lora_projection import autocast_dtype, autocast_off
from fastft.kernels.rope import _checked, _compute_dtype, _launch, _reference_tables, _rotate, apply_rope


def _per_head(outputs: list[torch.Tensor], batch: int, seq: int, head_dim: int) -> list[torch.Tensor]:
    # [tokens, heads · head_dim] is [batch, seq, heads, head_dim] in memory; the attention reads it transposed.
    return [out.view(batch, seq, -1, head_dim).transpose(1, 2) for out in outputs]


class LoRAQKVRoPEFunction(torch.autograd.Function):
    """Eager node of :func:`lora_qkv_rope`: arguments ``(x, group, cos, sin, head_dim, *A's, *B's)``, outputs
    ``(q, k, v)`` as ``[batch, heads, seq, head_dim]`` views (q and k rotated)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: LoRAGroup,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_dim: int,
        *adapters: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x2d = x.reshape(-1, x.shape[-1])
        ctx.casts = {}
        # x2d (saved) is made above below_autograd(): a saved view of an input shares the input's version counter.
        with below_autograd():
            q, k, v, xa = qkv_rope_forward(group, x2d, x.shape[0], x.shape[1], cos, sin, head_dim, adapters, ctx.casts)
        ctx.group = group
        ctx.shape = (x.shape[0], x.shape[1], x.shape[-1])
        ctx.save_for_backward(x2d, xa, cos, sin, *adapters)
        ctx.set_materialize_grads(False)
        return q, k, v

    @staticmethod
    @math_backward
    def backward(
        ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x2d, xa, cos, sin, *adapters = ctx.saved_tensors
        # Inputs: x, group, cos, sin, head_dim, then the A's and B's.
        grad_x, grad_a, grad_b = qkv_rope_backward(
            ctx.group, x2d, xa, cos, sin, adapters, (grad_q, grad_k, grad_v), ctx.needs_input_grad, 5, ctx.casts
        )
        if grad_x is not None:
            grad_x = grad_x.view(ctx.shape)
        return (grad_x, None, None, None, None, *grad_a, *grad_b)


def qkv_rope_forward(
    group: LoRAGroup,
    x2d: torch.Tensor,
    batch: int,
    seq: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    adapters: Sequence[torch.Tensor],
    casts: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The node's forward math (shared with :mod:`fastft.kernels.lora_decoder_layer`): ``(q, k, v, xa)`` of
    ``x2d [batch · seq, hidden]``, q / k / v as ``[batch, heads, seq, head_dim]`` views, q and k rotated; ``xa`` is
    what the backward needs besides x2d, the adapters and the tables."""
    outputs, xa = group.forward_math(x2d, adapters, casts)
    if group.split is not None:
        # A packed q | k | v projection (Phi-3) has one output: its column blocks, as views.
        outputs = outputs[0].split(group.split, dim=1)
    q, k, v = _per_head(outputs, batch, seq, head_dim)
    _checked("lora_qkv_rope", q, k, cos, sin, None)
    if dispatch.use_triton(q):
        # The buffers are this node's own: rotated where they are, in one launch.
        _launch(q, k, q, k, cos, sin, None, backward=False)
    else:
        table, factor = _reference_tables(cos, sin, None, _compute_dtype(q.dtype), backward=False)
        q, k = _rotate(q, table, factor), _rotate(k, table, factor)
    return q, k, v, xa


def qkv_rope_backward(
    group: LoRAGroup,
    x2d: torch.Tensor,
    xa: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    adapters: Sequence[torch.Tensor],
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    needs: Sequence[bool],
    first: int,
    casts: dict[str, Any] | None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The node's backward math: ``(dX [tokens, hidden] or None, [dA], [dB])`` from the q / k / v gradients
    (``[batch, heads, seq, head_dim]``, None where an output got none). ``needs`` / ``first``: as for
    :meth:`LoRAGroup.backward_math`."""
    grad_q, grad_k, grad_v = grads
    tokens = x2d.shape[0]
    present = next(g for g in grads if g is not None)
    if grad_q is not None or grad_k is not None:
        if dispatch.use_triton(present):
            # Written as [batch, seq, heads, head_dim]: the [tokens, width] view below is then free.
            rotated = []
            for grad in (grad_q, grad_k):
                if grad is None:
                    rotated.append(None)
                    continue
                b, h, s, d = grad.shape
                rotated.append(dispatch.empty((b, s, h, d), dtype=grad.dtype, device=grad.device).transpose(1, 2))
            _launch(grad_q, grad_k, rotated[0], rotated[1], cos, sin, None, backward=True)
            grad_q, grad_k = rotated
        else:
            table, factor = _reference_tables(cos, sin, None, _compute_dtype(present.dtype), backward=True)
            grad_q = None if grad_q is None else _rotate(grad_q, table, factor)
            grad_k = None if grad_k is None else _rotate(grad_k, table, factor)
    flat = [None if g is None else g.transpose(1, 2).reshape(tokens, -1) for g in (grad_q, grad_k, grad_v)]
    if group.split is not None:
        parts = [x2d.new_zeros(tokens, w) if g is None else g for g, w in zip(flat, group.split, strict=True)]
        flat = [torch.cat(parts, dim=1)]
    return group.backward_math(x2d, xa, adapters, flat, needs, first, casts)


_apply = direct_apply(LoRAQKVRoPEFunction)


def lora_qkv_rope(
    group: LoRAGroup, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of an attention through a q | k | v :class:`LoRAGroup`, q and k rotated, in one autograd node.

    Args:
        group: The attention's q, k, v group (three projections, or one packed projection built with ``split=``).
        x: Hidden states ``[batch, seq, hidden]``.
        cos: Gathered ``[batch or 1, seq, head_dim]`` (the rotary embedding's output; no gradient flows to it).
        sin: Same shape as cos.
        head_dim: The attention's head_dim; the q width is heads · head_dim, the k and v widths kv_heads · head_dim.

    Returns:
        ``(q, k, v)`` as ``[batch, heads, seq, head_dim]``, ``[batch, kv_heads, seq, head_dim]`` twice: what
        ``group(x)`` viewed per head and transposed, then :func:`~fastft.kernels.apply_rope`, would give.

    Raises:
        ShapeContractError: x does not fit the group, or cos / sin do not fit q and k (see ``apply_rope``).
        TypeError, ValueError: See :meth:`LoRAGroup.check_input`.

    Tables that require grad take the unfused chain (the group, then ``apply_rope``'s reference, which differentiates
    through them).
    """
    if compiling() or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)):
        # Traced: the group's op, views and the rope op. Learnable tables: apply_rope's reference differentiates
        # through them.
        q, k, v = _per_head(group(x), x.shape[0], x.shape[1], head_dim)
        q, k = apply_rope(q, k, cos, sin)
        return q, k, v
    group.check_input(x)
    dtype = autocast_dtype(x)
    if dtype is None:
        return _apply(x, group, cos, sin, head_dim, *group._adapters)
    with autocast_off(x):
        return _apply(x.to(dtype), group, cos, sin, head_dim, *group._adapters)


__all__ = ["LoRAQKVRoPEFunction", "lora_qkv_rope", "qkv_rope_backward", "qkv_rope_forward"]
