"""Mixture-of-experts layout contracts: every expert tensor and router checked against the config before any forward.

Two layouts exist and move between transformers releases:

* **fused** (transformers 5.x): the block's ``experts`` module holds 3-D parameters, ``gate_up_proj`` ``[E, 2·I, H]``
  and ``down_proj`` ``[E, H, I]`` (Qwen3-MoE, Mixtral), or, where the module says ``is_transposed`` (gpt-oss),
  ``[E, H, 2·I]`` and ``[E, I, H]``; peft reaches them with ``target_parameters``.
* **per-expert** (transformers 4.x): ``experts`` is a ``ModuleList`` of E small MLPs, each with its gate, up and down
  ``nn.Linear`` (``gate_proj`` / ``up_proj`` / ``down_proj``, or Mixtral's ``w1`` / ``w3`` / ``w2``); peft reaches
  them with ``target_modules``.

E, I, H and top-k come from the config (``num_experts`` or ``num_local_experts``; ``moe_intermediate_size`` or
``intermediate_size``; ``hidden_size``; ``num_experts_per_tok``). A transposed or mis-sized expert tensor, a router of
the wrong width, a top-k outside ``1..E`` and an adapter saved for the other layout are refused with a
:class:`~fastft.kernels.ShapeContractError` naming the module, the expected and the actual shape, instead of the
``mat1 and mat2 shapes cannot be multiplied`` the first forward would raise (or, for a square transposition, the
silently wrong training it would do). Which half of a packed ``gate_up_proj`` is the gate is the loader's convention
(gate first, for every family here) and cannot be read off the tensor's shape; it is not checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fastft.contracts._layers import _base_model, innermost_base
from fastft.kernels.errors import ShapeContractError

_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")
_INTERMEDIATE = ("moe_intermediate_size", "intermediate_size")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "top_k")
# gate, up, down of one expert in the per-expert layout: Qwen / OLMoE names, then Mixtral's.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _first(config: Any, names: Iterable[str]) -> tuple[str, Any] | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return None


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """What the config says one MoE block must hold.

    Attributes:
        experts: E, the number of experts.
        intermediate: I, one expert's intermediate width.
        hidden: H, the model width.
        top_k: How many experts each token is routed to.
        source: Where these came from (``"Qwen3MoeConfig: num_experts=8, ..."``), for messages.
    """

    experts: int
    intermediate: int
    hidden: int
    top_k: int
    source: str


def moe_shape(config: Any) -> MoEShape | None:
    """The MoE sizes of ``config``, or None when it describes no mixture of experts.

    Raises:
        ShapeContractError: A top-k outside ``1..E``, or a non-positive size.
    """
    experts = _first(config, _EXPERT_COUNT)
    if experts is None or not isinstance(experts[1], int) or isinstance(experts[1], bool):
        return None
    intermediate, top_k = _first(config, _INTERMEDIATE), _first(config, _TOP_K)
    hidden = getattr(config, "hidden_size", None)
    if intermediate is None or top_k is None or hidden is None:
        return None
    source = (
        f"{type(config).__name__}: {experts[0]}={experts[1]}, {intermediate[0]}={intermediate[1]}, "
        f"hidden_size={hidden}, {top_k[0]}={top_k[1]}"
    )
    for label, value in ((experts[0], experts[1]), (intermediate[0], intermediate[1]), ("hidden_size", hidden)):
        if not isinstance(value, int) or value < 1:
            raise ShapeContractError(f"MoE config ({source}): {label} must be a positive int, got {value!r}.")
    if not isinstance(top_k[1], int) or not 1 <= top_k[1] <= experts[1]:
        raise ShapeContractError(
            f"MoE config ({source}): {top_k[0]}={top_k[1]!r} routes each token to more experts than the "
            f"{experts[1]} there are (expected 1 <= {top_k[0]} <= {experts[0]}); fix the config: top-k is at most E."
        )
    return MoEShape(experts[1], intermediate[1], hidden, top_k[1], source)


@dataclasses.dataclass
class MoEBlock:
    """One sparse MoE block found in a model.

    Attributes:
        name: Its module name (``model.layers.3.mlp``).
        block: The block module.
        experts: Its experts module, unwrapped from peft's wrappers.
        router: Its router module (``gate`` or ``router``), unwrapped.
        layout: ``"fused"`` (3-D expert parameters) or ``"per-expert"`` (a ModuleList of expert MLPs).
    """

    name: str
    block: torch.nn.Module
    experts: torch.nn.Module
    router: torch.nn.Module | None
    layout: str


def moe_blocks(model: torch.nn.Module) -> Iterator[MoEBlock]:
    """Every sparse MoE block of ``model`` (a transformers model or a ``PeftModel``), in module order, named as in
    the transformers model."""
    for name, module in _base_model(model).named_modules():
        children = module._modules
        experts = children.get("experts")
        if experts is None or "base_layer" in children:
            continue
        experts = innermost_base(experts)
        router = children.get("gate", children.get("router"))
        router = None if router is None else innermost_base(router)
        if isinstance(experts, torch.nn.ModuleList):
            layout = "per-expert"
        elif isinstance(experts._parameters.get("gate_up_proj"), torch.Tensor) or "gate_up_proj" in getattr(
            experts, "parametrizations", {}
        ):
            layout = "fused"
        else:
            continue
        yield MoEBlock(name, module, experts, router, layout)


def _features(module: torch.nn.Module) -> tuple[int, int] | None:
    # (out, in) of a Linear-like module from its attributes (a 4-bit Linear's weight is packed).
    out_f, in_f = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if isinstance(out_f, int) and isinstance(in_f, int):
        return out_f, in_f
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    # Under peft's forward-time parametrisation the tensor lives in parametrizations[name].original.
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None and name in parametrizations:
        return parametrizations[name].original
    value = module._parameters.get(name)
    return value if isinstance(value, torch.Tensor) else None


def _mismatch(where: str, role: str, expected: tuple[int, ...], actual: tuple[int, ...], shape: MoEShape) -> str:
    hint = "load the checkpoint with the transformers release it was saved for, or convert it"
    if sorted(expected) == sorted(actual) and expected != actual:
        hint = (
            "the tensor looks transposed or its dimensions reordered (a checkpoint converted for another layout?); "
            + hint
        )
    return (
        f"{where}: {role} has shape {list(actual)}, expected {list(expected)} from the config ({shape.source}); {hint}."
    )


def experts_transposed(experts: torch.nn.Module) -> bool:
    """Whether a fused experts module stores each expert ``[in, out]``: transformers 5 says so on the module
    (``is_transposed``); 4.x's gpt-oss experts are stored that way without saying it."""
    return bool(getattr(experts, "is_transposed", type(experts).__name__ == "GptOssExperts"))


