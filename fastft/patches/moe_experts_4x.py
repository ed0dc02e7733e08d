"""transformers 4.x's per-expert MoE modules on the fused grouped-expert path (:mod:`fastft.kernels.lora_moe_experts`).

transformers 4.x (4.53 - 4.57) keeps a sparse block's experts as an ``nn.ModuleList`` of MLPs: Qwen3-MoE's
``Qwen3MoeMLP`` (``gate_proj``, ``up_proj``, ``down_proj``) and Mixtral's ``MixtralBlockSparseTop2MLP`` (``w1`` the
gate, ``w3`` the up, ``w2`` the down), and peft puts an ordinary LoRA Linear on each expert's projection. Upstream
runs them in a Python loop, one expert at a time. Here the base weights stay where they are: the grouped GEMMs read
them through an address table per role (:class:`~fastft.kernels.moe_expert_table.ExpertTable`: gate and up as the two
parts of gate | up, down alone), built once per decision; the adapters go to the kernel per call as stacks of peft's
own A / B (small: ``E · r · (H + I)`` per role), so gradients reach peft's tensors. Gate's and up's adapters become
the kernel's gate | up adapter: ``A = [A_gate; A_up]`` (``[E, r_g + r_u, H]``) and a block-diagonal
``B = [[B_gate, 0], [0, B_up]]`` (``[E, 2I, r_g + r_u]``), the same ``B·A`` as the two adapters apart.

What runs is decided once per block and kept in a :mod:`plan <fastft.patches.plans>` until the stamp changes. The
stamp holds, besides peft's state of every expert projection (:func:`~fastft.patches.lora_layers.projection_stamp`),
the address and dtype of every expert weight: ``model.to(...)``, ``.half()`` and ``param.data = ...`` keep each
Parameter but swap its storage, so the next call builds a new table instead of reading freed memory. Everything the
kernels cannot do runs upstream's loop, and ``patch_report`` names the block and why: 4-bit experts, a bias, another
activation, LoRA dropout in training, DoRA, several adapters, hooks, trainable base weights, experts of differing
shapes, adapters on some experts only, differing ranks or scales; and, per call, ``torch.compile`` (no custom op for
tables) and autocast to another dtype than the experts' (the grouped GEMMs take one dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from fastft.kernels.custom_ops import compiling
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_moe_experts import LoRAMoEExperts
from fastft.kernels.lora_projection import FLOAT_DTYPES, LoRAWeights, autocast_dtype, quant_state_of
from fastft.kernels.moe_expert_table import ExpertTable
from fastft.patches.lora_layers import (
    forward_replaced,
    group_weights,
    hooked,
    projection_objects,
    projection_stamp,
)
from fastft.patches.plans import planned

# Each known expert class's (gate, up, down) projections.
ROLES = {
    "Qwen3MoeMLP": ("gate_proj", "up_proj", "down_proj"),
    "MixtralBlockSparseTop2MLP": ("w1", "w3", "w2"),
}

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def roles_of(cls: type) -> tuple[str, ...] | None:
    """The (gate, up, down) projection names of an expert class: one of :data:`ROLES` or a subclass of one
    (fastft's own ``FastQwen3MoeMLP``, which the dense-MLP patch swaps onto Qwen3-MoE's experts too: same math)."""
    for klass in cls.__mro__:
        if klass.__name__ in ROLES:
            return ROLES[klass.__name__]
    return None


def _base_weight(projection: torch.nn.Module) -> torch.Tensor | None:
    base = projection.__dict__["_modules"].get("base_layer", projection)
    return base.__dict__["_parameters"].get("weight")


def _stamp(block: torch.nn.Module) -> tuple[Any, ...]:
    """Everything :func:`_decide` reads, by identity or value, and where every expert weight lives now."""
    parts: list[Any] = [torch.is_grad_enabled(), block.training]
    experts = block.__dict__["_modules"].get("experts")
    parts.append(id(experts))
    if experts is None:
        return tuple(parts)
    state = experts.__dict__
    parts += [len(state["_forward_hooks"]), len(state["_forward_pre_hooks"]), forward_replaced(state)]
    for expert in state["_modules"].values():
        modules = expert.__dict__["_modules"]
        parts += [id(expert), hooked(expert), id(modules.get("act_fn"))]
        for role in roles_of(type(expert)) or ():
            projection = modules.get(role)
            if projection is None:
                parts.append(None)
                continue
            parts += projection_stamp(projection)
            weight = _base_weight(projection)
            # The storage: a parameter whose data was swapped keeps its id but not its address.
            parts += (None, None) if weight is None else (weight.data_ptr(), weight.dtype)
    return tuple(parts)


def _objects(block: torch.nn.Module) -> list[Any]:
    experts = block.__dict__["_modules"].get("experts")
    if experts is None:
        return []
    objects: list[Any] = [experts]
    for expert in experts.children():
        objects += [expert, *expert.children()]
        for role in roles_of(type(expert)) or ():
            projection = getattr(expert, role, None)
            if projection is not None:
                objects += projection_objects(projection)
    return objects


def _silu(expert: torch.nn.Module) -> bool:
    act = expert.__dict__["_modules"].get("act_fn")
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


class _Role:
    """One role (gate, up or down) over every expert: base weights, and the adapters' A / B / scale if any."""

    __slots__ = ("a", "b", "scale", "weights")

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        self.scale: float | None = None


