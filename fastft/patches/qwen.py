"""Qwen2 / Qwen2.5 and Qwen3 on the fused path, from the bodies in :mod:`fastft.patches.decoder`.

Qwen2's q / k / v carry a bias: :mod:`fastft.patches.lora_layers` reads it into the projection's
:class:`~fastft.kernels.LoRAWeights` and the fused LoRA-QKV GEMM adds it in its epilogue (cuBLAS or Triton path).
Qwen3 normalises q and k per head (``q_norm`` / ``k_norm``, RMSNorm over head_dim) between the projection and RoPE;
they are ``Qwen3RMSNorm`` modules, so the RMSNorm patch runs them through the fused kernel with its dW. Both pass
their layer's sliding window (None unless ``use_sliding_window``) to upstream's attention function.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    FastClasses,
    attention_forward,
    gated_mlp_forward,
    register_family,
    rms_norm_forward,
)
from fastft.patches.fused_layer import decoder_layer_forward, returns_tuple
from fastft.patches.llama import ranges


def _layer_window(module: torch.nn.Module) -> dict[str, Any]:
    return {"sliding_window": module.sliding_window}


QWEN2 = Family(name="qwen2", model_type="qwen2", upstream=qwen2, prefix="Qwen2", attention_kwargs=_layer_window)
QWEN3 = Family(
    name="qwen3",
    model_type="qwen3",
    upstream=qwen3,
    prefix="Qwen3",
    head_norms=True,
    attention_kwargs=_layer_window,
)


class FastQwen2RMSNorm(qwen2.Qwen2RMSNorm):
    """``Qwen2RMSNorm`` through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastQwen2MLP(qwen2.Qwen2MLP):
    """``Qwen2MLP`` as one fused LoRA-MLP node."""

    forward = gated_mlp_forward(QWEN2)


class FastQwen2Attention(qwen2.Qwen2Attention):
    """``Qwen2Attention`` with the fused LoRA-QKV (q / k / v bias in its epilogue), RoPE and LoRA-O kernels."""

    forward = attention_forward(QWEN2, qwen2.Qwen2Attention)


class FastQwen2DecoderLayer(qwen2.Qwen2DecoderLayer):
    """``Qwen2DecoderLayer`` as one fused autograd node where all its parts are fused (else upstream's forward)."""

    forward = decoder_layer_forward(QWEN2, qwen2.Qwen2DecoderLayer, returns_tuple())


class FastQwen2ForCausalLM(FusedLossState, qwen2.Qwen2ForCausalLM):
    """``Qwen2ForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = causal_lm_forward(qwen2.Qwen2ForCausalLM)


class FastQwen3RMSNorm(qwen3.Qwen3RMSNorm):
    """``Qwen3RMSNorm`` (the layer norms and the per-head q_norm / k_norm) through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastQwen3MLP(qwen3.Qwen3MLP):
    """``Qwen3MLP`` as one fused LoRA-MLP node."""

    forward = gated_mlp_forward(QWEN3)


class FastQwen3Attention(qwen3.Qwen3Attention):
    """``Qwen3Attention`` with the fused LoRA-QKV, per-head q / k RMSNorm, RoPE and LoRA-O kernels."""

    forward = attention_forward(QWEN3, qwen3.Qwen3Attention)


class FastQwen3ForCausalLM(FusedLossState, qwen3.Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = causal_lm_forward(qwen3.Qwen3ForCausalLM)


register_family(
    QWEN2,
    FastClasses(FastQwen2RMSNorm, FastQwen2Attention, FastQwen2MLP, FastQwen2ForCausalLM, FastQwen2DecoderLayer),
    ranges(),
)
register_family(QWEN3, FastClasses(FastQwen3RMSNorm, FastQwen3Attention, FastQwen3MLP, FastQwen3ForCausalLM), ranges())
