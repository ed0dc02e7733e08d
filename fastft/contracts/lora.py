"""LoRA A / B shapes against their base layers, in a live model and in a saved adapter before it loads."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from fastft.contracts._layers import _base_model, _features, _weight
from fastft.kernels.errors import ShapeContractError


def check_lora(model: torch.nn.Module) -> int:
    """Check every LoRA pair against the base layer it wraps: A is ``[r, in]``, B is ``[out, r]``.

    Embedding LoRA (``lora_embedding_A`` ``[r, num_embeddings]``, ``lora_embedding_B`` ``[embedding_dim, r]``) and
    convolution LoRA (first two dims of the kernels) are checked the same way.

    Args:
        model: A ``PeftModel`` (a model without LoRA layers passes trivially).

    Returns:
        The number of (layer, adapter) pairs checked.

    Raises:
        ShapeContractError: A LoRA weight whose shape does not fit its base layer or its rank.
    """
    checked = 0
    for name, module in _base_model(model).named_modules():
        ranks = getattr(module, "r", None)
        if not isinstance(ranks, dict) or not hasattr(module, "lora_A"):
            continue
        features = _features(module)
        if features is None:
            continue
        in_features, out_features = features
        for adapter, rank in ranks.items():
            pairs = []
            if adapter in module.lora_A:
                pairs = [("lora_A", _weight(module.lora_A[adapter])), ("lora_B", _weight(module.lora_B[adapter]))]
            elif adapter in getattr(module, "lora_embedding_A", {}):
                pairs = [
                    ("lora_embedding_A", module.lora_embedding_A[adapter]),
                    ("lora_embedding_B", module.lora_embedding_B[adapter]),
                ]
            for kind, weight in pairs:
                expected = (rank, in_features) if kind.endswith("A") else (out_features, rank)
                actual = tuple(weight.shape[:2])
                if actual != expected:
                    raise ShapeContractError(
                        f"{name}.{kind}[{adapter!r}]: expected [{expected[0]}, {expected[1]}] (r={rank}, base layer "
                        f"in={in_features}, out={out_features}), got {list(weight.shape)}. LoRA A must be [r, in] and "
                        "B [out, r] of the layer they wrap: rebuild the adapter with FastModel.get_peft_model, or load "
                        "an adapter trained for this base model."
                    )
            checked += bool(pairs)
    return checked


_LORA_SUFFIX = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector(?:\.weight)?)$"
)
_WRAPPER_LEVELS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_ADAPTER_PREFIX = "base_model.model."


def _rank_for(module: str, rank: int, rank_pattern: Mapping[str, int]) -> int:
    # peft matches rank_pattern keys as regexes against the end of the module name.
    for pattern, value in rank_pattern.items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            return int(value)
    return rank


def _base_tensor_shapes(base: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    shapes = {}
    # remove_duplicate=False: a tied lm_head.weight is listed under its own name too.
    for name, tensor in [*base.named_parameters(remove_duplicate=False), *base.named_buffers()]:
        if "lora_" in name:
            continue
        state = getattr(tensor, "quant_state", None)
        shape = tuple(state.shape) if state is not None and getattr(state, "shape", None) else tuple(tensor.shape)
        shapes.setdefault(_WRAPPER_LEVELS.sub("", name), shape)
    return shapes


def check_adapter_tensors(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping[str, Any]
) -> int:
    """Check a saved LoRA adapter's tensors against the base model before peft loads them.

    Keys are those of ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` and so on). LoRA
    tensors must fit their base layer and the rank the adapter config gives that layer (``r``, or its
    ``rank_pattern``); full tensors (``modules_to_save``, saved embedding layers) must equal the base tensor's shape.

    Args:
        model: The base model (a transformers model or a ``PeftModel``).
        tensors: Adapter tensors by key (only ``.shape`` is read).
        adapter_config: The adapter's ``adapter_config.json``.

    Returns:
        The number of tensors checked.

    Raises:
        ShapeContractError: A tensor that does not fit, or one whose module or parameter the base model lacks.
    """
    base = _base_model(model)
    base_shapes = _base_tensor_shapes(base)
    modules = dict(base.named_modules())
    default_rank = int(adapter_config.get("r", 8))
    rank_pattern = adapter_config.get("rank_pattern") or {}
    fix = "Load the adapter on the base model it was trained on (adapter_config.json: base_model_name_or_path)."
    for key, tensor in tensors.items():
        actual = list(tensor.shape)
        path = key[len(_ADAPTER_PREFIX) :] if key.startswith(_ADAPTER_PREFIX) else key
        match = _LORA_SUFFIX.match(path)
        if match is None:
            expected = base_shapes.get(_WRAPPER_LEVELS.sub("", path))
            if expected is None:
                raise ShapeContractError(
                    f"{key}: expected a parameter of the base model at {path}, but {type(base).__name__} has none "
                    f"(tensor shape {actual}). {fix}"
                )
            if tuple(actual) != expected:
                raise ShapeContractError(f"{key}: expected {list(expected)} (base model's {path}), got {actual}. {fix}")
            continue
        module_name, kind = match.group("module"), match.group("kind")
        module = modules.get(_WRAPPER_LEVELS.sub("", module_name + ".").rstrip("."))
        features = _features(module) if module is not None else None
        if features is None:
            raise ShapeContractError(
                f"{key}: expected a linear or embedding layer {module_name} in the base model, but "
                f"{type(base).__name__} has {'no such module' if module is None else type(module).__name__} "
                f"(tensor shape {actual}). {fix}"
            )
        in_features, out_features = features
        rank = _rank_for(module_name, default_rank, rank_pattern)
        if kind in ("lora_A.weight", "lora_embedding_A"):
            expected_shape, got = [rank, in_features], actual[:2]
        elif kind in ("lora_B.weight", "lora_embedding_B"):
            expected_shape, got = [out_features, rank], actual[:2]
        else:  # a bias or a DoRA magnitude: one value per output feature
            expected_shape, got = [out_features], [tensor.numel()]
        if got != expected_shape:
            raise ShapeContractError(
                f"{key}: expected {expected_shape} ({module_name}: in={in_features}, out={out_features}; "
                f"r={rank} from adapter_config.json), got {actual}. The adapter was trained for another model size "
                f"or its adapter_config.json does not match its weights. {fix}"
            )
    return len(tensors)
