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

    The graph ``attend`` built is usually a chain with short branches: the views, transposes and copies that lay the
    output out, down to the attention kernel's node; below it, each of its inputs is a leaf or a short chain down to
    one (transformers' ``repeat_kv`` expanding k and v to every query head, which its sdpa path takes whenever a mask
    is passed: any padded batch). Such a graph is differentiated by calling its nodes in turn, which costs a fraction
    of a pass of the autograd engine (its graph task, ready queue and input buffers) on every layer of every step.
    Anything else (eager attention's matmuls, a mask that needs a gradient) goes through ``torch.autograd.grad``.
    """
    # A node called by hand takes the gradient of its first output only.
    route = _route(out.grad_fn, leaves) if out.output_nr == 0 else None
    if route is None:
        return list(torch.autograd.grad(out, leaves, grad, allow_unused=True))
    chain, branches = route
    flowing = grad
    for node in chain[:-1]:
        flowing = _as_tuple(node(flowing))[0]
    found: list[torch.Tensor | None] = [None, None, None]
    for (path, end), value in zip(branches, _as_tuple(chain[-1](flowing)), strict=True):
        if end < 0:
            continue
        for node in path:
            if value is None:
                break
            value = _as_tuple(node(value))[0]
        if value is not None:
            found[end] = value if found[end] is None else found[end] + value
    if any(value is None for value in found):
        # Inside another backward that asked for some gradients only (torch.autograd.grad with inputs=, as a
        # checkpoint's recompute does), a node called by hand computes only what that pass needs: none of this.
        return list(torch.autograd.grad(out, leaves, grad, allow_unused=True))
    return found


# The longest branch below the attention node walked by hand (repeat_kv's is four nodes).
_MAX_BRANCH = 8


def _route(node: Any, leaves: tuple[torch.Tensor, ...]) -> tuple[list[Any], list[tuple[list[Any], int]]] | None:
    """``(chain, branches)``: the single-input nodes from ``node`` down to the first node with several inputs or
    with leaves only (the chain's last node), and per input of that node the single-input nodes down to a leaf with
    the leaf's index (-1: an input that needs no gradient). None where the graph has any other shape."""
    chain = []
    while node is not None:
        chain.append(node)
        edges = node.next_functions
        ends = [_leaf_index(function, leaves) for function, _ in edges]
        if len(edges) == 1 and ends[0] is None:
            if edges[0][1] != 0:
                return None
            node = edges[0][0]
            continue
        branches = []
        for (function, output), end in zip(edges, ends, strict=True):
            path = []
            while end is None:
                # Each node on a branch must hand its first output's gradient on, and take one input.
                if output != 0 or len(path) >= _MAX_BRANCH:
                    return None
                path.append(function)
                below = function.next_functions
                if len(below) != 1:
                    return None
                function, output = below[0]
                end = _leaf_index(function, leaves)
            branches.append((path, end))
        return chain, branches
    return None


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