def _collect(experts: torch.nn.ModuleList, roles: tuple[str, ...], name: str) -> list[_Role] | str:
    collected = [_Role() for _ in roles]
    for index, expert in enumerate(experts):
        where = f"{name}.experts.{index}"
        if hooked(expert):
            return f"{where} has forward hooks or a replaced forward the fused path would bypass"
        if not _silu(expert):
            act = type(expert.__dict__["_modules"].get("act_fn")).__name__
            return f"{where}: activation {act} has no fused grouped-expert kernel (fused: SiLU)"
        group = group_weights(expert, roles)
        if isinstance(group, str):
            return f"{where}.{group}"
        for role, projection, into in zip(roles, group, collected, strict=True):
            if quant_state_of(projection) is not None:
                return (
                    f"{where}.{role} is a 4-bit ({type(getattr(expert, role)).__name__}) expert: the grouped kernels "
                    "take 16 / 32-bit expert weights"
                )
            if projection.weight.dtype not in FLOAT_DTYPES:
                return (
                    f"{where}.{role}'s weight is {projection.weight.dtype}: the grouped kernels take float32 / float16 "
                    "/ bfloat16 expert weights"
                )
            if projection.bias is not None:
                return f"{where}.{role} has a bias (the per-expert grouped path has none)"
            into.weights.append(projection.weight)
            if index > 0 and (projection.lora_a is not None) != bool(into.a):
                return f"{name}.experts: {role} has an active adapter on some experts and not on others"
            if projection.lora_a is None:
                continue
            if into.scale is not None and projection.scale != into.scale:
                return f"{name}.experts: {role}'s LoRA scales differ between experts ({into.scale}, {projection.scale})"
            if into.a and projection.lora_a.shape != into.a[0].shape:
                return f"{name}.experts: {role}'s LoRA ranks differ between experts"
            into.a.append(projection.lora_a)
            into.b.append(projection.lora_b)
            into.scale = projection.scale
    return collected


