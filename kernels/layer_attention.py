"""The attention inside a fused decoder layer: run with autograd over q, k and v alone, and differentiated back.

The attention stays the caller's (eager, sdpa, flash, a sliding window, dropout), so the fused layer
(:mod:`fastft.kernels.lora_decoder_layer`, and its straight-line programs, :mod:`fastft.kernels.lora_layer_program`)
does not write its backward: it records the attention's own small graph in the forward and walks it back in the
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# attend(q, k, v) -> the attention output as [batch, seq, heads · head_dim] (what the o projection reads).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_attention(
    attend: Attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, record: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """``(attention output, graph)``: with ``record``, the output detached from the attention's own graph over q, k
    and v only, kept as ``graph = (q, k, v, out)`` for :func:`attention_backward`; without, the plain output and None.
    """
    if not record:
        return attend(query, key, value), None
    # Its backward is the one thing autograd differentiates in a fused layer.
    with torch.enable_grad():
        query, key, value = query.requires_grad_(), key.requires_grad_(), value.requires_grad_()
        out = attend(query, key, value)
    return out.detach(), (query, key, value, out)


def graph_backward(ctx: Any, grad: torch.Tensor, backward: Any) -> list[torch.Tensor | None]:
    """The q, k and v gradients through the graph :func:`run_attention` kept on ``ctx.graph``, from the gradient of
    the attention output as the o projection reads it (``[tokens, heads · head_dim]``); ``backward`` is
    :func:`attention_backward` (passed in, so that a test can watch the caller's). The graph is spent: a second
    backward finds ``ctx.graph`` None."""
    query, key, value, out = ctx.graph
    ctx.graph = None
    grad_out = grad.view(out.shape)
    if grad_out.dtype != out.dtype:
        grad_out = grad_out.to(out.dtype)
    return backward(out, (query, key, value), grad_out)


def attention_backward(
    out: torch.Tensor, leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor | None]:
    """The gradients of q, k and v (``leaves``) from the attention's output gradient.

    The graph ``attend`` built is usually a chain: the attention kernel's node over the three leaves, then the views,
    transposes and copies that lay its output out. A chain is differentiated by calling its nodes in turn, which costs
    a fraction of a pass of the autograd engine (its graph task, ready queue and input buffers) on every layer of
    every step. Anything else (repeated k / v heads, eager attention's matmuls, a mask that needs a gradient) goes
    through ``torch.autograd.grad``.
    """
    # A node called by hand takes the gradient of its first output only.
    chain, ends = _chain(out.grad_fn, leaves) if out.output_nr == 0 else (None, [])
    if chain is None:
        return list(torch.autograd.grad(out, leaves, grad, allow_unused=True))
    flowing = grad
    for node in chain[:-1]:
        flowing = _as_tuple(node(flowing))[0]
    found: list[torch.Tensor | None] = [None, None, None]
    for end, value in zip(ends, _as_tuple(chain[-1](flowing)), strict=True):
        if end >= 0:
            found[end] = value
    if any(value is None for value in found):
        # Inside another backward that asked for some gradients only (torch.autograd.grad with inputs=, as a
        # checkpoint's recompute does), a node called by hand computes only what that pass needs: none of this.
        return list(torch.autograd.grad(out, leaves, grad, allow_unused=True))
    return found


def _chain(node: Any, leaves: tuple[torch.Tensor, ...]) -> tuple[list[Any] | None, list[int]]:
    """The nodes from ``node`` down to the one whose every input is a leaf (or needs no gradient), with the leaf
    index of each of that node's inputs; ``(None, [])`` where the graph branches or ends elsewhere."""
    chain = []
    while node is not None:
        chain.append(node)
        edges = node.next_functions
        ends = [_leaf_index(function, leaves) for function, _ in edges]
        if all(end is not None for end in ends):
            return chain, ends
        if len(edges) != 1 or edges[0][1] != 0:
            return None, []
        node = edges[0][0]
    return None, []


def _leaf_index(function: Any, leaves: tuple[torch.Tensor, ...]) -> int | None:
    """Which leaf an edge ends in (-1: an input that needs no gradient), or None for any other node."""
    if function is None:
        return -1
    variable = getattr(function, "variable", None)
    if variable is None:
        return None
    for index, leaf in enumerate(leaves):
        if variable is leaf:
            return index
    return None


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


__all__ = ["Attend", "attention_backward", "graph_backward", "run_attention"]
