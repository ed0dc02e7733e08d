"""Llama and Mistral (Llama's math; Mistral's sliding window stays in upstream's attention function).

RMSNorm, attention (fused LoRA-QKV, RoPE, fused LoRA-O), the MLP (fused LoRA-MLP) and the causal-LM loss (fused
linear cross-entropy) through fastft's kernels, from the bodies in :mod:`fastft.patches.decoder`. Each patch swaps
the class of the matching module instances of one model for a subclass defined here; the upstream classes, the
decoder layer's forward (which transformers 5.23 wraps for checkpointing) and every other model are left alone. A
subclass changes only ``forward``, so ``isinstance`` checks, state dicts, peft wrapping of the projections and hooks
keep working. ``tests/test_patches_llama.py`` and ``tests/test_patches_families.py`` check them against stock.

A group of projections that the fused kernels cannot serve (see :mod:`fastft.patches.lora_layers`: dropout, DoRA,
another quantiser, adapters disabled or merged, hooks) runs through the modules' own forwards, layer by layer;
``patch_report`` lists those layers and why.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    FastClasses,
    VersionRange,
    attention_forward,
    gated_mlp_forward,
    register_family,
    rms_norm_forward,
)
from fastft.patches.fused_layer import decoder_layer_forward, returns_tuple


def _config_window(module: torch.nn.Module) -> dict[str, Any]:
    return {"sliding_window": getattr(module.config, "sliding_window", None)}


LLAMA = Family(name="llama", model_type="llama", upstream=llama, prefix="Llama")
MISTRAL = Family(
    name="mistral", model_type="mistral", upstream=mistral, prefix="Mistral", attention_kwargs=_config_window
)


class FastLlamaRMSNorm(llama.LlamaRMSNorm):
    """``LlamaRMSNorm`` through the fused RMSNorm kernel (same casting rule, gives dX and dW)."""

    forward = rms_norm_forward


class FastLlamaMLP(llama.LlamaMLP):
    """``LlamaMLP`` as one fused LoRA-MLP node (gate / up / down with their adapters, SwiGLU between)."""

    forward = gated_mlp_forward(LLAMA)


class FastLlamaAttention(llama.LlamaAttention):
    """``LlamaAttention`` with the fused LoRA-QKV, RoPE and LoRA-O kernels."""

    forward = attention_forward(LLAMA, llama.LlamaAttention)


class FastLlamaDecoderLayer(llama.LlamaDecoderLayer):
    """``LlamaDecoderLayer`` as one fused autograd node where all its parts are fused (else upstream's forward)."""

    forward = decoder_layer_forward(LLAMA, llama.LlamaDecoderLayer, returns_tuple())


class FastLlamaForCausalLM(FusedLossState, llama.LlamaForCausalLM):
    """``LlamaForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = causal_lm_forward(llama.LlamaForCausalLM)


class FastMistralRMSNorm(mistral.MistralRMSNorm):
    """``MistralRMSNorm`` through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastMistralMLP(mistral.MistralMLP):
    """``MistralMLP`` as one fused LoRA-MLP node."""

    forward = gated_mlp_forward(MISTRAL)


class FastMistralAttention(mistral.MistralAttention):
    """``MistralAttention`` with the fused LoRA-QKV, RoPE and LoRA-O kernels (the window stays upstream's)."""

    forward = attention_forward(MISTRAL, mistral.MistralAttention)


class FastMistralDecoderLayer(mistral.MistralDecoderLayer):
    """``MistralDecoderLayer`` as one fused autograd node where all its parts are fused (else upstream's forward)."""

    forward = decoder_layer_forward(MISTRAL, mistral.MistralDecoderLayer, returns_tuple())


class FastMistralForCausalLM(FusedLossState, mistral.MistralForCausalLM):
    """``MistralForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = causal_lm_forward(mistral.MistralForCausalLM)


# The causal-LM signatures of each range (Llama, Mistral, Qwen2 and Qwen3 share them; tests check every record).
CAUSAL_LM_453 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, cache_position=None, "
    "logits_to_keep=0, **kwargs)"
)
CAUSAL_LM_456 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs)"
)
CAUSAL_LM_5 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, logits_to_keep=0, **kwargs)"
)
ATTENTION_453 = (
    "(self, hidden_states, position_embeddings, attention_mask, past_key_value=None, cache_position=None, **kwargs)"
)
ATTENTION_456 = (
    "(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None, **kwargs)"
)
# transformers 5 gave Llama's (and Gemma 3's) attention defaults for position_embeddings and attention_mask, not the
# others'.
ATTENTION_5 = "(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs)"
ATTENTION_5_DEFAULTS = (
    "(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs)"
)


def renamed_cache(fingerprint: str) -> str:
    """A 5.x signature as transformers 5.24 writes it: ``past_key_values`` became ``cache`` (the old name still
    reaches the forward through a deprecation shim, which :func:`fastft.patches.decoder.attention_forward` honours)."""
    return fingerprint.replace("past_key_values=None", "cache=None")


# The Llama-shaped decoder layers' signatures (Llama, Mistral, Qwen2 and Qwen3 share them).
DECODER_LAYER_453 = (
    "(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, output_attentions=False, "
    "use_cache=False, cache_position=None, position_embeddings=None, **kwargs)"
)
DECODER_LAYER_456 = (
    "(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, "
    "cache_position=None, position_embeddings=None, **kwargs)"
)
DECODER_LAYER_5 = (
    "(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, "
    "position_embeddings=None, **kwargs)"
)


def ranges(attention_5: str = ATTENTION_5, mlp_fingerprint: str = "(self, x)") -> tuple[VersionRange, ...]:
    """The four transformers ranges the lanes test (.ci/lanes/), each ending before the next minor release no lane
    has run; inside a range the signature check still guards every release."""
    return tuple(
        VersionRange(versions, attention, causal_lm, mlp_fingerprint=mlp_fingerprint, decoder_layer_fingerprint=layer)
        for versions, attention, causal_lm, layer in (
            (">=4.53.3,<4.56", ATTENTION_453, CAUSAL_LM_453, DECODER_LAYER_453),
            (">=4.56,<4.58", ATTENTION_456, CAUSAL_LM_456, DECODER_LAYER_456),
            (">=5.5.4,<5.24", attention_5, CAUSAL_LM_5, DECODER_LAYER_5),
            (">=5.24,<5.25", renamed_cache(attention_5), renamed_cache(CAUSAL_LM_5), renamed_cache(DECODER_LAYER_5)),
        )
    )


register_family(
    LLAMA,
    FastClasses(FastLlamaRMSNorm, FastLlamaAttention, FastLlamaMLP, FastLlamaForCausalLM, FastLlamaDecoderLayer),
    ranges(ATTENTION_5_DEFAULTS),
)
register_family(
    MISTRAL,
    FastClasses(
        FastMistralRMSNorm, FastMistralAttention, FastMistralMLP, FastMistralForCausalLM, FastMistralDecoderLayer
    ),
    ranges(),
)
