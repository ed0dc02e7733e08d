"""trl's per-token log-probs (DPO, KTO, GRPO, RLOO, SFT) through fastft's fused linear log-prob kernel.

From 1.15, trl's trainers never ask the model for logits: each one calls ``trl.trainer.utils.add_fused_lm_head`` on
the model instance, which assigns ``model.forward`` a function that, called with ``fused_lm_head=True``, runs the
backbone and scores the labels through trl's chunked LM head (per-token log-probs, entropy and the metrics' extras
in a :class:`trl.trainer.utils.FusedCausalLMOutput`). That assignment is where a model can provide its own per-token
log-probs, so that is where this patch plugs in, per model instance: a fastft causal-LM class
(:class:`~fastft.patches.causal_lm.FusedLossState`) hands every ``forward`` assignment to :func:`wrap_trl_forward`,
which keeps trl's function for everything but ``fused_lm_head=True`` and answers that with
:func:`fastft.kernels.fused_linear_logprobs`: the same outputs, the same temperature / soft-cap / logit-scale
transform (read from trl's own settings for that call), never a [tokens × vocab] tensor, and with the fused decoder
layers under it — including the reference forward of DPO / KTO / GRPO, which is the policy with its adapters
disabled (:mod:`fastft.patches.lora_layers` serves disabled adapters on the fused path with the LoRA term off).

The record is pinned to the trl versions it was written against and to ``add_fused_lm_head``'s signature; the
names trl's forward closes over are checked too. Anywhere else, trl's own head runs (one warning): correct, and
still without the full logits in trl >= 1.15. Earlier trl versions score from ``outputs.logits`` in the trainer
itself, where no model-side hook exists; there the stock path runs.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fastft.kernels import fused_linear_logprobs
from fastft.patches.causal_lm import FusedLossState, head_reason
from fastft.registry import PatchRecord, register

logger = logging.getLogger(__name__)

PATCH_NAME = "trl.fused_logprobs"
_TARGET = "trl.trainer.utils.add_fused_lm_head"
_FINGERPRINT = "(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=('log_probs',))"
# What trl's forward closes over in the versions this was written for; its settings are read from there.
_TRL_FORWARD = "add_fused_lm_head.<locals>._fused_forward"
_CLOSURE = frozenset(
    {
        "backbone_attr",
        "cast_lm_head_to_fp32",
        "final_logit_softcapping",
        "logit_scale",
        "original_forward",
        "outputs",
        "temperature",
        "text_config",
    }
)
_IGNORE_INDEX = -100
_WARNED: set[str] = set()


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    names = function.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, function.__closure__ or (), strict=True)}


def _is_trl_forward(value: Any) -> bool:
    function = getattr(value, "__func__", None)
    return (
        function is not None
        # trl wraps it with functools.wraps(type(model).forward), which copies __module__ and __qualname__: the
        # module it was defined in and its code object's name are what still say it is trl's.
        and getattr(function, "__globals__", {}).get("__name__") == "trl.trainer.utils"
        and function.__code__.co_qualname == _TRL_FORWARD
    )


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def wrap_trl_forward(model: torch.nn.Module, value: Any) -> Any:
    """What a fastft model stores when something assigns its ``forward``: trl's fused head, routed through fastft's
    kernel for ``fused_lm_head=True``; anything else unchanged.

    Args:
        model: The causal-LM instance (a :class:`~fastft.patches.causal_lm.FusedLossState`).
        value: The function being assigned.

    Returns:
        The function to store.
    """
    if not _is_trl_forward(value):
        return value
    settings = _closure(value.__func__)
    if set(settings) != _CLOSURE:
        _warn_once(
            f"fastft: {PATCH_NAME}: trl's fused LM head closes over {sorted(settings)}, not the {sorted(_CLOSURE)} "
            "it was written for; trl's own head computes the log-probs."
        )
        return value
    trl_forward = value

    @functools.wraps(type(model).forward)
    def forward(
        self: torch.nn.Module,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        reason = None if not fused_lm_head else _stock_reason(self, settings, kwargs)
        if not fused_lm_head or reason is not None:
            return trl_forward(
                *args,
                fused_lm_head=fused_lm_head,
                labels=labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        return _fused_logprobs(self, settings, args, kwargs, labels, shift_labels, num_items_in_batch)

    return types.MethodType(forward, model)


def _stock_reason(model: torch.nn.Module, settings: dict[str, Any], kwargs: dict[str, Any]) -> str | None:
    """Why this call goes to trl's head (logged once per reason), or None."""
    reason = head_reason(model)
    if reason is None and (
        kwargs.get("output_router_logits") or getattr(settings["text_config"], "output_router_logits", False)
    ):
        reason = "the model returns router logits (MoE load-balancing loss)"
    if reason is None and type(model.get_output_embeddings().weight).__name__ == "DTensor":
        reason = "the LM head is sharded (FSDP2 DTensor)"
    if reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("fastft: %s: trl's own fused head scores this model: %s.", PATCH_NAME, reason)
    return reason