def gate_up_adapter(gate: _Role, up: _Role, inter: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's gate | up adapter from gate's and up's: ``A [E, r_g + r_u, H]`` and block-diagonal
    ``B [E, 2I, r_g + r_u]`` (stacks of peft's tensors as they are now, so gradients reach them)."""
    if not gate.a and not up.a:
        return None, None
    if gate.a and up.a:
        a_gate, a_up = torch.stack(gate.a), torch.stack(up.a)
        b_gate, b_up = torch.stack(gate.b), torch.stack(up.b)
        r_gate, r_up = a_gate.shape[1], a_up.shape[1]
        b = torch.cat((F.pad(b_gate, (0, r_up)), F.pad(b_up, (r_gate, 0))), dim=1)
        return torch.cat((a_gate, a_up), dim=1), b
    if gate.a:
        # Up has no adapter: its rows of B are zero.
        return torch.stack(gate.a), F.pad(torch.stack(gate.b), (0, 0, 0, inter))
    return torch.stack(up.a), F.pad(torch.stack(up.b), (0, 0, inter, 0))


def down_adapter(down: _Role) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's down adapter: ``A [E, r, I]`` and ``B [E, H, r]`` stacks of peft's tensors, or None."""
    if not down.a:
        return None, None
    return torch.stack(down.a), torch.stack(down.b)


class _Fused:
    """A 4.x block's fused experts: the kernel object over the address tables, and the roles whose adapters it
    stacks per call."""

    __slots__ = ("experts", "inter", "roles")

    def __init__(self, experts: LoRAMoEExperts, roles: list[_Role], inter: int) -> None:
        self.experts, self.roles, self.inter = experts, roles, inter

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.roles
        adapters = (*gate_up_adapter(gate, up, self.inter), *down_adapter(down))
        return self.experts(x, index, weights, adapters)


def _decide(block: torch.nn.Module, name: str) -> Run | str:
    """The block's fused experts, or the reason they run upstream's loop."""
    experts = block.__dict__["_modules"].get("experts")
    if not isinstance(experts, torch.nn.ModuleList) or len(experts) == 0:
        return f"{name}.experts is not a ModuleList of expert MLPs"
    if hooked(experts):
        return f"{name}.experts has forward hooks the fused path would bypass"
    kinds = {type(expert) for expert in experts}
    roles = roles_of(next(iter(kinds))) if len(kinds) == 1 else None
    if roles is None:
        known = " / ".join(ROLES)
        found = " / ".join(sorted(kind.__name__ for kind in kinds))
        return f"{name}.experts are {found} (fused: {known}, all of one class)"
    collected = _collect(experts, roles, name)
    if isinstance(collected, str):
        return collected
    gate, up, down = collected
    if gate.a and up.a and gate.scale != up.scale:
        return (
            f"{name}.experts: gate's and up's LoRA scales differ ({gate.scale}, {up.scale}); the fused gate | up "
            "takes one"
        )
    try:
        gate_up_table = ExpertTable([gate.weights, up.weights], f"{name}.experts.{roles[0]}|{roles[1]}")
        down_table = ExpertTable([down.weights], f"{name}.experts.{roles[2]}")
        inter = gate.weights[0].shape[0]
        a1, b1 = gate_up_adapter(gate, up, inter)
        a2, b2 = down_adapter(down)
        scale1 = gate.scale if gate.scale is not None else (up.scale if up.scale is not None else 1.0)
        kernel = LoRAMoEExperts(
            LoRAWeights(gate_up_table, a1, b1, scale1),
            LoRAWeights(down_table, a2, b2, down.scale if down.scale is not None else 1.0),
            "silu",
            name=f"{name}.experts",
        )
    except (ShapeContractError, TypeError, ValueError) as error:
        return str(error)
    return _Fused(kernel, collected, inter)


def experts_runner(block: torch.nn.Module, x: torch.Tensor) -> Run | None:
    """The block's kept fused experts for hidden states ``x``, or None when upstream's loop runs (the reason is in
    ``patch_report``; under ``torch.compile``, or autocast to another dtype than the experts', it runs too)."""
    if compiling():
        # The address tables have no custom op: under torch.compile the block runs upstream's loop.
        return None
    name = type(block).__name__
    decided = planned(block, _stamp(block), lambda: (_decide(block, name), _objects(block)))
    if isinstance(decided, str):
        return None
    autocast = autocast_dtype(x)
    if autocast is not None and autocast != decided.experts.gate_up.weight.dtype:
        # The grouped GEMMs take one dtype; upstream's loop lets autocast cast each expert's matmul.
        return None
    return decided


def experts_reason(block: torch.nn.Module, name: str) -> str | None:
    """Why the block's experts run upstream's loop, or None when they are fused."""
    decided = _decide(block, name)
    return decided if isinstance(decided, str) else None


__all__ = ["ROLES", "roles_of", "down_adapter", "experts_reason", "experts_runner", "gate_up_adapter"]
