"""Llama patches: RMSNorm, attention (fused LoRA-QKV, RoPE, fused LoRA-O), the MLP (fused LoRA-MLP) and the
causal-LM loss (fused linear cross-entropy, in :mod:`fastft.patches.llama_loss`) through fastft's kernels.

Each patch swaps the class of the matching module instances of one model for a subclass defined here; the
upstream classes, the decoder layer's forward (which transformers 5.23 wraps for checkpointing) and every other
model are left alone. A subclass changes only ``forward``, so ``isinstance`` checks, state dicts, peft wrapping of
the projections and hooks keep working.

The attention subclasses copy the upstream forward of their version range, with q / k / v through
:func:`fastft.kernels.lora_qkv`, the rotary step through :func:`fastft.kernels.apply_rope` and o through
:func:`fastft.kernels.lora_o`; the attention function itself (eager / sdpa / flash, as configured) and the KV cache
are upstream's. Their ``forward`` signature is the upstream one, so the decoder layer binds its arguments exactly as
it would for stock attention. ``tests/test_patches_llama.py`` checks both.

A group of projections that the fused kernels cannot serve (see :mod:`fastft.patches.lora_layers`: dropout, DoRA,
bias, another quantiser, adapters disabled or merged, hooks) runs through the modules' own forwards, layer by layer;
``patch_report`` lists those layers and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.models.llama import modeling_llama as upstream

from fastft.kernels import apply_rope, lora_mlp, lora_o, lora_qkv, rms_norm, swiglu
from fastft.patches.llama_loss import FastLlamaForCausalLM, head_reason
from fastft.patches.lora_layers import group_weights
from fastft.registry import PatchRecord, register

_MODULE = "transformers.models.llama.modeling_llama"
_SILU_NAMES = ("silu", "swish")


class FastLlamaRMSNorm(upstream.LlamaRMSNorm):
    """``LlamaRMSNorm`` through the fused RMSNorm kernel (same casting rule, gives dX and dW)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


_QKV = ("q_proj", "k_proj", "v_proj")
_O = ("o_proj",)
_MLP = ("gate_proj", "up_proj", "down_proj")


class FastLlamaMLP(upstream.LlamaMLP):
    """``LlamaMLP`` as one fused LoRA-MLP node (gate / up / down with their adapters, SwiGLU between); a layer the
    fused kernel cannot serve runs its projections' own forwards around the SwiGLU kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = group_weights(self, _MLP)
        if isinstance(weights, str):
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return lora_mlp(x, *weights)


def _project_and_rotate(
    module: upstream.LlamaAttention, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    weights = group_weights(module, _QKV)
    if isinstance(weights, str):
        projected = (module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states))
    else:
        projected = lora_qkv(hidden_states, *weights)
    query, key, value = (t.view(hidden_shape).transpose(1, 2) for t in projected)
    cos, sin = position_embeddings
    query, key = apply_rope(query, key, cos, sin)
    return query, key, value, cos, sin


def _attend_and_project(
    module: upstream.LlamaAttention,
    interface: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    input_shape: torch.Size,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    attn_output, attn_weights = interface(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    weights = group_weights(module, _O)
    if isinstance(weights, str):
        return module.o_proj(attn_output), attn_weights
    return lora_o(attn_output, *weights), attn_weights


def _interface_by_name(module: upstream.LlamaAttention) -> Callable[..., Any]:
    if module.config._attn_implementation == "eager":
        return upstream.eager_attention_forward
    return upstream.ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]


class FastLlamaAttention(upstream.LlamaAttention):
    """``LlamaAttention`` of transformers 5.x (``past_key_values``, no ``cache_position``) with the fused LoRA
    kernels and RoPE."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, key, value, _, _ = _project_and_rotate(self, hidden_states, position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface = upstream.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, upstream.eager_attention_forward
        )
        return _attend_and_project(self, interface, query, key, value, attention_mask, hidden_states.shape[:-1], kwargs)