def _fused_logprobs(
    model: torch.nn.Module,
    settings: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: Any,
) -> Any:
    """trl's ``fused_lm_head=True`` contract, computed by the backbone and :func:`fused_linear_logprobs`."""
    output_class = sys.modules["trl.trainer.utils"].FusedCausalLMOutput
    kwargs["use_cache"] = False
    backbone_outputs = getattr(model, settings["backbone_attr"])(*args, **kwargs)
    hidden = backbone_outputs.last_hidden_state
    if shift_labels is None:
        if labels is None:
            raise ValueError(
                f"fastft.{PATCH_NAME}: fused_lm_head=True needs labels (or shift_labels) of shape "
                f"{list(hidden.shape[:2])}; got neither."
            )
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    if labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"fastft.{PATCH_NAME}: labels of shape {list(labels.shape)} do not fit the backbone's output "
            f"{list(hidden.shape[:2])} (batch, positions); pass labels shaped like input_ids."
        )
    head = model.get_output_embeddings()
    hidden = hidden.to(head.weight.device)
    labels = labels.to(head.weight.device)
    mask = labels != _IGNORE_INDEX
    device_type = hidden.device.type
    if settings["cast_lm_head_to_fp32"]:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = hidden.dtype
    extras = tuple(name for name in settings["outputs"] if name != "log_probs")
    # Only the scored positions go through the head (prompts and padding never do), as in trl's own head.
    with torch.autocast(device_type, enabled=False):
        per_token = fused_linear_logprobs(
            hidden[mask].to(dtype),
            head.weight.to(dtype),
            labels[mask],
            bias=None if head.bias is None else head.bias.to(dtype),
            temperature=settings["temperature"],
            softcap=settings["final_logit_softcapping"],
            logit_scale=settings["logit_scale"],
            outputs=extras,
        )
    # masked_scatter keeps an all-ignored batch connected to the graph (a zero gradient, not a backward error).
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (
        None if value is None else value.new_zeros(mask.shape).masked_scatter(mask, value) for value in per_token
    )
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    model.fastft_fused_logprob_calls += 1
    return output_class(
        loss=-log_probs.sum() / denominator,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq_probs,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
    )


def _applies_to(model: torch.nn.Module) -> str | None:
    try:
        from trl.trainer import utils as trl_utils
    except ImportError:
        return "trl is not installed"
    code = getattr(getattr(trl_utils, "add_fused_lm_head", None), "__code__", None)
    if code is None:
        # trl before 1.15: the trainers score outputs.logits themselves; a model has nowhere to plug in.
        return "this trl has no fused LM head hook (add_fused_lm_head): its trainers score the model's logits"
    inner = [const for const in code.co_consts if getattr(const, "co_qualname", None) == _TRL_FORWARD]
    found = {name for const in inner for name in const.co_freevars}
    if found != _CLOSURE:
        return f"trl's fused LM head closes over {sorted(found)}, not the {sorted(_CLOSURE)} this patch reads"
    if model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no LM head"
    return None


def _enable(model: torch.nn.Module) -> int:
    if not isinstance(model, FusedLossState):
        return 0
    model.fastft_forward_wrapper = wrap_trl_forward
    return 1


def _fallbacks(model: torch.nn.Module) -> dict[str, str]:
    if not isinstance(model, FusedLossState):
        return {"lm_head": "the causal-LM loss patch did not apply to this model, so trl's own fused head runs"}
    reason = head_reason(model)
    return {"lm_head": f"{reason}; trl's own fused head runs"} if reason else {}


register(
    PatchRecord(
        name=PATCH_NAME,
        target=_TARGET,
        versions={"trl": ">=1.16,<1.17"},
        fingerprint=_FINGERPRINT,
        applies_to=_applies_to,
        apply=_enable,
        replacement=wrap_trl_forward,
        fallbacks=_fallbacks,
    )
)

__all__ = ["PATCH_NAME", "wrap_trl_forward"]
