"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, model_type ``qwen2_5_vl``): the language model on the fused
path, the vision tower and merger stock.

- Language model: Qwen2's decoder (q / k / v biases in the fused LoRA-QKV epilogue, SwiGLU, RMSNorm) with
  multimodal RoPE (M-RoPE): each head's rotary frequencies are split into temporal / height / width sections
  (``mrope_section``), each turned by its own position id. transformers 5.24's rotary embedding hands the attention
  Llama's ``[batch, seq, head_dim]`` tables already recomposed; 4.53–5.23 hand ``[3, batch, seq, head_dim]`` and
  recompose inside the attention. :func:`mrope_tables` recomposes those before the fused RoPE, which then runs as
  for any Llama-style model (the same rotation, section by section).
- Loss: the fused linear cross-entropy on the conditional-generation head (:func:`causal_lm_forward`, with the
  output class upstream returns).
- Vision tower (``visual``: patch embedding, windowed attention blocks, patch merger): upstream's modules. Its blocks
  use the same RMSNorm class as the language model, so the norm patch swaps only the modules outside the tower.

The records cover the four transformers ranges the lanes test, each with the signatures read from that release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    attention_forward,
    gated_mlp_forward,
    group_fallbacks,
    loss_fallbacks,
    mlp_activation,
    model_type_only,
    rms_norm_forward,
)
from fastft.patches.parts import Part, register_parts

try:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl
except ImportError:  # a transformers without Qwen2.5-VL
    qwen2_5_vl = None

MODEL_TYPE = "qwen2_5_vl"
# transformers 4.56 started handing position_ids to the attention function and returning (output, weights) only.
_FROM_4_56 = Version(transformers.__version__) >= Version("4.56")


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def mrope_section(config: Any) -> list[int]:
    """The M-RoPE sections (temporal, height, width; rotary pairs each) of a Qwen2.5-VL text config: in
    ``rope_parameters`` on transformers 5.x, in ``rope_scaling`` on 4.x."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = rope.get("mrope_section")
    if section is None:
        raise ValueError(
            f"fastft qwen2_5_vl attention: the text config ({type(config).__name__}) names no mrope_section in "
            f"rope_parameters / rope_scaling (got {rope!r}); Qwen2.5-VL's config.json has one, e.g. [16, 24, 24]. "
            "Load the checkpoint's own config.json."
        )
    return list(section)


def mrope_tables(module: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's ``[3, batch, seq, head_dim]`` M-RoPE tables (one per position axis) as one ``[batch, seq,
    head_dim]`` table: along head_dim, section ``i`` (repeated for the second half, as ``rotate_half`` pairs them) is
    taken from axis ``i % 3``, as upstream's ``apply_multimodal_rotary_pos_emb`` does. Tables already in that shape
    (transformers 5.24 recomposes them in the rotary embedding) pass through."""
    if cos.dim() != 4:
        return cos, sin
    sections = mrope_section(module.config) * 2

    def recompose(table: torch.Tensor) -> torch.Tensor:
        return torch.cat([part[i % 3] for i, part in enumerate(table.split(sections, dim=-1))], dim=-1)

    return recompose(cos), recompose(sin)


def _layer_window(module: torch.nn.Module) -> dict[str, Any]:
    return {"sliding_window": module.sliding_window}


def language_model_swap(upstream_class: type, fast_class: type, vision_class: type) -> Callable[[torch.nn.Module], int]:
    """A record's ``apply``: every module of exactly ``upstream_class`` outside the vision tower (modules of
    ``vision_class``) becomes ``fast_class``; the tower's own stay upstream's."""

    def apply(model: torch.nn.Module) -> int:
        tower = {id(m) for owner in model.modules() if type(owner) is vision_class for m in owner.modules()}
        count = 0
        for module in model.modules():
            if type(module) is upstream_class and id(module) not in tower:
                module.__class__ = fast_class
                count += 1
        return count

    return apply


def text_mlp_only(model_type: str) -> Callable[[torch.nn.Module], str | None]:
    """A record's ``applies_to`` for a vision-language model's gated text MLP: the activation is read from the text
    config (the top-level config of a vision-language model has none). Qwen3-VL's records use it too."""
    family_only = model_type_only(model_type)

    def applies_to(model: torch.nn.Module) -> str | None:
        reason = family_only(model)
        if reason:
            return reason
        text = _text_config(model.config)
        if mlp_activation(text) is None:
            return f"hidden_act {getattr(text, 'hidden_act', None)!r} has no fused gate kernel"
        return None

    return applies_to


