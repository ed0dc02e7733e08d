"""A fused LoRA group's tensors as custom-op arguments and back, and the autograd glue the group ops share.

A custom op takes only tensors, ints, floats and lists of them, so :func:`flatten_group` turns a group's
:class:`~fastft.kernels.lora_projection.LoRAWeights` into flat tensor lists and a ``layout`` of ints
(:data:`fastft.kernels.lora_math.LAYOUT_FIELDS` per segment), and :func:`op_spec`, :func:`quant_states_from` and
:func:`biases_from` rebuild inside the op what :mod:`fastft.kernels.lora_math` computes with. ``fastft::lora_group``
and ``fastft::lora_mlp`` take the same lists, so their autograd formulas share the helpers at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels.lora_math import LAYOUT_FIELDS, Spec
from fastft.kernels.lora_projection import LoRAWeights, is_packed, quant_state_of, weight_shape
from fastft.kernels.nf4 import _resolve


class _State2:
    """The nested part of a bitsandbytes QuantState, as :mod:`fastft.kernels.nf4` reads it."""

    __slots__ = ("absmax", "blocksize", "code")

    def __init__(self, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> None:
        self.absmax, self.code, self.blocksize = absmax, code, blocksize


class QuantStateStandIn:
    """The attributes of a bitsandbytes NF4 QuantState that :mod:`fastft.kernels.nf4` reads, rebuilt inside a custom
    op from its tensor and int arguments (an op takes no Python objects)."""

    __slots__ = ("absmax", "blocksize", "dtype", "nested", "offset", "quant_type", "shape", "state2")

    def __init__(
        self,
        absmax: torch.Tensor,
        shape: tuple[int, int],
        blocksize: int,
        offset: torch.Tensor | None,
        state2: _State2 | None,
    ) -> None:
        self.absmax, self.shape, self.blocksize = absmax, torch.Size(shape), blocksize
        self.offset, self.state2, self.nested = offset, state2, state2 is not None
        # Checked on the real quant_state when the op's arguments were built (flatten_group).
        self.quant_type = "nf4"
        self.dtype = None


def flatten_group(projections: Sequence[LoRAWeights], dtype: torch.dtype) -> dict[str, Any]:
    """A group's tensors and layout as custom-op arguments: ``weights``, ``lora_a``, ``lora_b``, ``biases`` (only
    those present), ``nf4`` (per NF4 segment its absmax, then, double-quantised, state2.absmax, state2.code and the
    offset), ``layout`` (:data:`LAYOUT_FIELDS` ints per segment) and ``scales``.

    Each NF4 quant_state goes through the same checks (and messages) as an eager call's dequantisation first, since
    the op only sees the stand-in rebuilt from these arguments.
    """
    weights, lora_a, lora_b, biases, nf4, layout, scales = [], [], [], [], [], [], []
    for projection in projections:
        out_features, in_features = weight_shape(projection)
        weights.append(projection.weight)
        rank = -1
        if projection.lora_a is not None:
            lora_a.append(projection.lora_a)
            lora_b.append(projection.lora_b)
            rank = projection.lora_a.shape[0]
        if projection.bias is not None:
            biases.append(projection.bias)
        blocksize = blocksize2 = 0
        if is_packed(projection):
            state = quant_state_of(projection)
            resolved = _resolve("dequantize_nf4", projection.weight, state, dtype)
            blocksize = int(state.blocksize)
            nf4.append(state.absmax)
            if resolved.nested:
                offset = state.offset
                if not isinstance(offset, torch.Tensor):
                    offset = torch.tensor(float(offset), dtype=torch.float32, device=state.absmax.device)
                nf4 += [state.state2.absmax, state.state2.code, offset]
                blocksize2 = int(state.state2.blocksize)
        layout += [out_features, in_features, rank, int(projection.bias is not None), blocksize, blocksize2]
        scales.append(float(projection.scale))
    return {
        "weights": weights,
        "lora_a": lora_a,
        "lora_b": lora_b,
        "biases": biases,
        "nf4": nf4,
        "layout": layout,
        "scales": scales,
    }


def segments(layout: Sequence[int]) -> list[Sequence[int]]:
    """``layout`` cut into one :data:`LAYOUT_FIELDS`-tuple per segment."""
    return [layout[i : i + LAYOUT_FIELDS] for i in range(0, len(layout), LAYOUT_FIELDS)]


_op_specs: dict[tuple, Spec] = {}


def op_spec(group: str, layout: Sequence[int], scales: Sequence[float]) -> Spec:
    """The :class:`Spec` of a custom op's group, one per (group, layout, scales): its GEMM memo outlives the call."""
    key = (group, tuple(layout), tuple(scales))
    spec = _op_specs.get(key)
    if spec is None:
        parts = segments(layout)
        spec = _op_specs[key] = Spec(
            group,
            [p[0] for p in parts],
            [p[1] for p in parts],
            [None if p[2] < 0 else p[2] for p in parts],
            scales,
            [p[4] > 0 for p in parts],
        )
    return spec


