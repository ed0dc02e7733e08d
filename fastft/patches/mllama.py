"""Llama 3.2 Vision (``MllamaForConditionalGeneration``, model_type ``mllama``): the language model on the fused path,
the vision model and projector stock.

- Self-attention decoder layers: Llama's (GQA, RoPE with Llama 3 scaling, SwiGLU, RMSNorm) through the shared fused
  attention, MLP and norm forwards of :mod:`fastft.patches.decoder`.
- Cross-attention decoder layers (every fifth layer of the 11B / 90B models): q reads the text, k and v read the
  projected image features, each normalised per head (``q_norm`` / ``k_norm``), no RoPE, tanh-gated residuals.
  :func:`cross_attention_forward` runs q and the pair k | v as two fused LoRA groups (one input each) and o as
  LoRA-O; the per-head norms are the language model's RMSNorm, so the norm patch serves them. A decode step, which
  reads k and v back from the cache instead of computing them, runs upstream's forward (q and o through peft's
  layers): the cache's layout is version-specific, and one token's projections are not the training hot path.
  Their MLPs are the same ``MllamaTextMLP`` as the self-attention layers', on the fused MLP.
- Loss: the fused linear cross-entropy on the conditional-generation head (:func:`causal_lm_forward`, with the output
  class upstream returns).
- Vision model (``vision_model``: patch embedding, local and gated global encoders, LayerNorm) and the
  ``multi_modal_projector``: upstream's modules, none of whose classes the language model shares.

The records cover the four transformers ranges the lanes test, each with the signatures read from that release.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version

from fastft.kernels.custom_ops import compiling
from fastft.patches.arguments import ArgumentReader
from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    _CACHE_NAMES,
    Family,
    _interface,
    attention_forward,
    gated_mlp_forward,
    group_fallbacks,
    loss_fallbacks,
    mlp_activation,
    model_type_only,
    rms_norm_forward,
    update_cache,
)
from fastft.patches.fused_groups import fused_o_group, fused_qkv
from fastft.patches.lora_layers import group_weights
from fastft.patches.parts import Part, register_parts
from fastft.patches.plans import group_objects, group_stamp, planned

try:
    from transformers.models.mllama import modeling_mllama as mllama
except ImportError:  # a transformers without Mllama
    mllama = None

MODEL_TYPE = "mllama"
# transformers 4.53 returns (output, weights, cache) from both attentions; 4.54 dropped the cache.
_RETURNS_CACHE = Version(transformers.__version__) < Version("4.54")
# The cross-attention's fused groups: q from the text, k | v from the image features, o.
_Q, _KV, _O = ("q_proj",), ("k_proj", "v_proj"), ("o_proj",)


def _text_mlp_only(model: torch.nn.Module) -> str | None:
    reason = model_type_only(MODEL_TYPE)(model)
    if reason:
        return reason
    text = model.config.get_text_config()
    if mlp_activation(text) is None:
        return f"hidden_act {getattr(text, 'hidden_act', None)!r} has no fused gate kernel"
    return None


def _group_runner(module: torch.nn.Module, names: tuple[str, ...], group: Callable) -> Callable:
    """``run(x) -> (y, ...)`` for the projections ``names`` of ``module``: fused, or their own forwards."""
    weights = group_weights(module, names)
    if isinstance(weights, str):
        return lambda x: tuple(getattr(module, name)(x) for name in names)
    return group(names, weights)


class _CrossAttentionPlan:
    """What a cross-attention module decided: how q, k | v and o run, and its attention function."""

    __slots__ = ("attention", "kv", "o", "q")

    def __init__(self, family: Family, module: torch.nn.Module) -> None:
        self.q = _group_runner(module, _Q, fused_qkv)
        self.kv = _group_runner(module, _KV, fused_qkv)
        self.o = _group_runner(module, _O, fused_o_group)
        self.attention = _interface(family, module)


def _cross_attention_plan(family: Family, module: torch.nn.Module) -> _CrossAttentionPlan:
    if compiling():
        return _CrossAttentionPlan(family, module)
    names = _Q + _KV + _O
    stamp = (torch.is_grad_enabled(), module.config._attn_implementation, group_stamp(module, names))
    return planned(module, stamp, lambda: (_CrossAttentionPlan(family, module), group_objects(module, names)))


def cross_attention_forward(family: Family, upstream_class: type) -> Callable[..., Any]:
    """The fused forward of Mllama's text cross-attention (``upstream_class``; its installed signature, shown as its
    own): q, k | v and o through the fused LoRA groups, the per-head norms and the attention function as upstream's.
    A call without ``cross_attention_states`` (a decode step reading k / v from the cache) is upstream's forward."""
    signature = inspect.signature(upstream_class.forward)
    reader = ArgumentReader(signature)
    upstream_forward = upstream_class.forward
    cache_name = next(name for name in _CACHE_NAMES if name in signature.parameters)
    old_names = tuple(name for name in _CACHE_NAMES if name != cache_name)
    takes_cache_position = "cache_position" in signature.parameters

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        named, extra = reader.read(self, args, dict(kwargs))
        states = named["cross_attention_states"]
        if states is None:
            return upstream_forward(self, *args, **kwargs)
        cache = named[cache_name]
        for name in old_names:
            shim = extra.pop(name, None)
            cache = shim if cache is None else cache
        hidden_states = named["hidden_states"]
        batch, length, _ = hidden_states.shape
        plan = _cross_attention_plan(family, self)
        query = plan.q(hidden_states)[0].view(batch, length, -1, self.head_dim).transpose(1, 2)
        key, value = (
            t.view(batch, -1, self.num_key_value_heads, self.head_dim).transpose(1, 2) for t in plan.kv(states)
        )
        query, key = self.q_norm(query), self.k_norm(key)
        if cache is not None:
            cache_kwargs = {"cache_position": named.get("cache_position")}
            key, value = update_cache(
                cache, self.layer_idx, key, value, takes_cache_position, cache_name, extra, cache_kwargs
            )
        attn_output, attn_weights = plan.attention(
            self,
            query,
            key,
            value,
            named["attention_mask"],
            dropout=0.0 if not self.training else self.dropout,
            scaling=self.scaling,
            **extra,
        )
        output = plan.o(attn_output.reshape(batch, length, -1).contiguous())[0]
        if _RETURNS_CACHE:
            # 4.53 nulls the weights unless asked for them, and returns the cache as well.
            return output, attn_weights if named["output_attentions"] else None, cache
        return output, attn_weights

    forward.__signature__ = signature
    forward.__doc__ = f"``{upstream_class.__name__}.forward`` with q, k | v and o through the fused LoRA kernels."
    return forward


