"""A tiny random Qwen3-VL, built in the test (no downloads). The tokenizer, image processor and image + text batch are
Qwen2.5-VL's (:mod:`vlm_tiny`): Qwen3-VL keeps Qwen's vision special tokens and Qwen2-VL's image preprocessing."""

from __future__ import annotations

from pathlib import Path

import torch
from vlm_tiny import CHAT_TEMPLATE, MERGE, PATCH, SPECIAL, TEMPORAL, _five, tiny_image_processor, tiny_tokenizer

TEXT_LAYERS = 3
# The vision blocks whose output DeepStack adds to the language model's hidden states after text layers 0 and 1; the
# third text layer gets none, so a DeepStack applied after the wrong layer changes the loss.
DEEPSTACK = [0, 1]
# head_dim 32 (explicit, wider than hidden / heads = 16, as Qwen3's), so 16 rotary pairs split temporal / height /
# width 6 / 5 / 5; interleaved, height and width take pairs 1, 4, ... and 2, 5, ... of the first 15.
HEAD_DIM = 32
SECTION = [6, 5, 5]


def tiny_config(tokenizer):
    """Three text layers (GQA 4 / 2 heads, head_dim 32, per-head q / k norms, interleaved M-RoPE) and a three-block
    vision tower with two DeepStack mergers."""
    from transformers import Qwen3VLConfig

    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            SPECIAL[3:],
            strict=True,
        )
    }
    rope = {"rope_type": "default", "mrope_section": SECTION, "mrope_interleaved": True}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # 4.57 reads rope_scaling and rope_theta; 5.x one rope_parameters.
        **(
            {"rope_parameters": {**rope, "rope_theta": 10000.0}}
            if _five()
            else {"rope_scaling": rope, "rope_theta": 10000.0}
        ),
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        out_hidden_size=64,
        # A 4 x 4 learned position grid, resampled to each image's patch grid.
        num_position_embeddings=16,
        deepstack_visual_indexes=DEEPSTACK,
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def save_tiny_qwen3_vl(folder: Path) -> Path:
    """Save a tiny random Qwen3-VL (seed 0; norm weights and biases perturbed so a wrong norm or bias shows), its
    tokenizer with a chat template, and its image processor."""
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config(tokenizer)).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "bias" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            if "deepstack_merger_list" in name and name.endswith("weight") and parameter.dim() == 2:
                # The tiny tower's DeepStack features are ~0.02 at init; larger ones make a DeepStack added in the
                # wrong place or twice show far above fp32 rounding.
                parameter.mul_(10)
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tiny_image_processor().save_pretrained(folder)
    return folder