def quant_states_from(layout: Sequence[int], nf4: Sequence[torch.Tensor]) -> list[QuantStateStandIn | None]:
    """Per segment the NF4 quant_state stand-in rebuilt from an op's ``layout`` and ``nf4`` arguments, or None."""
    states: list[QuantStateStandIn | None] = []
    position = 0
    for out_features, in_features, _, _, blocksize, blocksize2 in segments(layout):
        if not blocksize:
            states.append(None)
            continue
        absmax = nf4[position]
        position += 1
        state2 = offset = None
        if blocksize2:
            state2 = _State2(nf4[position], nf4[position + 1], blocksize2)
            offset = nf4[position + 2]
            position += 3
        states.append(QuantStateStandIn(absmax, (out_features, in_features), blocksize, offset, state2))
    return states


def biases_from(layout: Sequence[int], biases: Sequence[torch.Tensor]) -> list[torch.Tensor | None] | None:
    """Per segment the bias or None, from an op's ``biases`` (those present) and ``layout``; None without any."""
    if not biases:
        return None
    present = iter(biases)
    return [next(present) if part[3] else None for part in segments(layout)]


# The autograd glue both group ops share (fastft::lora_group and fastft::lora_mlp take the same tensor lists).


def saved_lists(rest: Sequence[torch.Tensor], counts: Sequence[int]) -> tuple[Sequence[torch.Tensor], ...]:
    """``(weights, lora_a, lora_b, nf4)`` from the tensors an op's setup saved after its activations, as
    ``(*weights, *lora_a, *lora_b, *nf4)`` with ``counts = (weights, adapters, biases, nf4)``."""
    n, count, _, n_nf4 = counts
    return rest[:n], rest[n : n + count], rest[n + count : n + 2 * count], rest[n + 2 * count : n + 2 * count + n_nf4]


def needs_of(ctx: Any) -> list[bool]:
    """``[needs dX, needs (dA, dB) per adapter]`` of an op whose inputs start ``(x, weights, lora_a, lora_b, ...)``."""
    needs = ctx.needs_input_grad
    return [bool(needs[0]), *(bool(a or b) for a, b in zip(needs[2], needs[3], strict=True))]


def input_gradients(result: Sequence[torch.Tensor], needs: Sequence[bool], counts: Sequence[int], trailing: int):
    """The registered backward's return from the backward op's ``[dX, dA..., dB...]``: one gradient per input, a list
    per list input (autograd matches the structures), None where none was wanted; ``trailing`` scalar inputs last."""
    n, count, n_biases, n_nf4 = counts
    lora_needs = needs[1:]
    grad_a = [g if wants else None for g, wants in zip(result[1 : 1 + count], lora_needs, strict=True)]
    grad_b = [g if wants else None for g, wants in zip(result[1 + count :], lora_needs, strict=True)]
    return (result[0] if needs[0] else None, [None] * n, grad_a, grad_b, [None] * n_biases, [None] * n_nf4) + (
        None,
    ) * trailing


def gradient_list(
    x: torch.Tensor,
    grad_x: torch.Tensor | None,
    grad_a: Sequence[torch.Tensor | None],
    grad_b: Sequence[torch.Tensor | None],
) -> list[torch.Tensor]:
    """A backward op's output ``[dX, dA..., dB...]``: an op has no optional outputs, so a gradient nobody wants is an
    empty placeholder (dropped again by :func:`input_gradients`)."""
    empty = x.new_empty(0)
    grad_x = empty if grad_x is None else grad_x.view(x.shape)
    return [grad_x, *[empty if g is None else g for g in grad_a], *[empty if g is None else g for g in grad_b]]


def fake_gradient_list(
    x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], needs: Sequence[bool]
) -> list[torch.Tensor]:
    """What :func:`gradient_list` returns, as shapes only (the backward ops' fake implementations)."""
    grad_x = torch.empty_like(x) if needs[0] else x.new_empty(0)
    lora_needs = needs[1:]
    grad_a = [torch.empty_like(a) if wants else a.new_empty(0) for a, wants in zip(lora_a, lora_needs, strict=True)]
    grad_b = [torch.empty_like(b) if wants else b.new_empty(0) for b, wants in zip(lora_b, lora_needs, strict=True)]
    return [grad_x, *grad_a, *grad_b]


__all__ = [
    "QuantStateStandIn",
    "biases_from",
    "fake_gradient_list",
    "flatten_group",
    "gradient_list",
    "input_gradients",
    "needs_of",
    "op_spec",
    "quant_states_from",
    "saved_lists",
    "segments",
]
