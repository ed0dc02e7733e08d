"""The fused loss for architectures no family module covers, where their causal-LM head is the standard one.

A ``...ForCausalLM`` whose forward computes ``logits = self.lm_head(...)`` once, changes them no further, and hands
them to ``self.loss_function`` (transformers' ``ForCausalLMLoss``) gets the same loss from the fused linear
cross-entropy without the [tokens, vocab] logits. That is checked per model class, on the installed forward's
source, before anything is changed: a head that scales, caps or otherwise rewrites its logits (Cohere's
``logit_scale``, Granite's ``logits_scaling``), a loss of another type, or a head that is not a plain ``nn.Linear``
keeps the stock forward, and the report says why. The record is pinned to the versions and the signature of
``ForCausalLMLoss``, whose label shift and ignore index the fused loss reproduces.

The subclass is made at load time (one per upstream class) and lives in this module's namespace; a model patched
this way pickles within the process that patched it (as ``copy.deepcopy`` and DDP need), not across processes.
"""

from __future__ import annotations

import inspect
import re
import sys

import torch

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward, head_reason
from fastft.registry import PatchRecord, register, supported_model_types

_LOSS = "transformers.loss.loss_utils.ForCausalLMLoss"
# An assignment has spaces around its operator in formatted code; a keyword argument (logits=logits) has none.
_ASSIGNS_LOGITS = re.compile(r"^\s*logits\s+(?:=|\*=|/=|\+=|-=)\s", re.MULTILINE)
_REWRITES_LOGITS = re.compile(r"\blogits\s*\.\s*\w+_\(|softcap|logit_scale|logits_scaling|temperature")
_CALLS_LOSS = "self.loss_function(logits=logits, labels=labels"


def _causal_lm_class(model: torch.nn.Module) -> type | None:
    name = type(model).__name__
    return type(model) if name.endswith("ForCausalLM") else None


def standard_head_reason(upstream_class: type) -> str | None:
    """Why ``upstream_class.forward`` is not the standard causal-LM head, or None when it is."""
    try:
        source = inspect.getsource(upstream_class.forward)
    except (OSError, TypeError) as error:
        return f"{upstream_class.__name__}.forward has no readable source ({error})"
    assignments = _ASSIGNS_LOGITS.findall(source)
    head_line = re.search(r"^\s*logits\s*=\s*self\.lm_head\(", source, re.MULTILINE)
    if head_line is None or len(assignments) != 1:
        return f"{upstream_class.__name__}.forward does not compute logits = self.lm_head(...) once"
    after = source[head_line.end() :]
    if _REWRITES_LOGITS.search(after):
        return f"{upstream_class.__name__}.forward changes its logits after the LM head (a scale or cap)"
    if _CALLS_LOSS not in after:
        return f"{upstream_class.__name__}.forward does not hand its logits to self.loss_function"
    return None


def _applies_to(model: torch.nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in supported_model_types():
        return f"model_type {model_type!r} has its own loss patch"
    upstream_class = _causal_lm_class(model)
    if upstream_class is None:
        return f"{type(model).__name__} is not a ...ForCausalLM head"
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return f"{upstream_class.__name__} uses the {model.loss_type} loss, not ForCausalLM"
    if not hasattr(model, upstream_class.base_model_prefix):
        return f"{upstream_class.__name__} has no backbone attribute {upstream_class.base_model_prefix!r}"
    return standard_head_reason(upstream_class) or head_reason(model)


def fused_loss_class(upstream_class: type) -> type:
    """The fused-loss subclass of one upstream ``...ForCausalLM`` (made once, kept in this module)."""
    module = sys.modules[__name__]
    name = f"Fast{upstream_class.__name__}"
    existing = getattr(module, name, None)
    if existing is not None and existing.__bases__[-1] is upstream_class:
        return existing
    fast_class = type(
        name,
        (FusedLossState, upstream_class),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``{upstream_class.__name__}`` whose training loss goes through the fused cross-entropy.",
            "forward": causal_lm_forward(upstream_class, backbone=upstream_class.base_model_prefix),
        },
    )
    setattr(module, name, fast_class)
    return fast_class


def _apply(model: torch.nn.Module) -> int:
    upstream_class = type(model)
    model.__class__ = fused_loss_class(upstream_class)
    return 1


def _fallbacks(model: torch.nn.Module) -> dict[str, str]:
    reason = head_reason(model) if isinstance(model, FusedLossState) else None
    return {"lm_head": reason} if reason else {}


# Each range starts at a version the lanes test and ends before the next minor release no lane has run.
for _range in (">=4.53.3,<4.58", ">=5.5.4,<5.25"):
    register(
        PatchRecord(
            name="generic.causal_lm_loss",
            target=_LOSS,
            versions={"transformers": _range},
            fingerprint="(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, "
            "**kwargs)",
            applies_to=_applies_to,
            apply=_apply,
            replacement=causal_lm_forward,
            fallbacks=_fallbacks,
            model_types=("*",),
        )
    )

__all__ = ["fused_loss_class", "standard_head_reason"]
