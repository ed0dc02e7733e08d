"""Gemma 3 with its vision tower (``Gemma3ForConditionalGeneration``, model_type ``gemma3``): the language model on the
fused path, the SigLIP vision tower and the multi-modal projector stock.

- Language model (``Gemma3TextModel``): the modules of the text family (:mod:`fastft.patches.gemma`) — the
  ``(1 + w)`` RMSNorms (layer norms, q / k norms, final norm), the fused LoRA-QKV / RoPE / LoRA-O attention with
  the layer's own sliding window, the GeGLU LoRA-MLP. The scaled embedding and the choice of the local or global
  RoPE table stay upstream's, as for text. Only modules inside the language model are swapped: the projector's
  ``mm_soft_emb_norm`` is a ``Gemma3RMSNorm`` too and stays upstream's with the tower.
- Images: the tower's pooled, projected features are merged into ``inputs_embeds`` by upstream's ``Gemma3Model``,
  which also builds the attention masks: with ``token_type_ids`` (1 on image tokens, as the processor makes them),
  the tokens of one image attend to each other both ways (4.53–5.5 through an ``or_mask_function``, 5.12 and later
  through ``block_sequence_ids``; 5.5 refuses to train without ``token_type_ids``). The fused attention hands that
  mask to upstream's attention function unchanged, so the result is stock's in every lane.
- Loss: the fused linear cross-entropy on the conditional-generation head. That head computes its loss its own way
  in each release, and the fused one follows it: from 4.53 to 5.12 at least it drops the positions whose label
  token is masked out by the 2-D ``attention_mask`` and averages over the rest (``num_items_in_batch`` is not read:
  ``accepts_loss_kwargs = False``); by 5.23 it is transformers' ``ForCausalLMLoss``. Which one is read from the
  installed forward's source once. Neither caps the logits (``final_logit_softcapping`` is Gemma3ForCausalLM's),
  and neither does the fused loss here (the top-level ``Gemma3Config`` has no such field).

The records cover the four transformers ranges the lanes test, with the signatures read from each release.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.models.gemma3 import modeling_gemma3 as gemma3

from fastft.patches.arguments import ArgumentReader
from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    ACTIVATIONS,
    group_fallbacks,
    loss_fallbacks,
    mlp_activation,
    model_type_only,
)
from fastft.patches.gemma import GEMMA3, GEMMA3_RMS_NORM, FastGemma3Attention, FastGemma3MLP, FastGemma3RMSNorm
from fastft.patches.llama import ATTENTION_5_DEFAULTS, ATTENTION_453, ATTENTION_456, renamed_cache
from fastft.patches.parts import Part, register_parts

MODEL_TYPE = "gemma3"
_IGNORE_INDEX = -100
_HEAD = gemma3.Gemma3ForConditionalGeneration
_OUTPUT = gemma3.Gemma3CausalLMOutputWithPast
# The two ways upstream's head computes its loss, as its source writes them.
_MASKED_LOSS = "shift_attention_mask"
_STANDARD_LOSS = "self.loss_function("


@functools.cache
def head_loss() -> str | None:
    """How the installed ``Gemma3ForConditionalGeneration.forward`` computes its loss: ``"masked"`` (labels whose token
    the 2-D attention mask hides are dropped, then the mean), ``"standard"`` (``ForCausalLMLoss``), or None when its
    source says neither (or cannot be read)."""
    try:
        source = inspect.getsource(_HEAD.forward)
    except (OSError, TypeError):
        return None
    if _MASKED_LOSS in source:
        return "masked"
    if _STANDARD_LOSS in source:
        return "standard"
    return None


def attended_labels(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``labels`` with ``-100`` where the 2-D ``attention_mask`` is 0, its last ``labels.shape[1]`` columns read (a
    longer mask is cropped on the left, as upstream crops it for prefix tuning): after the shift this drops exactly
    the predictions upstream's masked loss drops."""
    mask = attention_mask[:, -labels.shape[1] :].to(labels.device)
    return labels.masked_fill(mask == 0, _IGNORE_INDEX)


def _conditional_generation_forward() -> Callable[..., Any]:
    """The head's forward with the fused loss, in the installed release's loss semantics (:func:`head_loss`)."""
    fused = causal_lm_forward(_HEAD, output_class=_OUTPUT)
    signature = inspect.signature(_HEAD.forward)
    reader = ArgumentReader(signature)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if head_loss() != "masked" or not (self.training and torch.is_grad_enabled()):
            return fused(self, *args, **kwargs)
        named, extra = reader.read(self, args, kwargs)
        labels, attention_mask = named.get("labels"), named.get("attention_mask")
        if labels is not None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            named["labels"] = attended_labels(labels, attention_mask)
        # That loss is a plain mean: upstream reads no num_items_in_batch there.
        extra.pop("num_items_in_batch", None)
        return fused(self, **named, **extra)

    forward.__signature__ = signature
    forward.__doc__ = f"``{_HEAD.__name__}.forward`` with the training loss through the fused cross-entropy."
    return forward


