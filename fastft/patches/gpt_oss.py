"""gpt-oss: its norms, experts and loss on the fused path; its attention as upstream's.

- RMSNorm: gpt-oss multiplies by the weight in fp32 before casting back (Llama casts first), the fused kernel's
  ``cast_before_weight=False`` variant.
- Experts (transformers 5.x): stored transposed (``gate_up_proj [E, H, 2·I]``, ``down_proj [E, I, H]``) with gate and
  up interleaved column by column, biases on both, and a clamped SwiGLU (``(clamp(up) + 1) · g · sigmoid(α · g)``,
  ``g = min(gate, limit)``); :mod:`fastft.patches.moe_experts` hands them to the grouped-expert kernel as transposed
  views with ``interleaved=True`` and ``activation="gpt_oss"``. The block returns the router scores beside the hidden
  states, as upstream's does. transformers 4.x's router hands the experts other tensors, so there the experts run
  upstream's (the report says so).
- Loss: the fused linear cross-entropy, upstream's own forward when router logits are asked for
  (:func:`fastft.patches.moe.moe_causal_lm_forward`).
- Attention: the fused LoRA-QKV (with gpt-oss's q / k / v biases), RoPE and LoRA-O kernels around upstream's own
  attention function, which takes the learned sinks (``s_aux``, read from the module on every call) and the layer's
  sliding window. gpt-oss's rotary embedding hands out half-width tables and rotates the two halves of each head
  with them; repeated to full width they give exactly Llama's ``rotate_half`` rotation, which the fused path runs.

gpt-oss's hub checkpoints store the experts in MXFP4, which transformers dequantises on load where it has no MXFP4
kernel (CPU, pre-Hopper GPUs); fastft trains those dequantised 16-bit experts.
"""

from __future__ import annotations

import torch

from fastft.kernels import rms_norm
from fastft.patches.decoder import (
    Family,
    attention_forward,
    group_fallbacks,
    loss_fallbacks,
    model_type_only,
    repeat_half_tables,
)
from fastft.patches.llama import renamed_cache
from fastft.patches.moe import CAUSAL_LM_5, CAUSAL_LM_456, experts_fallbacks, experts_only_on_5, moe_causal_lm_forward
from fastft.patches.moe_experts import experts_runner
from fastft.patches.parts import Part, register_parts

try:
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
except ImportError:  # transformers < 4.55 has no gpt-oss
    gpt_oss = None


def gpt_oss_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """gpt-oss's RMSNorm (``weight · x̂`` in fp32, then cast) through the fused kernel."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=0.0, cast_before_weight=False)


def gpt_oss_block_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``GptOssMLP.forward`` (transformers 5.x) with its experts on the fused grouped-expert path where they can be."""
    batch, seq, hidden = hidden_states.shape
    flat = hidden_states.reshape(-1, hidden)
    _, scores, index = self.router(flat)
    run = experts_runner(self)
    out = self.experts(flat, index, scores) if run is None else run(flat, index, scores)
    return out.reshape(batch, seq, hidden), scores


def _window(module: torch.nn.Module) -> dict[str, int | None]:
    # The layer's own window: None on full-attention layers, the config's on sliding ones.
    return {"sliding_window": module.sliding_window}


def _sinks(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {"s_aux": module.sinks}


if gpt_oss is not None:
    GPT_OSS = Family(
        name="gpt_oss",
        model_type="gpt_oss",
        upstream=gpt_oss,
        prefix="GptOss",
        attention_kwargs=_window,
        rotary_tables=repeat_half_tables,
        call_kwargs=_sinks,
    )

    class FastGptOssAttention(gpt_oss.GptOssAttention):
        """``GptOssAttention`` with the fused LoRA-QKV, RoPE and LoRA-O kernels (sinks and window passed on)."""

        forward = attention_forward(GPT_OSS, gpt_oss.GptOssAttention)

    class FastGptOssRMSNorm(gpt_oss.GptOssRMSNorm):
        """``GptOssRMSNorm`` through the fused RMSNorm kernel (weight applied in fp32)."""

        forward = gpt_oss_rms_norm_forward

    class FastGptOssMLP(gpt_oss.GptOssMLP):
        """``GptOssMLP`` with its experts as one fused grouped-expert LoRA node (transformers 5.x)."""

        forward = gpt_oss_block_forward

    from fastft.patches.causal_lm import FusedLossState

    class FastGptOssForCausalLM(FusedLossState, gpt_oss.GptOssForCausalLM):
        """``GptOssForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

        forward = moe_causal_lm_forward(gpt_oss.GptOssForCausalLM)

    _RANGES = (
        (">=4.56,<4.58", CAUSAL_LM_456),
        (">=5.5.4,<5.24", CAUSAL_LM_5),
        (">=5.24,<5.25", renamed_cache(CAUSAL_LM_5)),
    )
    _ATTENTION = (
        "(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None, "
        "**kwargs)",
        "(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs)",
        "(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs)",
    )
    _only = model_type_only("gpt_oss")
    _GROUPS = {".qkv": GPT_OSS.qkv, ".o_proj": GPT_OSS.o}
    _upstream = GPT_OSS.upstream_class
    _parts = (
        Part("rms_norm", _upstream("RMSNorm"), FastGptOssRMSNorm, _only),
        Part("experts", _upstream("MLP"), FastGptOssMLP, experts_only_on_5(GPT_OSS), experts_fallbacks(FastGptOssMLP)),
        Part(
            "causal_lm_loss",
            _upstream("ForCausalLM"),
            FastGptOssForCausalLM,
            _only,
            loss_fallbacks(FastGptOssForCausalLM),
        ),
        Part(
            "attention",
            _upstream("Attention"),
            FastGptOssAttention,
            _only,
            group_fallbacks((FastGptOssAttention,), _GROUPS),
            ("qkv", "o"),
        ),
    )
    register_parts(
        "gpt_oss",
        gpt_oss,
        "gpt_oss",
        [
            (versions, {"causal_lm_loss": causal_lm, "attention": attention})
            for (versions, causal_lm), attention in zip(_RANGES, _ATTENTION, strict=True)
        ],
        _parts,
    )