def _check_fused(block: MoEBlock, shape: MoEShape) -> None:
    e, i, h = shape.experts, shape.intermediate, shape.hidden
    transposed = experts_transposed(block.experts)
    gate_up_expected = (e, h, 2 * i) if transposed else (e, 2 * i, h)
    down_expected = (e, i, h) if transposed else (e, h, i)
    layout = "[E, H, 2·I]" if transposed else "[E, 2·I, H]"
    for role, expected in (("gate_up_proj", gate_up_expected), ("down_proj", down_expected)):
        tensor = _parameter(block.experts, role)
        if tensor is None:
            continue
        actual = tuple(tensor.shape)
        if actual != expected:
            label = f"{role} ({layout} layout)" if role == "gate_up_proj" else role
            raise ShapeContractError(_mismatch(f"{block.name}.experts", label, expected, actual, shape))
        # A bias (gpt-oss) has one entry per output feature of each expert.
        bias = _parameter(block.experts, f"{role}_bias")
        bias_expected = (e, expected[2] if transposed else expected[1])
        if bias is not None and tuple(bias.shape) != bias_expected:
            raise ShapeContractError(
                _mismatch(f"{block.name}.experts", f"{role}_bias", bias_expected, tuple(bias.shape), shape)
            )


def _check_per_expert(block: MoEBlock, shape: MoEShape) -> None:
    e, i, h = shape.experts, shape.intermediate, shape.hidden
    if len(block.experts) != e:
        raise ShapeContractError(
            f"{block.name}.experts: holds {len(block.experts)} experts, expected {e} from the config "
            f"({shape.source}); load the checkpoint that matches this config."
        )
    for index, expert in enumerate(block.experts):
        children = expert._modules
        names = next((triple for triple in _EXPERT_NAMES if all(n in children for n in triple)), None)
        if names is None:
            continue
        for name, expected in zip(names, ((i, h), (i, h), (h, i)), strict=True):
            features = _features(innermost_base(children[name]))
            if features is not None and tuple(features) != expected:
                raise ShapeContractError(
                    _mismatch(f"{block.name}.experts.{index}.{name}", "[out, in]", expected, tuple(features), shape)
                )