if mllama is not None:
    _OUTPUT = getattr(mllama, "MultimodalCausalLMOutputWithPast", None)

    MLLAMA = Family(
        name="mllama",
        model_type=MODEL_TYPE,
        upstream=mllama,
        prefix="Mllama",
        class_names=(
            ("RMSNorm", "MllamaTextRMSNorm"),
            ("Attention", "MllamaTextSelfAttention"),
            ("MLP", "MllamaTextMLP"),
            ("ForCausalLM", "MllamaForConditionalGeneration"),
        ),
        returns_cache=_RETURNS_CACHE,
    )

    class FastMllamaTextRMSNorm(mllama.MllamaTextRMSNorm):
        """The language model's RMSNorm (layer norms, final norm, the cross-attention's per-head q / k norms) through
        the fused RMSNorm kernel."""

        forward = rms_norm_forward

    class FastMllamaTextMLP(mllama.MllamaTextMLP):
        """The language model's MLP (self- and cross-attention layers alike) as one fused LoRA-MLP node."""

        forward = gated_mlp_forward(MLLAMA)

    class FastMllamaTextSelfAttention(mllama.MllamaTextSelfAttention):
        """``MllamaTextSelfAttention`` with the fused LoRA-QKV, RoPE and LoRA-O kernels."""

        forward = attention_forward(MLLAMA, mllama.MllamaTextSelfAttention)

        @property
        def attention_dropout(self) -> float:
            """Upstream's name for it here is ``dropout``; the shared forward reads ``attention_dropout``."""
            return self.dropout

    class FastMllamaTextCrossAttention(mllama.MllamaTextCrossAttention):
        """``MllamaTextCrossAttention`` with q, k | v and o through the fused LoRA kernels."""

        forward = cross_attention_forward(MLLAMA, mllama.MllamaTextCrossAttention)

    class FastMllamaForConditionalGeneration(FusedLossState, mllama.MllamaForConditionalGeneration):
        """``MllamaForConditionalGeneration`` whose training loss goes through the fused linear cross-entropy."""

        forward = causal_lm_forward(mllama.MllamaForConditionalGeneration, output_class=_OUTPUT)

    # Per range: self-attention, cross-attention, then the conditional-generation head's signature, as each release
    # writes them.
    _VISION_ARGS = (
        "input_ids=None, pixel_values=None, aspect_ratio_mask=None, aspect_ratio_ids=None, attention_mask=None, "
        "cross_attention_mask=None, cross_attention_states=None, position_ids=None"
    )
    _RANGES = (
        (
            ">=4.53.3,<4.54",
            "(self, hidden_states, attention_mask, position_embeddings, output_attentions=False, use_cache=False, "
            "past_key_value=None, cache_position=None, **kwargs)",
            "(self, hidden_states, cross_attention_states=None, past_key_value=None, attention_mask=None, "
            "output_attentions=False, use_cache=None, cache_position=None, **kwargs)",
            f"(self, {_VISION_ARGS}, past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, "
            "output_attentions=None, output_hidden_states=None, return_dict=None, cache_position=None, "
            "logits_to_keep=0, **kwargs)",
        ),
        (
            ">=4.56,<4.58",
            "(self, hidden_states, attention_mask, position_embeddings, use_cache=False, past_key_values=None, "
            "cache_position=None, **kwargs)",
            "(self, hidden_states, cross_attention_states=None, past_key_values=None, attention_mask=None, "
            "use_cache=None, cache_position=None, **kwargs)",
            f"(self, {_VISION_ARGS}, past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, "
            "cache_position=None, logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.5.4,<5.24",
            "(self, hidden_states, attention_mask, position_embeddings, past_key_values=None, **kwargs)",
            "(self, hidden_states, cross_attention_states=None, past_key_values=None, attention_mask=None, "
            "use_cache=None, **kwargs)",
            f"(self, {_VISION_ARGS}, past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, "
            "logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.24,<5.25",
            "(self, hidden_states, attention_mask, position_embeddings, cache=None, **kwargs)",
            "(self, hidden_states, cross_attention_states=None, cache=None, attention_mask=None, use_cache=None, "
            "**kwargs)",
            f"(self, {_VISION_ARGS}, cache=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, "
            "**kwargs)",
        ),
    )
    _only = model_type_only(MODEL_TYPE)
    _CROSS_GROUPS = {".q_proj": _Q, ".kv": _KV, ".o_proj": _O}
    _parts = (
        Part("rms_norm", mllama.MllamaTextRMSNorm, FastMllamaTextRMSNorm, _only),
        Part(
            "attention",
            mllama.MllamaTextSelfAttention,
            FastMllamaTextSelfAttention,
            _only,
            group_fallbacks((FastMllamaTextSelfAttention,), {".qkv": MLLAMA.qkv, ".o_proj": MLLAMA.o}),
            ("qkv", "o"),
        ),
        Part(
            "cross_attention",
            mllama.MllamaTextCrossAttention,
            FastMllamaTextCrossAttention,
            _only,
            group_fallbacks((FastMllamaTextCrossAttention,), _CROSS_GROUPS),
            ("qkv", "o"),
        ),
        Part(
            "mlp",
            mllama.MllamaTextMLP,
            FastMllamaTextMLP,
            _text_mlp_only,
            group_fallbacks((FastMllamaTextMLP,), {"": MLLAMA.mlp}),
            ("gate_up", "down"),
        ),
        Part(
            "causal_lm_loss",
            mllama.MllamaForConditionalGeneration,
            FastMllamaForConditionalGeneration,
            _only,
            loss_fallbacks(FastMllamaForConditionalGeneration),
        ),
    )
    register_parts(
        "mllama",
        mllama,
        MODEL_TYPE,
        [
            (v, {"attention": a, "cross_attention": c, "causal_lm_loss": h, "mlp": "(self, x)"})
            for v, a, c, h in _RANGES
        ],
        _parts,
    )
