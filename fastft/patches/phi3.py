"""Phi-3 and Phi-4-mini (model_type ``phi3``): packed projections on the fused path, from the bodies in
:mod:`fastft.patches.decoder`.

``qkv_proj`` is ``[(heads + 2 · kv_heads) · head_dim, hidden]`` and ``gate_up_proj`` ``[2 · intermediate, hidden]``,
each with one LoRA adapter over the whole packed projection (peft adapts the module as it is). The fused path runs
each as one GEMM launch and splits the output at the widths the config implies — q ``heads · head_dim``, k and v
``kv_heads · head_dim`` each; gate then up, ``intermediate`` each — never at a width derived from the hidden size.
The load-time contract (:mod:`fastft.contracts`) checks the stored qkv_proj width against the config before any
weight is loaded. Phi-4-mini's partial rotary (``partial_rotary_factor``) turns only the first dims, as upstream.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.phi3 import modeling_phi3 as phi3

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    FastClasses,
    attention_forward,
    gated_mlp_forward,
    register_family,
    rms_norm_forward,
)
from fastft.patches.llama import ranges


def _config_window(module: torch.nn.Module) -> dict[str, Any]:
    return {"sliding_window": getattr(module.config, "sliding_window", None)}


PHI3 = Family(
    name="phi3",
    model_type="phi3",
    upstream=phi3,
    prefix="Phi3",
    attention_kwargs=_config_window,
    qkv=("qkv_proj",),
    mlp=("gate_up_proj", "down_proj"),
)


class FastPhi3RMSNorm(phi3.Phi3RMSNorm):
    """``Phi3RMSNorm`` through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastPhi3MLP(phi3.Phi3MLP):
    """``Phi3MLP`` (packed gate_up) as one fused LoRA-MLP node."""

    forward = gated_mlp_forward(PHI3)


class FastPhi3Attention(phi3.Phi3Attention):
    """``Phi3Attention`` with the packed LoRA-QKV launch split at the config's widths, RoPE and LoRA-O."""

    forward = attention_forward(PHI3, phi3.Phi3Attention)


class FastPhi3ForCausalLM(FusedLossState, phi3.Phi3ForCausalLM):
    """``Phi3ForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = causal_lm_forward(phi3.Phi3ForCausalLM)


register_family(
    PHI3,
    FastClasses(FastPhi3RMSNorm, FastPhi3Attention, FastPhi3MLP, FastPhi3ForCausalLM),
    ranges(mlp_fingerprint="(self, hidden_states)"),
)
