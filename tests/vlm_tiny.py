"""A tiny random Qwen2.5-VL and its processor, built in the test (no downloads), and an image + text batch made the
way the processor makes it (each image placeholder expanded to the image's merged-patch count)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Qwen's special tokens, in the order the tiny vocabulary numbers them.
SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Patch 4 px, merged 2 x 2: a 16 x 24 image is a 4 x 6 patch grid, 6 image tokens (height and width differ, so the
# M-RoPE height and width positions differ too).
PATCH, MERGE, TEMPORAL = 4, 2, 2
IMAGE_SIZE = (16, 24)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with Qwen's image special tokens (single tokens, never split)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    vocab = {token: index for index, token in enumerate(SPECIAL)}
    for token in sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(pair) for pair in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # The processor insists on Qwen2's tokenizer class (4.x: the fast one; 5.x has one class).
    tokenizer_class = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
    tokenizer = tokenizer_class(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[3:])})
    return tokenizer


def _five() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5")


def tiny_config(tokenizer):
    """Two text layers (GQA 4 / 2 heads, head_dim 16, M-RoPE sections 2 / 3 / 3) and a two-block vision tower with one
    windowed and one full-attention block."""
    from transformers import Qwen2_5_VLConfig

    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            SPECIAL[3:],
            strict=True,
        )
    }
    section = [2, 3, 3]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **(
            {"rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}}
            if _five()
            else {"rope_scaling": {"type": "mrope", "mrope_section": section}, "rope_theta": 10000.0}
        ),
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        window_size=PATCH * MERGE * 2,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
    )
    if _five():
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    # transformers 4.x reads the text sizes from the top level as well as from text_config.
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **text, **ids)


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_image_processor():
    """Qwen2-VL's image processor sized for the tiny vision tower (a 16 x 24 image stays 16 x 24)."""
    try:  # transformers 5.x names its PIL backend apart (its default one needs torchvision).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Qwen2VLImageProcessor,
        )
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    pixels = dict(min_pixels=8 * 8, max_pixels=IMAGE_SIZE[0] * IMAGE_SIZE[1])
    return Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, **pixels)


def tiny_processor(tokenizer):
    """Qwen2.5-VL's processor over the tiny tokenizer and image processor, or None where the installed transformers
    cannot build one here: its video processor needs torchvision (the processor refuses to be built without one), and
    no CPU torchvision wheel matching this torch is installable here."""
    from transformers import Qwen2_5_VLProcessor

    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
        return Qwen2_5_VLProcessor(
            image_processor=tiny_image_processor(),
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=CHAT_TEMPLATE,
        )
    except (ImportError, TypeError):  # TypeError: the processor's class check finds BaseVideoProcessor a stub
        return None


def save_tiny_vlm(folder: Path) -> Path:
    """Save a tiny random Qwen2.5-VL (seed 0, norm weights perturbed so a wrong norm shows) and its processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer)).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "bias" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tiny_image_processor().save_pretrained(folder)
    processor = tiny_processor(tokenizer)
    if processor is not None:
        processor.save_pretrained(folder)
    return folder


def image(seed: int):
    """A random RGB image of IMAGE_SIZE (height x width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8))


def image_batch(tokenizer, image_processor) -> dict[str, torch.Tensor]:
    """Two rows, each with one image between text, the second padded on the left; ``<|image_pad|>`` expanded to the
    image's merged-patch count as Qwen2.5-VL's processor does. Labels are the text tokens (image, padding and vision
    markers ignored)."""
    images = image_processor(images=[image(1), image(2)], return_tensors="pt")
    grid = images["image_grid_thw"]
    prompt = "<|im_start|>user\n<|vision_start|>{}<|vision_end|>{}<|im_end|>\n"
    texts = [
        prompt.format("<|image_pad|>" * int(thw.prod() // MERGE**2), words)
        for thw, words in zip(grid, ("the cat in a hat", "a tin"), strict=True)
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].clone()
    special = torch.tensor([tokenizer.convert_tokens_to_ids(token) for token in SPECIAL])
    labels[torch.isin(labels, special)] = -100
    labels[batch["attention_mask"] == 0] = -100
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "pixel_values": images["pixel_values"],
        "image_grid_thw": grid,
        "labels": labels,
    }
    if _five():
        # transformers 5.x's processor marks image tokens (1) apart from text (0); the model builds the image tokens'
        # M-RoPE positions from these, and gives every token text positions without them.
        image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        inputs["mm_token_type_ids"] = (batch["input_ids"] == image_id).int()
    return inputs


def stock_vlm_peft(model, folder):
    """transformers + peft on the tiny Qwen2.5-VL in ``folder``, with ``model``'s LoRA targets and values."""
    from parity import stock_vlm

    return stock_vlm(model, folder)
