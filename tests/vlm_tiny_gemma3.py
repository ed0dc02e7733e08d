"""A tiny random Gemma 3 with its SigLIP vision tower (``Gemma3ForConditionalGeneration``) and its processor, built in
the test (no downloads), and an image + text batch made the way Gemma 3's processor makes it (each
``<start_of_image>`` expanded to the image's soft tokens between blank lines, ``token_type_ids`` 1 on them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Gemma's special tokens, in the order the tiny vocabulary numbers them.
SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
IMAGE_TOKENS = {"boi_token": SPECIAL[4], "eoi_token": SPECIAL[5], "image_token": SPECIAL[6]}
# SigLIP: a 16 x 16 image in 4 px patches is a 4 x 4 grid, which the projector pools 2 x 2 into 4 soft tokens.
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 16, 4, 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with Gemma 3's image tokens (single tokens, never split) named as its processor reads
    them (``boi_token``, ``eoi_token``, ``image_token``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    vocab = {token: index for index, token in enumerate(SPECIAL)}
    for token in sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(pair) for pair in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        extra_special_tokens=IMAGE_TOKENS,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[4:])})
    return tokenizer


def tiny_config(tokenizer, **text_overrides):
    """Two text layers (GQA 4 / 2 heads, head_dim 32, query_pre_attn_scalar 24, a sliding layer whose 8-token window is
    shorter than the batch rows beside a full one) and a two-layer SigLIP tower (no pooling head, as Gemma 3's)."""
    from transformers import Gemma3Config

    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        # Set, although Gemma 3's checkpoints leave it null: the conditional-generation head never applies it (only
        # Gemma3ForCausalLM does), so a fused loss that did would show here.
        final_logit_softcapping=4.0,
        # Wider than 0.02, as the text family's test: the logits and the image's effect on them are far above fp32
        # rounding.
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    text.update(text_overrides)
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    ids = {
        "boi_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["boi_token"]),
        "eoi_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["eoi_token"]),
        "image_token_index": tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["image_token"]),
    }
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE, **ids)


def tiny_image_processor():
    """Gemma 3's image processor sized for the tiny tower (images resized to 16 x 16, no pan-and-scan)."""
    try:  # transformers 5.x names its PIL backend apart (its default one needs torchvision).
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil as Gemma3ImageProcessor,
        )
    except ImportError:
        from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
    return Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)


def tiny_processor(tokenizer):
    """Gemma 3's processor over the tiny tokenizer and image processor (it has no video processor, so it builds
    without torchvision)."""
    from transformers import Gemma3Processor

    return Gemma3Processor(
        image_processor=tiny_image_processor(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )


def save_tiny_gemma3(folder: Path, **text_overrides) -> Path:
    """Save a tiny random Gemma 3 (seed 0; norm weights and the projector perturbed so a wrong norm shows and the image
    reaches the language model) and its processor."""
    from transformers import Gemma3ForConditionalGeneration

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(tiny_config(tokenizer, **text_overrides)).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("mm_input_projection_weight"):
                # Zeros at initialisation upstream: no image would reach the language model.
                parameter.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tiny_processor(tokenizer).save_pretrained(folder)
    return folder


def image(seed: int):
    """A random RGB image, 20 x 28 px (the processor resizes it)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (20, 28, 3), dtype=np.uint8))


def expanded(tokenizer) -> str:
    """What Gemma 3's processor puts in place of one ``<start_of_image>``."""
    soft = IMAGE_TOKENS["image_token"] * TOKENS_PER_IMAGE
    return f"\n\n{IMAGE_TOKENS['boi_token']}{soft}{IMAGE_TOKENS['eoi_token']}\n\n"


def image_batch(tokenizer, image_processor) -> dict[str, torch.Tensor]:
    """Two rows, the first with one image, the second with two (two image blocks, each bidirectional within itself
    only), the first padded on the left; images expanded and ``token_type_ids`` made as Gemma 3's processor makes
    them. Labels are the text tokens (image tokens, their markers and padding ignored)."""
    images = image_processor(images=[image(1), image(2), image(3)], return_tensors="pt")
    block = expanded(tokenizer)
    texts = [f"<bos>the cat{block}in a hat", f"<bos>a{block}tin{block}the hat in a tin"]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["image_token"])
    markers = torch.tensor([tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[name]) for name in ("boi_token", "eoi_token")])
    labels = input_ids.masked_fill((input_ids == image_id) | torch.isin(input_ids, markers), -100)
    labels[attention_mask == 0] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": images["pixel_values"],
        "token_type_ids": (input_ids == image_id).long(),
        "labels": labels,
    }
