"""The fused kernels a patched module's plan calls: one callable per projection group, checked when the plan is made.

Each is a :class:`~fastft.kernels.LoRAGroup` (or :class:`~fastft.kernels.LoRAMLP`) built from the group's
:class:`~fastft.kernels.LoRAWeights`: shapes, dtypes and adapters are checked here, once, and a call checks only its
input. A plan keeps them until a projection's stamp changes (:mod:`fastft.patches.plans`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastft.kernels import LoRAGroup, LoRAMLP, LoRAWeights


def fused_qkv(
    names: Sequence[str], weights: Sequence[LoRAWeights]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """q, k and v in one launch: ``run(x) -> (q, k, v)``."""
    return LoRAGroup("lora_qkv", names, weights, "qkv")


def fused_packed_qkv(
    names: Sequence[str], weights: Sequence[LoRAWeights], widths: tuple[int, int, int]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """A packed q | k | v projection (Phi-3), split at ``widths``: ``run(x) -> (q, k, v)``."""
    return LoRAGroup("lora_packed_qkv", names, weights, "qkv", split=widths)


def fused_o_group(names: Sequence[str], weights: Sequence[LoRAWeights]) -> LoRAGroup:
    """The output projection's group: ``group(x) -> (y,)``."""
    return LoRAGroup("lora_o", names, weights, "o")


def fused_mlp(
    names: Sequence[str], weights: Sequence[LoRAWeights], activation: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated MLP over (gate, up, down) or a packed (gate_up, down): ``run(x) -> y``."""
    *gate_up, down = weights
    function = "lora_mlp" if len(gate_up) == 2 else "lora_gate_up_mlp"
    return LoRAMLP(
        LoRAGroup(function, names[:-1], gate_up, "gate_up"),
        LoRAGroup(function, names[-1:], (down,), "down"),
        activation,
    )
