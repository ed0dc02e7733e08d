"""A sparse MoE block's experts on the fused grouped-expert path (:mod:`fastft.kernels.lora_moe_experts`).

transformers 5.x stores a block's experts as two 3-D parameters; peft puts LoRA on them by wrapping the experts
module once per parameter (``ParamWrapper``, ``target_parameters``), and its forward adds ``B·A`` to the whole
expert stack before running it, a second copy of every expert's weights each forward. The block here runs the router
as upstream does, then hands the router's choice to one :class:`~fastft.kernels.lora_moe_experts.LoRAMoEExperts`
call: tokens sorted by expert once, one grouped GEMM for gate | up and one for down, each expert's LoRA in the same
pass, the router weight in the down GEMM's epilogue.

peft keeps the E adapters of a wrapper stacked: ``lora_A.weight [r·E, in]`` is ``[E, r, in]`` row-major, and
``lora_B.weight [out, r·E]`` holds expert e's B in columns ``j·E + e``; the kernels take ``A [E, r, in]`` and
``B [E, out, r]``, made per call as views of the parameters, so gradients reach peft's own tensors.

What runs is decided once per block and kept in a :mod:`plan <fastft.patches.plans>` until the stamp changes (an
adapter switched, disabled or merged, a hook added, a parameter swapped, grad mode). Anything the kernels cannot do
runs upstream's experts through peft instead, and ``patch_report`` names the block and why: 4-bit experts, another
activation, LoRA dropout, DoRA, several adapters, hooks on the experts. gpt-oss's experts (stored ``[in, out]``,
gate and up interleaved, with biases and a clamped SwiGLU) go to the kernel as transposed views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastft.contracts.moe import experts_transposed
from fastft.kernels.custom_ops import compiling
from fastft.kernels.lora_moe_experts import LoRAMoEExperts
from fastft.kernels.lora_projection import LoRAWeights
from fastft.patches.lora_layers import forward_replaced, hooked
from fastft.patches.plans import planned

_ROLES = ("gate_up_proj", "down_proj")

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _wrapper_chain(experts: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]] | str:
    """The experts module beneath peft's wrappers and the wrapper of each targeted parameter, or why not."""
    wrappers: dict[str, torch.nn.Module] = {}
    module = experts
    while "base_layer" in module._modules:
        name = getattr(module, "parameter_name", None)
        if name not in _ROLES or name in wrappers:
            return f"{type(module).__name__} around the experts is not peft's ParamWrapper on {' / '.join(_ROLES)}"
        wrappers[name] = module
        module = module._modules["base_layer"]
    return module, wrappers


def _adapter(wrapper: torch.nn.Module, label: str) -> tuple[Any, ...] | str | None:
    """``(A, B, scale)`` of the wrapper's one active adapter, None when no LoRA term applies, or why not fused."""
    if hooked(wrapper):
        return f"{label} has forward hooks the fused path would bypass"
    if getattr(wrapper, "merged", False):
        return f"{label}: adapter merged into the expert weights"
    if getattr(wrapper, "disable_adapters", False):
        return None
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if len(active) > 1:
        return f"{label}: {len(active)} active adapters"
    if not active:
        return None
    name = active[0]
    if wrapper.use_dora.get(name, False):
        return f"{label}: DoRA"
    if getattr(wrapper, "lora_variant", {}).get(name) is not None:
        return f"{label}: a LoRA variant"
    if getattr(wrapper, "lora_bias", {}).get(name, False):
        return f"{label}: LoRA bias"
    dropout = wrapper.lora_dropout[name]
    if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
        return f"{label}: lora_dropout p={dropout.p} (fused only without dropout)"
    if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
        return f"{label}: lora_dropout is {type(dropout).__name__}"
    a, b = wrapper.lora_A[name], wrapper.lora_B[name]
    if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear:
        return f"{label}: LoRA A / B are not nn.Linear"
    return a.weight, b.weight, float(wrapper.scaling[name])


def _stamp(block: torch.nn.Module) -> tuple[Any, ...]:
    # Everything _decide reads, by identity or value; equal stamps give equal decisions.
    parts: list[Any] = [torch.is_grad_enabled(), block.training]
    module = block._modules.get("experts")
    while module is not None:
        state = module.__dict__
        parts += [id(module), len(state["_forward_hooks"]), len(state["_forward_pre_hooks"]), forward_replaced(state)]
        parts += [id(p) for p in state["_parameters"].values()]
        parts += [p.requires_grad for p in state["_parameters"].values() if p is not None]
        if "lora_A" in state["_modules"]:
            active = state.get("_active_adapter")
            parts += [active if isinstance(active, str) else tuple(active or ()), state.get("_disable_adapters")]
            parts += [len(state.get("merged_adapters", ())), tuple(state.get("scaling", {}).items())]
            for holder in ("lora_A", "lora_B", "lora_dropout"):
                for child in state["_modules"][holder]._modules.values():
                    weight = child._parameters.get("weight") if child is not None else None
                    parts += [id(child), id(weight), child.training if child is not None else None]
        module = state["_modules"].get("base_layer")
    return tuple(parts)