def _attend_with_cache_position(
    module: upstream.LlamaAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any,
    cache_position: torch.LongTensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformers 4.53–4.57 body: the cache update takes sin / cos (RoPE-aware caches) and cache_position
    (the static cache), and the attention function is looked up by name."""
    query, key, value, cos, sin = _project_and_rotate(module, hidden_states, position_embeddings)
    if cache is not None:
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
        key, value = cache.update(key, value, module.layer_idx, cache_kwargs)
    interface = _interface_by_name(module)
    return _attend_and_project(module, interface, query, key, value, attention_mask, hidden_states.shape[:-1], kwargs)


class FastLlamaAttention456(upstream.LlamaAttention):
    """``LlamaAttention`` of transformers 4.56–4.57 (``past_key_values`` and ``cache_position``) with the RoPE
    kernel and the fused LoRA kernels."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Upstream accepts the pre-4.56 name through a deprecation shim; so does this forward.
        past_key_values = kwargs.pop("past_key_value", past_key_values)
        return _attend_with_cache_position(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position, kwargs
        )


class FastLlamaAttention453(upstream.LlamaAttention):
    """``LlamaAttention`` of transformers 4.53–4.55 (``past_key_value`` and ``cache_position``) with the RoPE
    kernel and the fused LoRA kernels."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_value: Any = None,
        cache_position: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _attend_with_cache_position(
            self, hidden_states, position_embeddings, attention_mask, past_key_value, cache_position, kwargs
        )


def _swap_class(upstream_class: type, fast_class: type) -> Callable[[torch.nn.Module], int]:
    def apply(model: torch.nn.Module) -> int:
        count = 0
        for module in model.modules():
            # Exact type: a user's own subclass of the upstream module keeps its forward.
            if type(module) is upstream_class:
                module.__class__ = fast_class
                count += 1
        return count

    return apply


def _llama_only(model: torch.nn.Module) -> str | None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type != "llama":
        return f"model_type {model_type!r} is not llama"
    return None


def _silu_mlp_only(model: torch.nn.Module) -> str | None:
    reason = _llama_only(model)
    if reason:
        return reason
    activation = getattr(model.config, "hidden_act", None)
    if activation not in _SILU_NAMES:
        return f"hidden_act {activation!r} is not SiLU, so the MLP is not SwiGLU"
    return None


def _causal_lm_only(model: torch.nn.Module) -> str | None:
    reason = _llama_only(model)
    if reason:
        return reason
    if not any(type(module) is upstream.LlamaForCausalLM for module in model.modules()):
        return "no LlamaForCausalLM head (a bare LlamaModel has no loss)"
    return None


def _group_fallbacks(fast_classes: tuple[type, ...], groups: dict[str, tuple[str, ...]]):
    """Report which patched modules would run a group through the stock projections in training, and why."""

    def fallbacks(model: torch.nn.Module) -> dict[str, str]:
        found = {}
        for name, module in model.named_modules():
            if type(module) not in fast_classes:
                continue
            for suffix, names in groups.items():
                weights = group_weights(module, names, training=True)
                if isinstance(weights, str):
                    found[f"{name}{suffix}"] = weights
        return found

    return fallbacks


def _loss_fallbacks(model: torch.nn.Module) -> dict[str, str]:
    found = {}
    for name, module in model.named_modules():
        if type(module) is FastLlamaForCausalLM:
            reason = head_reason(module)
            if reason:
                found[name or "lm_head"] = reason
    return found


def register_llama(
    transformers_range: str, attention: type, attention_fingerprint: str, causal_lm_fingerprint: str
) -> None:
    """Register the Llama patches for one range of transformers versions.

    Args:
        transformers_range: The ``packaging`` specifier of the transformers versions they were tested against.
        attention: The attention subclass written for that range.
        attention_fingerprint: ``LlamaAttention.forward``'s signature in that range
            (:func:`fastft.registry.signature_fingerprint`).
        causal_lm_fingerprint: ``LlamaForCausalLM.forward``'s signature in that range.
    """
    versions = {"transformers": transformers_range}
    register(
        PatchRecord(
            name="llama.rms_norm",
            target=f"{_MODULE}.LlamaRMSNorm.forward",
            versions=versions,
            fingerprint="(self, hidden_states)",
            applies_to=_llama_only,
            apply=_swap_class(upstream.LlamaRMSNorm, FastLlamaRMSNorm),
            replacement=FastLlamaRMSNorm,
        )
    )
    register(
        PatchRecord(
            name="llama.attention",
            target=f"{_MODULE}.LlamaAttention.forward",
            versions=versions,
            fingerprint=attention_fingerprint,
            applies_to=_llama_only,
            apply=_swap_class(upstream.LlamaAttention, attention),
            replacement=attention,
            fallbacks=_group_fallbacks((attention,), {".qkv": _QKV, ".o_proj": _O}),
            gemm_groups=("qkv", "o"),
        )
    )
    register(
        PatchRecord(
            name="llama.mlp",
            target=f"{_MODULE}.LlamaMLP.forward",
            versions=versions,
            fingerprint="(self, x)",
            applies_to=_silu_mlp_only,
            apply=_swap_class(upstream.LlamaMLP, FastLlamaMLP),
            replacement=FastLlamaMLP,
            fallbacks=_group_fallbacks((FastLlamaMLP,), {"": _MLP}),
            gemm_groups=("gate_up", "down"),
        )
    )
    register(
        PatchRecord(
            name="llama.causal_lm_loss",
            target=f"{_MODULE}.LlamaForCausalLM.forward",
            versions=versions,
            fingerprint=causal_lm_fingerprint,
            applies_to=_causal_lm_only,
            apply=_swap_class(upstream.LlamaForCausalLM, FastLlamaForCausalLM),
            replacement=FastLlamaForCausalLM,
            fallbacks=_loss_fallbacks,
        )
    )


# Each range starts at a version the lanes test (.ci/lanes/) and ends before the next minor release that no lane
# has run; inside it the signature check still guards every release.
register_llama(
    ">=4.53.3,<4.56",
    FastLlamaAttention453,
    "(self, hidden_states, position_embeddings, attention_mask, past_key_value=None, cache_position=None, **kwargs)",
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, cache_position=None, "
    "logits_to_keep=0, **kwargs)",
)
register_llama(
    ">=4.56,<4.58",
    FastLlamaAttention456,
    "(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None, **kwargs)",
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, cache_position=None, logits_to_keep=0, **kwargs)",
)
register_llama(
    ">=5.5.4,<5.24",
    FastLlamaAttention,
    "(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs)",
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, logits_to_keep=0, **kwargs)",
)