def _check_router(block: MoEBlock, shape: MoEShape) -> None:
    router = block.router
    if router is None:
        return
    expected = (shape.experts, shape.hidden)
    weight = _parameter(router, "weight")
    if weight is None:
        return
    features = _features(router) if isinstance(router, torch.nn.Linear) else tuple(weight.shape)
    if features is not None and tuple(features) != expected:
        raise ShapeContractError(
            f"{block.name}.{'gate' if 'gate' in block.block._modules else 'router'}: router weight has shape "
            f"{list(features)}, expected [{shape.experts}, {shape.hidden}] (one row of width hidden_size per expert) "
            f"from the config ({shape.source}); the router and the experts must come from the same checkpoint."
        )


def check_moe_layout(model: torch.nn.Module) -> int:
    """Check every MoE block's experts and router against the config, per layout.

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of MoE blocks checked (0 for a dense model).

    Raises:
        ShapeContractError: A config with a top-k outside ``1..E``, an expert tensor of the wrong shape
            (transposed, or sized for another config), a per-expert list of the wrong length, or a router of the
            wrong width; each names the module, the expected and the actual shape.
    """
    blocks = list(moe_blocks(model))
    if not blocks:
        return 0
    config = getattr(_base_model(model), "config", None)
    shape = None if config is None else moe_shape(getattr(config, "text_config", None) or config)
    if shape is None:
        return 0
    for block in blocks:
        if block.layout == "fused":
            _check_fused(block, shape)
        else:
            _check_per_expert(block, shape)
        _check_router(block, shape)
    return len(blocks)


def check_adapter_layout(model: torch.nn.Module, adapter_keys: Iterable[str], source: str) -> None:
    """Refuse an adapter saved for the other expert layout before any of it is loaded.

    An adapter trained on transformers 4.x's per-expert layout names ``experts.<n>.<proj>`` modules; one trained on
    5.x's fused layout names the ``experts`` module itself (its 3-D parameters, through peft's
    ``target_parameters``). Loading either into the other layout leaves the experts untrained in silence, or fails
    deep inside peft.

    Args:
        model: The base model (or ``PeftModel``) the adapter goes on.
        adapter_keys: The adapter's tensor names.
        source: Where the adapter came from, for the message.

    Raises:
        ShapeContractError: The adapter's expert entries are for the other layout.
    """
    layouts = {block.layout for block in moe_blocks(model)}
    if len(layouts) != 1:
        return
    layout = layouts.pop()
    per_expert = fused = None
    for key in adapter_keys:
        if ".experts." not in key:
            continue
        after = key.split(".experts.", 1)[1]
        if after.split(".", 1)[0].isdigit():
            per_expert = per_expert or key
        elif after.startswith(("lora_A", "lora_B", "base_layer")):
            fused = fused or key
    found = per_expert if layout == "fused" else fused
    if found is None:
        return
    other = "per-expert (transformers 4.x)" if layout == "fused" else "fused 3-D (transformers 5.x)"
    mine = "fused 3-D experts (transformers 5.x)" if layout == "fused" else "per-expert modules (transformers 4.x)"
    raise ShapeContractError(
        f"{source}: the adapter's expert weights are for the {other} layout (e.g. {found!r}), but this model holds "
        f"{mine}; its LoRA would not reach the experts. Load the adapter with the transformers release it was "
        "trained with, or train it again on this one."
    )


__all__ = [
    "MoEBlock",
    "MoEShape",
    "check_adapter_layout",
    "check_moe_layout",
    "experts_transposed",
    "moe_blocks",
    "moe_shape",
]