if qwen2_5_vl is not None:
    # transformers 5.x names the norm after the model; 4.x keeps Qwen2's name for its copy.
    _NORM = getattr(qwen2_5_vl, "Qwen2_5_VLRMSNorm", None) or qwen2_5_vl.Qwen2RMSNorm
    _VISION = qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    _OUTPUT = (
        getattr(qwen2_5_vl, "Qwen2_5_VLCausalLMOutputWithPast", None) or qwen2_5_vl.MultimodalCausalLMOutputWithPast
    )

    QWEN2_5_VL = Family(
        name="qwen2_5_vl",
        model_type=MODEL_TYPE,
        upstream=qwen2_5_vl,
        prefix="Qwen2_5_VL",
        attention_kwargs=_layer_window,
        rotary_tables=mrope_tables,
        class_names=(
            ("RMSNorm", _NORM.__name__),
            ("MLP", "Qwen2MLP"),
            ("ForCausalLM", "Qwen2_5_VLForConditionalGeneration"),
        ),
        position_ids_to_attention=_FROM_4_56,
        returns_cache=not _FROM_4_56,
    )

    class FastQwen2_5_VLRMSNorm(_NORM):
        """The language model's RMSNorm (not the vision tower's) through the fused RMSNorm kernel."""

        forward = rms_norm_forward

    class FastQwen2_5_VLMLP(qwen2_5_vl.Qwen2MLP):
        """The language model's ``Qwen2MLP`` as one fused LoRA-MLP node."""

        forward = gated_mlp_forward(QWEN2_5_VL)

    class FastQwen2_5_VLAttention(qwen2_5_vl.Qwen2_5_VLAttention):
        """``Qwen2_5_VLAttention`` with the fused LoRA-QKV (q / k / v bias in its epilogue), M-RoPE (recomposed
        tables) and LoRA-O kernels."""

        forward = attention_forward(QWEN2_5_VL, qwen2_5_vl.Qwen2_5_VLAttention)

    class FastQwen2_5_VLForConditionalGeneration(FusedLossState, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
        """``Qwen2_5_VLForConditionalGeneration`` whose training loss goes through the fused linear cross-entropy."""

        forward = causal_lm_forward(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration, output_class=_OUTPUT)

    # Per range: attention, then the conditional-generation head's signature, as each release writes them.
    _PAST = "past_key_values=None, inputs_embeds=None, labels=None, use_cache=None"
    _VISION_ARGS = "pixel_values=None, pixel_values_videos=None, image_grid_thw=None, video_grid_thw=None"
    _HEAD_4 = (
        f"(self, input_ids=None, attention_mask=None, position_ids=None, {_PAST}, output_attentions=None, "
        f"output_hidden_states=None, {_VISION_ARGS}, rope_deltas=None, cache_position=None, second_per_grid_ts=None"
    )
    _RANGES = (
        (
            ">=4.53.3,<4.56",
            "(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, "
            "output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **kwargs)",
            f"{_HEAD_4}, **kwargs)",
        ),
        (
            ">=4.56,<4.58",
            "(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, "
            "output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **kwargs)",
            f"{_HEAD_4}, logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.5.4,<5.24",
            "(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, "
            "output_attentions=False, use_cache=False, position_embeddings=None, **kwargs)",
            f"(self, input_ids=None, attention_mask=None, position_ids=None, {_PAST}, {_VISION_ARGS}, "
            "rope_deltas=None, mm_token_type_ids=None, second_per_grid_ts=None, logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.24,<5.25",
            "(self, hidden_states, attention_mask=None, position_ids=None, cache=None, position_embeddings=None, "
            "**kwargs)",
            "(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, "
            f"labels=None, use_cache=None, {_VISION_ARGS}, mm_token_type_ids=None, second_per_grid_ts=None, "
            "logits_to_keep=0, mm_encoder_outputs=None, **kwargs)",
        ),
    )
    _only = model_type_only(MODEL_TYPE)
    _HEAD = qwen2_5_vl.Qwen2_5_VLForConditionalGeneration

    def _swap(upstream: type, fast: type) -> Callable[[torch.nn.Module], int]:
        return language_model_swap(upstream, fast, _VISION)

    _parts = (
        Part("rms_norm", _NORM, FastQwen2_5_VLRMSNorm, _only, swap=_swap),
        Part(
            "attention",
            qwen2_5_vl.Qwen2_5_VLAttention,
            FastQwen2_5_VLAttention,
            _only,
            group_fallbacks((FastQwen2_5_VLAttention,), {".qkv": QWEN2_5_VL.qkv, ".o_proj": QWEN2_5_VL.o}),
            ("qkv", "o"),
            _swap,
        ),
        Part(
            "mlp",
            qwen2_5_vl.Qwen2MLP,
            FastQwen2_5_VLMLP,
            text_mlp_only(MODEL_TYPE),
            group_fallbacks((FastQwen2_5_VLMLP,), {"": QWEN2_5_VL.mlp}),
            ("gate_up", "down"),
            _swap,
        ),
        Part(
            "causal_lm_loss",
            _HEAD,
            FastQwen2_5_VLForConditionalGeneration,
            _only,
            loss_fallbacks(FastQwen2_5_VLForConditionalGeneration),
            swap=_swap,
        ),
    )
    register_parts(
        "qwen2_5_vl",
        qwen2_5_vl,
        MODEL_TYPE,
        [(v, {"attention": a, "causal_lm_loss": h, "mlp": "(self, x)"}) for v, a, h in _RANGES],
        _parts,
    )
