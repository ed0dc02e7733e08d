"""The fused kernels a patched module's plan calls: one callable per projection group, built when the plan is made.

Interim: wraps the per-call kernel functions (each checks its weights on every call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastft.kernels import LoRAWeights, lora_gate_up_mlp, lora_mlp, lora_o, lora_packed_qkv, lora_qkv


def fused_qkv(weights: Sequence[LoRAWeights]) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    q, k, v = weights
    return lambda x: lora_qkv(x, q, k, v)


def fused_packed_qkv(
    weights: Sequence[LoRAWeights], widths: tuple[int, int, int]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    (qkv,) = weights
    return lambda x: lora_packed_qkv(x, qkv, widths)


def fused_o(weights: Sequence[LoRAWeights]) -> Callable[[torch.Tensor], torch.Tensor]:
    (o,) = weights
    return lambda x: lora_o(x, o)


def fused_mlp(weights: Sequence[LoRAWeights], activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if len(weights) == 2:
        gate_up, down = weights
        return lambda x: lora_gate_up_mlp(x, gate_up, down, activation=activation)
    gate, up, down = weights
    return lambda x: lora_mlp(x, gate, up, down, activation=activation)