def _objects(block: torch.nn.Module) -> list[Any]:
    experts = block._modules.get("experts")
    return [] if experts is None else [*experts.modules(), *experts.parameters()]


def expert_views(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's stacked factors of a 3-D parameter as per-expert ``A [E, r, in]`` and ``B [E, out, r]`` views.

    peft keeps ``lora_A.weight [r·E, in]`` with expert e's A in rows ``e·r .. (e+1)·r`` and ``lora_B.weight
    [out, r·E]`` with expert e's B in columns ``j·E + e``.
    """
    rank = lora_a.shape[0] // experts
    return lora_a.view(experts, rank, lora_a.shape[1]), lora_b.view(lora_b.shape[0], rank, experts).permute(2, 0, 1)


class _Fused:
    """A block's fused experts: the checked kernel object, and the parameters whose views it takes per call."""

    __slots__ = ("adapters", "count", "experts")

    def __init__(self, experts: LoRAMoEExperts, adapters: tuple[Any, ...], count: int) -> None:
        self.experts, self.adapters, self.count = experts, adapters, count

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        views: list[torch.Tensor | None] = []
        for a, b in self.adapters:
            views += [None, None] if a is None else expert_views(a, b, self.count)
        return self.experts(x, index, weights, tuple(views))


def _activation(experts: torch.nn.Module) -> str | None:
    # The experts module's own activation: its config's hidden_act through ACT2FN (silu is SwiGLU), or gpt-oss's
    # clamped SwiGLU, which its experts compute themselves from alpha and limit.
    if type(experts).__name__ == "GptOssExperts":
        return "gpt_oss"
    act = getattr(experts, "act_fn", None)
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return None


def _decide(block: torch.nn.Module, name: str) -> Run | str:
    """The block's fused experts, or the reason they run upstream's way."""
    chain = _wrapper_chain(block._modules["experts"])
    if isinstance(chain, str):
        return f"{name}: {chain}"
    base, wrappers = chain
    activation = _activation(base)
    if activation is None:
        act = type(getattr(base, "act_fn", None)).__name__
        return f"{name}.experts: activation {act} has no fused grouped-expert kernel (fused: SiLU)"
    if hooked(base):
        return f"{name}.experts has forward hooks the fused path would bypass"
    weights = [base._parameters.get(role) for role in _ROLES]
    if any(w is None or w.dim() != 3 for w in weights):
        return f"{name}.experts holds no 3-D {' / '.join(_ROLES)} (quantised or another layout)"
    biases = [base._parameters.get(f"{role}_bias") for role in _ROLES]
    if any(t is not None and t.requires_grad for t in (*weights, *biases)):
        return f"{name}.experts: trainable expert weights or biases (full fine-tuning) need the experts' own forward"
    # gpt-oss stores each expert [in, out] and interleaves gate and up: the kernels take [out, in] views.
    transposed = experts_transposed(base)
    # gpt-oss's experts interleave in every release (their own gate reads gate_up[..., ::2]); 5.24 also says so.
    interleaved = type(base).__name__ == "GptOssExperts" or getattr(base, "is_concatenated", True) is False
    projections, adapters = [], []
    for role, weight, bias in zip(_ROLES, weights, biases, strict=True):
        if transposed:
            weight = weight.transpose(1, 2)
        wrapper = wrappers.get(role)
        adapter = None if wrapper is None else _adapter(wrapper, f"{name}.experts.{role}")
        if isinstance(adapter, str):
            return adapter
        if adapter is None:
            projections.append(LoRAWeights(weight, bias=bias))
            adapters.append((None, None))
            continue
        a, b, scale = adapter
        view_a, view_b = expert_views(a, b, weight.shape[0])
        projections.append(LoRAWeights(weight, view_a, view_b, scale, bias=bias))
        adapters.append((a, b))
    options = {"interleaved": interleaved, "name": f"{name}.experts"}
    if activation == "gpt_oss":
        options.update(alpha=float(base.alpha), limit=float(base.limit))
    kernel = LoRAMoEExperts(projections[0], projections[1], activation, **options)
    return _Fused(kernel, tuple(adapters), weights[0].shape[0])


def experts_runner(block: torch.nn.Module) -> Run | None:
    """The block's kept fused experts, or None when upstream's experts run (the reason is in ``patch_report``)."""
    name = type(block).__name__
    if compiling():
        decided = _decide(block, name)
    else:
        decided = planned(block, _stamp(block), lambda: (_decide(block, name), _objects(block)))
    return None if isinstance(decided, str) else decided


def experts_reason(block: torch.nn.Module, name: str) -> str | None:
    """Why the block's experts run upstream's way, or None when they are fused."""
    decided = _decide(block, name)
    return decided if isinstance(decided, str) else None


__all__ = ["expert_views", "experts_reason", "experts_runner"]
