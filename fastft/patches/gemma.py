"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``) on the fused path, from the bodies in
:mod:`fastft.patches.decoder`.

What Gemma 3 does differently from Llama, and where each step runs:

- RMSNorm scales by ``1 + w`` and forms the product in fp32 before casting back (``Gemma3RMSNorm``): the fused kernel
  with ``offset=1.0, cast_before_weight=False``. The decoder layer has four of them (input, post-attention,
  pre- and post-feedforward), and the per-head ``q_norm`` / ``k_norm`` between the projection and RoPE are
  ``Gemma3RMSNorm`` modules too, so this one patch serves all six (plus the final norm), each with its dW.
- The MLP gate is GeGLU (``hidden_activation = "gelu_pytorch_tanh"``): the fused LoRA-MLP with the GeGLU kernel.
- Attention scales by ``query_pre_attn_scalar ** -0.5`` (upstream's ``module.scaling``, read by the shared body) and
  hands upstream's attention function the layer's own ``sliding_window`` (None on full-attention layers), exactly
  as ``Gemma3Attention`` does in every lane. The layer's RoPE table (local or global base) is chosen upstream, by
  the decoder layer (4.x) or the text model (5.x), and arrives as ``position_embeddings``. ``attn_logit_softcapping``
  is stored on the module but never passed to the attention function upstream (4.53–5.23), so it is not here
  either.
- The final logit soft-cap (``tanh(z / c) · c``, ``final_logit_softcapping``) is applied inside the fused
  cross-entropy by :func:`~fastft.patches.causal_lm.causal_lm_forward`, so the logits are still never materialised.
- The embeddings scaled by √hidden (``Gemma3TextScaledWordEmbedding``) stay upstream's: the embedding is not patched.

Only ``gemma3_text`` models are patched here; the multimodal ``Gemma3ForConditionalGeneration`` (model_type ``gemma3``)
puts these same classes in its language model through :mod:`fastft.patches.gemma3_vision`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.gemma3 import modeling_gemma3 as gemma3

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    FastClasses,
    VersionRange,
    attention_forward,
    gated_mlp_forward,
    gemma_rms_norm_forward,
    register_family,
)
from fastft.patches.llama import ATTENTION_5_DEFAULTS, ATTENTION_453, ATTENTION_456, CAUSAL_LM_5, renamed_cache


def _layer_window(module: torch.nn.Module) -> dict[str, Any]:
    # config.sliding_window on "sliding_attention" layers, None on "full_attention" ones (set in __init__ upstream).
    return {"sliding_window": module.sliding_window}


GEMMA3 = Family(
    name="gemma3",
    model_type="gemma3_text",
    upstream=gemma3,
    prefix="Gemma3",
    head_norms=True,
    attention_kwargs=_layer_window,
    activation_attr="hidden_activation",
)


class FastGemma3RMSNorm(gemma3.Gemma3RMSNorm):
    """``Gemma3RMSNorm`` (``(1 + w) · x̂`` in fp32, then cast; the layer norms and q_norm / k_norm) through the fused
    RMSNorm kernel, dW included."""

    forward = gemma_rms_norm_forward


class FastGemma3MLP(gemma3.Gemma3MLP):
    """``Gemma3MLP`` as one fused LoRA-MLP node with the GeGLU (tanh-approximated GELU) gate."""

    forward = gated_mlp_forward(GEMMA3)


class FastGemma3Attention(gemma3.Gemma3Attention):
    """``Gemma3Attention`` with the fused LoRA-QKV, per-head q / k RMSNorm, RoPE and LoRA-O kernels (the layer's
    sliding window stays upstream's)."""

    forward = attention_forward(GEMMA3, gemma3.Gemma3Attention)


class FastGemma3ForCausalLM(FusedLossState, gemma3.Gemma3ForCausalLM):
    """``Gemma3ForCausalLM`` whose training loss goes through the fused linear cross-entropy, soft-cap included."""

    forward = causal_lm_forward(gemma3.Gemma3ForCausalLM)


# Gemma 3's own signatures. Its norm and MLP take ``x``. Its causal-LM forward keeps output_attentions /
# output_hidden_states through 4.57 (Llama's dropped them in 4.56) and names the catch-all ``**loss_kwargs`` in
# 4.53–4.55; from 5.x it is Llama's. Attention is Llama's in every range (5.x with defaults).
GEMMA3_RMS_NORM = "(self, x)"
GEMMA3_CAUSAL_LM_453 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, cache_position=None, "
    "logits_to_keep=0, **loss_kwargs)"
)
GEMMA3_CAUSAL_LM_456 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, cache_position=None, "
    "logits_to_keep=0, **kwargs)"
)

register_family(
    GEMMA3,
    FastClasses(FastGemma3RMSNorm, FastGemma3Attention, FastGemma3MLP, FastGemma3ForCausalLM),
    (
        VersionRange(">=4.53.3,<4.56", ATTENTION_453, GEMMA3_CAUSAL_LM_453, rms_norm_fingerprint=GEMMA3_RMS_NORM),
        VersionRange(">=4.56,<4.58", ATTENTION_456, GEMMA3_CAUSAL_LM_456, rms_norm_fingerprint=GEMMA3_RMS_NORM),
        VersionRange(">=5.5.4,<5.24", ATTENTION_5_DEFAULTS, CAUSAL_LM_5, rms_norm_fingerprint=GEMMA3_RMS_NORM),
        VersionRange(
            ">=5.24,<5.25",
            renamed_cache(ATTENTION_5_DEFAULTS),
            renamed_cache(CAUSAL_LM_5),
            rms_norm_fingerprint=GEMMA3_RMS_NORM,
        ),
    ),
)
