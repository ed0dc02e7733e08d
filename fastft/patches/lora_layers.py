"""Reading a projection (plain ``nn.Linear``, bitsandbytes NF4 ``Linear4bit``, or either wrapped by peft's LoRA) into
the :class:`~fastft.kernels.LoRAWeights` the fused kernels take, or the reason the fused path cannot serve it.

The fused path computes exactly ``base(x) + s · B(A(x))`` for one active adapter, where ``base(x) = x Wᵀ + b`` may
carry a frozen bias (Qwen2's q / k / v, Llama's ``attention_bias`` / ``mlp_bias``), added in the GEMM's epilogue.
Anything else peft's forward would do differently makes the layer fall back to peft's own forward (slower, never
wrong): dropout that is active, DoRA or another LoRA variant, a LoRA bias (peft's ``lora_bias=True``), several active
adapters, adapters merged, a base layer of another type or quantiser, a trainable base weight or base
bias (training them needs their gradients: full fine-tuning, peft's ``bias="all"`` / ``"lora_only"``), and any forward
hook or replaced forward on the module, which the fused path would bypass. Disabled adapters (peft's
``disable_adapter()``, which is how trl's DPO / KTO / GRPO get the reference model of a LoRA policy) stay on the fused
path with the LoRA term off.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from fastft.contracts._layers import innermost_base
from fastft.contracts.quantized import _QuantStateGuard
from fastft.kernels import LoRAWeights


def _linear4bit_class() -> type | None:
    if "bitsandbytes" not in sys.modules:
        return None
    from bitsandbytes.nn import Linear4bit

    return Linear4bit


def _is_lora_layer(module: torch.nn.Module) -> bool:
    # Read as the callers read them (module._modules, module.scaling), never through module.__dict__: a compiled
    # layer reaching one object by two paths keeps a Python guard that the two are the same object, on every call.
    # Both are instance attributes of a peft layer, so neither goes through Module.__getattr__ (see _hook_reason).
    modules = module._modules
    return (
        "base_layer" in modules
        and "lora_A" in modules
        and "lora_B" in modules
        and getattr(module, "scaling", None) is not None
    )


def forward_replaced(state: dict[str, Any]) -> bool:
    """Whether a module's instance ``__dict__`` (``state``) replaces its class's forward: a ``forward`` set on the
    instance, or accelerate's ``_hf_hook`` (its device and offload hooks wrap the forward that way).

    Read from the dict, not with hasattr: hasattr on a module raises inside ``Module.__getattr__`` for a missing name,
    and a compiled layer's guards would replay that on every call."""
    return "forward" in state or "_hf_hook" in state


def hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward hooks or pre-hooks, or its forward replaced (:func:`forward_replaced`): what a
    fused path that calls the weights directly would bypass."""
    state = module.__dict__
    return bool(state["_forward_hooks"] or state["_forward_pre_hooks"]) or forward_replaced(state)


def _hook_reason(module: torch.nn.Module, label: str) -> str | None:
    state = module.__dict__
    if forward_replaced(state):
        return f"{label} has its forward replaced on the instance (an accelerate / offload hook?)"
    # fastft's own quant_state guard is re-checked by the fused path itself (dequantisation refuses a missing state).
    pre_hooks = [hook for hook in module._forward_pre_hooks.values() if not isinstance(hook, _QuantStateGuard)]
    if pre_hooks or module._forward_hooks:
        return f"{label} has forward hooks the fused path would bypass"
    return None


def _base_reason(base: torch.nn.Module, label: str, training: bool | None) -> str | None:
    reason = _hook_reason(base, label)
    if reason:
        return reason
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta:
        return f"{label} has no materialised weight"
    # Without autograd (inference) a trainable weight or bias needs no gradient, so the fused path serves it too.
    needs_grad = torch.is_grad_enabled() if training is None else training
    bias = getattr(base, "bias", None)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.is_meta:
            return f"{label} has no materialised bias"
        if bias.requires_grad and needs_grad:
            return (
                f"{label}'s bias is trainable (the fused path treats the base bias as frozen and gives it no gradient)"
            )
    linear4bit = _linear4bit_class()
    if type(base) is torch.nn.Linear:
        if weight.requires_grad and needs_grad:
            return f"{label}'s base weight is trainable (full fine-tuning needs its gradient)"
        return None
    if linear4bit is not None and isinstance(base, linear4bit):
        state = getattr(weight, "quant_state", None)
        if state is None:
            return f"{label}'s 4-bit weight has no quant_state"
        if getattr(state, "quant_type", None) != "nf4":
            return f"{label} is {getattr(state, 'quant_type', '?')} 4-bit (the fused kernels read NF4)"
        if getattr(state, "packing_format_for_cpu", False):
            return f"{label}'s 4-bit weight is in bitsandbytes' CPU inference layout"
        return None
    return f"{label}'s base layer is {type(base).__name__} (fused: nn.Linear or bitsandbytes NF4 Linear4bit)"


def projection_weights(module: torch.nn.Module, label: str, training: bool | None = None) -> LoRAWeights | str:
    """The fused kernels' view of one projection, or why it has to run through its own forward.

    Args:
        module: ``q_proj`` and friends, as the model holds them now.
        label: The name used in the reason (``"q_proj"``).
        training: Judge as in training (True: dropout active, gradients wanted) or inference (False); None: the
            module's own mode and whether autograd is on.

    Returns:
        The weights, or a one-line reason.
    """
    if not _is_lora_layer(module):
        reason = _base_reason(module, label, training)
        return reason or LoRAWeights(module.weight, bias=module.bias)
    reason = _hook_reason(module, label)
    if reason:
        return reason
    if module.merged:
        return f"{label}: adapter merged into the base weight"
    base = innermost_base(module)
    reason = _base_reason(base, f"{label}.base_layer", training)
    if reason:
        return reason
    if module.disable_adapters:
        # peft's disable_adapter(): the base layer alone. That is the reference model of trl's DPO / KTO / GRPO on a
        # LoRA policy, so it stays on the fused path, with the LoRA term off.
        return LoRAWeights(base.weight, bias=base.bias)
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) > 1:
        return f"{label}: {len(active)} active adapters"
    if not active:
        return LoRAWeights(base.weight, bias=base.bias)
    adapter = active[0]
    if module.use_dora.get(adapter, False):
        return f"{label}: DoRA"
    variant = getattr(module, "lora_variant", {}).get(adapter)
    if variant is not None:
        return f"{label}: LoRA variant {type(variant).__name__}"
    if getattr(module, "lora_bias", {}).get(adapter, False):
        return f"{label}: LoRA bias"
    dropout = module.lora_dropout[adapter]
    if isinstance(dropout, torch.nn.Dropout):
        active_dropout = dropout.training if training is None else training
        if dropout.p > 0 and active_dropout:
            return f"{label}: lora_dropout p={dropout.p} (fused only without dropout)"
    elif not isinstance(dropout, torch.nn.Identity):
        return f"{label}: lora_dropout is {type(dropout).__name__}"
    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return f"{label}: LoRA A / B are {type(lora_a).__name__} / {type(lora_b).__name__}, not nn.Linear"
    return LoRAWeights(base.weight, lora_a.weight, lora_b.weight, float(module.scaling[adapter]), bias=base.bias)


def _linear_stamp(module: torch.nn.Module) -> tuple[Any, ...]:
    state = module.__dict__
    parameters = state["_parameters"]
    weight, bias = parameters.get("weight"), parameters.get("bias")
    # bitsandbytes repacks a CPU 4-bit weight in place and flags its quant_state (DESIGN.md, upstream traps).
    quant_state = None if weight is None else weight.__dict__.get("quant_state")
    repacked = quant_state is not None and getattr(quant_state, "packing_format_for_cpu", False)
    return (
        id(module),
        id(weight),
        id(bias),
        None if weight is None else (weight.requires_grad, weight.device, id(quant_state), repacked),
        None if bias is None else bias.requires_grad,
        len(state["_forward_hooks"]),
        len(state["_forward_pre_hooks"]),
        forward_replaced(state),
    )


def projection_stamp(module: torch.nn.Module) -> tuple[Any, ...]:
    """What :func:`projection_weights` reads of one projection, read cheaply: equal stamps give equal answers.

    A patched module keeps its fused weights between calls and compares stamps instead of deciding again (deciding
    walks peft's layer in about 36 µs; a stamp costs a few). Covered: the module objects and their hooks, every
    parameter object and its requires_grad, device and NF4 quant_state, peft's disabled / active / merged adapters,
    the active adapters' A and B, scale and dropout mode. Replacing an adapter replaces its A and B, so DoRA, LoRA
    variants and LoRA bias (set when an adapter is made) are covered through them. Parameter *data* swapped in
    place (``model.to(...)``) needs no new decision: the kernels read the parameter objects at call time.

    Objects enter the stamp by ``id`` (a tensor's ``==`` compares values); whoever keeps a stamp keeps the objects of
    :func:`projection_objects` alive with it, so no id can be reused by a new object while the stamp is compared.
    """
    state = module.__dict__
    modules = state["_modules"]
    base = modules.get("base_layer")
    if base is None or "lora_A" not in modules:
        return _linear_stamp(module)
    # Seven of these run per decoder layer per call: one tuple, no list to build and copy.
    active = state.get("_active_adapter")
    names = (active,) if isinstance(active, str) else tuple(active or ())
    stamp = _linear_stamp(base) + (
        id(module),
        len(state["_forward_hooks"]),
        len(state["_forward_pre_hooks"]),
        forward_replaced(state),
        state.get("_disable_adapters"),
        names,
        len(state.get("merged_adapters", ())),
    )
    # Of A and B, projection_weights reads only their type and weight: the module and parameter objects say both.
    lora_a, lora_b = modules["lora_A"]._modules, modules["lora_B"]._modules
    dropout, scaling = modules.get("lora_dropout"), state.get("scaling", {})
    for name in names:
        a, b = lora_a.get(name), lora_b.get(name)
        if a is None:
            continue
        drop = None if dropout is None else dropout._modules.get(name)
        stamp += (
            id(a),
            id(a._parameters.get("weight")),
            id(b),
            None if b is None else id(b._parameters.get("weight")),
            scaling.get(name),
            None if drop is None else drop.training,
        )
    return stamp


def projection_objects(module: torch.nn.Module) -> list[Any]:
    """Every object whose ``id`` :func:`projection_stamp` takes: the modules, their parameters, NF4 quant_states."""
    objects: list[Any] = []
    for part in module.modules():
        objects.append(part)
        for parameter in part._parameters.values():
            objects += [parameter, getattr(parameter, "quant_state", None)]
    return objects


def group_weights(
    owner: torch.nn.Module, names: Sequence[str], training: bool | None = None
) -> list[LoRAWeights] | str:
    """Every projection of a group (q, k, v of an attention; gate, up, down of an MLP), or the first reason one of
    them cannot take the fused path."""
    group = []
    for name in names:
        weights = projection_weights(getattr(owner, name), name, training)
        if isinstance(weights, str):
            return weights
        group.append(weights)
    devices = {weights.weight.device for weights in group}
    if len(devices) > 1:
        return f"{', '.join(names)} are spread over {sorted(map(str, devices))}"
    return group


__all__ = [
    "forward_replaced",
    "group_weights",
    "hooked",
    "projection_objects",
    "projection_stamp",
    "projection_weights",
]
