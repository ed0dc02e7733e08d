"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, model_type ``qwen3_vl``; transformers >= 4.57): the language model on
the fused path, the vision tower, its merger and DeepStack mergers stock.

- Language model: Qwen3's decoder (per-head ``q_norm`` / ``k_norm`` between the projection and RoPE, SwiGLU, RMSNorm;
  an explicit head_dim) with interleaved multimodal RoPE: the temporal / height / width position ids turn rotary
  pairs interleaved ``T H W T H W ...`` over the first ``3 · mrope_section[1]`` pairs, the rest temporal. Every
  transformers with the family (4.57, 5.x up to 5.24) interleaves in the rotary embedding and hands the attention
  Llama's ``[batch, seq, head_dim]`` tables, so the fused RoPE takes them as they come (no
  :attr:`~fastft.patches.decoder.Family.rotary_tables`, unlike Qwen2.5-VL before 5.24).
- DeepStack: the text model adds the vision tower's intermediate features (``deepstack_visual_embeds``) to the
  image tokens' hidden states (``visual_pos_masks``) after each of its first decoder layers. That runs in upstream's
  text-model forward, between the layers; only the attention, MLP and norm modules inside them are swapped, so it
  runs unchanged (and gradient checkpointing, which wraps the decoder layers, keeps it outside the checkpoint).
- Loss: the fused linear cross-entropy on the conditional-generation head (:func:`causal_lm_forward`, with the
  output class upstream returns).
- Vision tower (``visual``: patch embedding, blocks, merger, DeepStack mergers): upstream's modules. Its norms are
  ``nn.LayerNorm`` and its MLP is not gated, so no record here names a class it uses.

The records cover the three transformers ranges with the family that the lanes test, each with the signatures read
from that release.
"""

from __future__ import annotations

from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    attention_forward,
    gated_mlp_forward,
    group_fallbacks,
    loss_fallbacks,
    model_type_only,
    rms_norm_forward,
)
from fastft.patches.parts import Part, register_parts
from fastft.patches.qwen2_5_vl import text_mlp_only

try:
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl
except ImportError:  # transformers < 4.57 has no Qwen3-VL
    qwen3_vl = None

MODEL_TYPE = "qwen3_vl"

if qwen3_vl is not None:
    # 4.57 and 5.0-5.23 name the output after the model; 5.24 returns the shared multimodal one.
    _OUTPUT = getattr(qwen3_vl, "Qwen3VLCausalLMOutputWithPast", None) or qwen3_vl.MultimodalCausalLMOutputWithPast

    QWEN3_VL = Family(
        name="qwen3_vl",
        model_type=MODEL_TYPE,
        upstream=qwen3_vl,
        prefix="Qwen3VLText",
        head_norms=True,
        class_names=(("ForCausalLM", "Qwen3VLForConditionalGeneration"),),
    )

    class FastQwen3VLTextRMSNorm(qwen3_vl.Qwen3VLTextRMSNorm):
        """The language model's RMSNorm (layer norms and the per-head q_norm / k_norm) through the fused kernel."""

        forward = rms_norm_forward

    class FastQwen3VLTextMLP(qwen3_vl.Qwen3VLTextMLP):
        """The language model's ``Qwen3VLTextMLP`` as one fused LoRA-MLP node."""

        forward = gated_mlp_forward(QWEN3_VL)

    class FastQwen3VLTextAttention(qwen3_vl.Qwen3VLTextAttention):
        """``Qwen3VLTextAttention`` with the fused LoRA-QKV, per-head q / k RMSNorm, RoPE (the interleaved M-RoPE
        tables as the rotary embedding made them) and LoRA-O kernels."""

        forward = attention_forward(QWEN3_VL, qwen3_vl.Qwen3VLTextAttention)

    class FastQwen3VLForConditionalGeneration(FusedLossState, qwen3_vl.Qwen3VLForConditionalGeneration):
        """``Qwen3VLForConditionalGeneration`` whose training loss goes through the fused linear cross-entropy."""

        forward = causal_lm_forward(qwen3_vl.Qwen3VLForConditionalGeneration, output_class=_OUTPUT)

    # Per range: attention, then the conditional-generation head's signature, as each release writes them.
    _PAST = "past_key_values=None, inputs_embeds=None, labels=None"
    _VISION_ARGS = "pixel_values=None, pixel_values_videos=None, image_grid_thw=None, video_grid_thw=None"
    _ATTENTION = "(self, hidden_states, position_embeddings, attention_mask, "
    _RANGES = (
        (
            ">=4.57,<4.58",
            f"{_ATTENTION}past_key_values=None, cache_position=None, **kwargs)",
            f"(self, input_ids=None, attention_mask=None, position_ids=None, {_PAST}, {_VISION_ARGS}, "
            "cache_position=None, logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.5.4,<5.24",
            f"{_ATTENTION}past_key_values=None, **kwargs)",
            f"(self, input_ids=None, attention_mask=None, position_ids=None, {_PAST}, {_VISION_ARGS}, "
            "mm_token_type_ids=None, logits_to_keep=0, **kwargs)",
        ),
        (
            ">=5.24,<5.25",
            f"{_ATTENTION}cache=None, **kwargs)",
            "(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, "
            f"labels=None, {_VISION_ARGS}, mm_token_type_ids=None, logits_to_keep=0, mm_encoder_outputs=None, "
            "**kwargs)",
        ),
    )
    _only = model_type_only(MODEL_TYPE)
    _parts = (
        Part("rms_norm", qwen3_vl.Qwen3VLTextRMSNorm, FastQwen3VLTextRMSNorm, _only),
        Part(
            "attention",
            qwen3_vl.Qwen3VLTextAttention,
            FastQwen3VLTextAttention,
            _only,
            group_fallbacks((FastQwen3VLTextAttention,), {".qkv": QWEN3_VL.qkv, ".o_proj": QWEN3_VL.o}),
            ("qkv", "o"),
        ),
        Part(
            "mlp",
            qwen3_vl.Qwen3VLTextMLP,
            FastQwen3VLTextMLP,
            text_mlp_only(MODEL_TYPE),
            group_fallbacks((FastQwen3VLTextMLP,), {"": QWEN3_VL.mlp}),
            ("gate_up", "down"),
        ),
        Part(
            "causal_lm_loss",
            qwen3_vl.Qwen3VLForConditionalGeneration,
            FastQwen3VLForConditionalGeneration,
            _only,
            loss_fallbacks(FastQwen3VLForConditionalGeneration),
        ),
    )
    register_parts(
        "qwen3_vl",
        qwen3_vl,
        MODEL_TYPE,
        [(v, {"attention": a, "causal_lm_loss": h, "mlp": "(self, x)"}) for v, a, h in _RANGES],
        _parts,
    )