class FastGemma3ForConditionalGeneration(FusedLossState, gemma3.Gemma3ForConditionalGeneration):
    """``Gemma3ForConditionalGeneration`` whose training loss goes through the fused linear cross-entropy, computed
    as the installed release's head computes it."""

    forward = _conditional_generation_forward()


def language_model_only(upstream_class: type, fast_class: type) -> Callable[[torch.nn.Module], int]:
    """A record's ``apply``: every module of exactly ``upstream_class`` inside the language model
    (``Gemma3TextModel``) becomes ``fast_class``; the vision tower's and the projector's stay upstream's."""

    def apply(model: torch.nn.Module) -> int:
        count = 0
        for owner in model.modules():
            if type(owner) is gemma3.Gemma3TextModel:
                for module in owner.modules():
                    if type(module) is upstream_class:
                        module.__class__ = fast_class
                        count += 1
        return count

    return apply


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


_only = model_type_only(MODEL_TYPE)


def _gated_mlp_only(model: torch.nn.Module) -> str | None:
    reason = _only(model)
    if reason:
        return reason
    text = _text_config(model.config)
    if mlp_activation(text, GEMMA3.activation_attr) is None:
        activation = getattr(text, GEMMA3.activation_attr, None)
        return f"hidden_activation {activation!r} has no fused gate kernel (fused: {', '.join(sorted(ACTIVATIONS))})"
    return None


def _loss_only(model: torch.nn.Module) -> str | None:
    reason = _only(model)
    if reason:
        return reason
    if head_loss() is None:
        return (
            f"{_HEAD.__name__}.forward computes its loss neither from {_MASKED_LOSS} nor through "
            f"{_STANDARD_LOSS.rstrip('(')}, so the fused loss cannot reproduce it"
        )
    return None


# Per range: the attention's and the conditional-generation head's signatures, as each release writes them (the
# attention is Gemma3Attention, the text family's).
_PAST_4 = "past_key_values=None, token_type_ids=None, cache_position=None, inputs_embeds=None, labels=None"
_HEAD_4 = (
    f"(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, {_PAST_4}, use_cache=None, "
    "output_attentions=None, output_hidden_states=None, return_dict=None, logits_to_keep=0, **lm_kwargs)"
)
_HEAD_5 = (
    "(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, past_key_values=None, "
    "token_type_ids=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **lm_kwargs)"
)
_HEAD_524 = (
    "(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, cache=None, "
    "token_type_ids=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, mm_encoder_outputs=None, "
    "**kwargs)"
)
_RANGES = (
    (">=4.53.3,<4.56", ATTENTION_453, _HEAD_4),
    (">=4.56,<4.58", ATTENTION_456, _HEAD_4),
    (">=5.5.4,<5.24", ATTENTION_5_DEFAULTS, _HEAD_5),
    (">=5.24,<5.25", renamed_cache(ATTENTION_5_DEFAULTS), _HEAD_524),
)
_ATTENTION_GROUPS = {".qkv": GEMMA3.qkv, ".o_proj": GEMMA3.o}
_PARTS = (
    Part("rms_norm", gemma3.Gemma3RMSNorm, FastGemma3RMSNorm, _only, swap=language_model_only),
    Part(
        "attention",
        gemma3.Gemma3Attention,
        FastGemma3Attention,
        _only,
        group_fallbacks((FastGemma3Attention,), _ATTENTION_GROUPS),
        ("qkv", "o"),
        language_model_only,
    ),
    Part(
        "mlp",
        gemma3.Gemma3MLP,
        FastGemma3MLP,
        _gated_mlp_only,
        group_fallbacks((FastGemma3MLP,), {"": GEMMA3.mlp}),
        ("gate_up", "down"),
        language_model_only,
    ),
    Part(
        "causal_lm_loss",
        _HEAD,
        FastGemma3ForConditionalGeneration,
        _loss_only,
        loss_fallbacks(FastGemma3ForConditionalGeneration),
    ),
)

register_parts(
    "gemma3_vision",
    gemma3,
    MODEL_TYPE,
    [
        (v, {"rms_norm": GEMMA3_RMS_NORM, "attention": a, "mlp": "(self, x)", "causal_lm_loss": h})
        for v, a, h in _RANGES
    ],
    _PARTS,
)


__all__ = ["FastGemma3ForConditionalGeneration", "attended_labels", "head_loss", "language_model_only"]
