"""What ``torch.compile`` traces where a kernel's dispatch is the torch reference: plain differentiable torch math.

Where a kernel runs as Triton, the compiled graph holds it as one custom op (:mod:`fastft.kernels.custom_ops`): the
compiler cannot see into a Triton launch, and the op keeps fastft's own backward. Where the dispatch is the torch
reference (a CPU, ``FASTFT_DISABLE_TRITON=1``), the op's implementation is itself a few aten calls made from Python,
and as an op it stays opaque: every call of the compiled layer runs the custom-op machinery (redispatch, autograd
wrapper, alias checks) around that Python, forward and backward. Measured on the CPU host benchmark (16-layer tiny
Llama, torch 2.13), the compiled fastft layer took longer than the eager one (87 ms a step against 45). Traced as aten
ops instead, the compiler sees the whole layer: it fuses the elementwise work between the GEMMs, derives the
backward itself, and the compiled layer runs without Python in it.

So each kernel's public function, while compiling, asks :func:`traces_reference` of its input first. The answer is
read at trace time, so it is part of what the compiled graph was traced for (dynamo guards the switch below).
:func:`opaque_reference` keeps the custom ops on the reference path too: the tests that check the ops' graphs, fake
implementations and autograd formulas use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from fastft.kernels import dispatch
from fastft.kernels.custom_ops import compiling

# Set by opaque_reference(); a plain module attribute, so a traced read of it is guarded.
_opaque = {"depth": 0}


def traces_reference(tensor: torch.Tensor) -> bool:
    """Whether a kernel called on ``tensor`` is being traced on the torch-reference path, and so should trace its
    plain-torch math rather than its custom op."""
    return compiling() and _opaque["depth"] == 0 and not dispatch.use_triton(tensor)


@contextlib.contextmanager
def opaque_reference() -> Iterator[None]:
    """Within this block a traced kernel on the torch-reference path is its custom op, as on the Triton path."""
    _opaque["depth"] += 1
    try:
        yield
    finally:
        _opaque["depth"] -= 1


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def group_outputs(group: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """A :class:`~fastft.kernels.lora_group.LoRAGroup` on ``x`` as peft computes it, one output per projection in x's
    dtype (adapters, weights and biases cast to it, as the fused group casts them); None for a group with an NF4 base,
    whose dequantisation stays inside the group's op."""
    if any(state is not None for state in group._quant_states):
        return None
    dtype = x.dtype
    adapted = [projection for projection in group.projections if projection.lora_a is not None]
    if len(adapted) > 1:
        # One X [A_0; A_1; …]ᵀ for the group, as the fused group computes it: one GEMM instead of one per projection,
        # forward and in both GEMMs of its backward (dX and the stacked dA).
        stacked = torch.cat([_as(projection.lora_a, dtype) for projection in adapted])
        pieces = iter(F.linear(x, stacked).split([projection.lora_a.shape[0] for projection in adapted], dim=-1))
    else:
        pieces = iter(F.linear(x, _as(projection.lora_a, dtype)) for projection in adapted)
    outputs = []
    for projection in group.projections:
        bias = None if projection.bias is None else _as(projection.bias, dtype)
        out = F.linear(x, _as(projection.weight, dtype), bias)
        if projection.lora_a is not None:
            out = out + projection.scale * F.linear(next(pieces), _as(projection.lora_b, dtype))
        outputs.append(out)
    return tuple(outputs)


def mlp_output(
    mlp: Any, x: torch.Tensor, gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """A :class:`~fastft.kernels.lora_mlp.LoRAMLP` on ``x``: ``down(gate(gate_proj(x), up_proj(x)))`` with each
    projection's LoRA term, ``gate`` the public gate kernel of the MLP's activation (which, being traced on the
    reference path too, traces its own plain-torch math); None where a group has an NF4 base (see
    :func:`group_outputs`)."""
    gate_up = group_outputs(mlp.gate_up, x)
    if gate_up is None:
        return None
    if len(gate_up) == 2:
        gate_in, up = gate_up
    else:
        # One packed gate_up projection (Phi-3): gate is the first half of its output, up the second.
        gate_in, up = gate_up[0].chunk(2, dim=-1)
    down = group_outputs(mlp.down, gate(gate_in, up))
    return None if down is None else down[0]


__all__ = ["group_outputs", "mlp_output", "opaque_reference", "traces_reference"]
