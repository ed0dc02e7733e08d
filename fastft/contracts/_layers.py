"""Module lookups the contracts share: the transformers model under a PeftModel, a LoRA layer's base layer, and
the logical (in, out) sizes of a linear-like layer."""

from __future__ import annotations

import torch


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    # PeftModel -> the transformers model, so names read as in model.named_modules() before wrapping.
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def innermost_base(module: torch.nn.Module) -> torch.nn.Module:
    """The module under peft's LoRA wrappers (``ParamWrapper`` nests one per targeted parameter), ``module`` itself
    when unwrapped. Read through ``_modules``, not peft's ``get_base_layer()``: that asks ``hasattr(layer,
    "base_layer")``, which on a module without one raises inside ``Module.__getattr__``, and a compiled layer's guards
    would replay that on every call."""
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def _features(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear-like base layer; bnb's packed Linear4bit keeps the logical sizes in attributes."""
    base = innermost_base(module)
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    if isinstance(base, torch.nn.Embedding):
        return base.num_embeddings, base.embedding_dim
    if hasattr(base, "in_channels") and hasattr(base, "out_channels"):
        return int(base.in_channels), int(base.out_channels)
    if type(base).__name__ == "Conv1D":  # transformers' GPT-2 layer stores its weight as [in, out]
        return int(base.weight.shape[0]), int(base.weight.shape[1])
    return None


def _weight(entry: torch.nn.Module | torch.Tensor) -> torch.Tensor:
    # LoRA keeps A and B as nn.Linear / nn.Conv modules; AdaLoRA keeps them as bare parameters.
    return entry if isinstance(entry, torch.Tensor) else entry.weight
