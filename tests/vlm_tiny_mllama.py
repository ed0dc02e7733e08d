"""A tiny random Llama 3.2 Vision (Mllama) and its processor, built in the test (no downloads), and an image + text
batch made by that processor (one ``<|image|>`` token per image; the language model reads the image through its
cross-attention layer, as the processor's ``cross_attention_mask`` says which tokens see which tiles)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Llama 3's special tokens the processor and chat format name, numbered first; ``<|image|>`` is added last, one past
# the text vocabulary, as in the real checkpoints (token 128256 of a 128256-word head): it is read, never predicted.
SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|eot_id|>", "<|python_tag|>")
IMAGE_TOKEN = "<|image|>"
# Tiles of 16 x 16 px in 4 px patches: 16 patches + the class token per tile. Two tiles at most, so the aspect
# ratios are 1x1, 1x2 and 2x1 (a 16 x 32 image is two tiles side by side, a 16 x 16 one a tile and a padding tile).
TILE, PATCH, MAX_TILES = 16, 4, 2
ASPECT_RATIOS = [[1, 1], [1, 2], [2, 1]]
IMAGE_SIZES = ((16, 32), (16, 16))
# The single cross-attention layer, between two self-attention layers.
CROSS_ATTENTION_LAYERS = [1]
TEXT_LAYERS = 3


def _five() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5")


def tiny_tokenizer():
    """A byte-level BPE tokenizer with Llama 3's special tokens and ``<|image|>`` (single tokens, never split)."""
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
        bos_token=SPECIAL[0],
        eos_token=SPECIAL[3],
        pad_token=SPECIAL[2],
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL[1:], IMAGE_TOKEN]})
    return tokenizer


def text_vocab_size(tokenizer) -> int:
    """The language model's head width: every token but ``<|image|>``, which is the last id."""
    return tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def tiny_config(tokenizer):
    """Three text layers (GQA 4 / 2 heads, head_dim 16, Llama 3 RoPE scaling), the middle one cross-attention; a
    vision model of two local and one global encoder layer on 16 x 16 tiles, two intermediate outputs concatenated."""
    from transformers import MllamaConfig

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    text = dict(
        vocab_size=text_vocab_size(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=CROSS_ATTENTION_LAYERS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"rope_parameters": {**rope, "rope_theta": 10000.0}} if _five() else {"rope_scaling": rope}),
    )
    intermediate = [0, 1]
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        max_num_tiles=MAX_TILES,
        supported_aspect_ratios=ASPECT_RATIOS,
        intermediate_layers_indices=intermediate,
        vision_output_dim=32 * (len(intermediate) + 1),
    )
    return MllamaConfig(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )


CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}"
)


def tiny_image_processor():
    """Mllama's image processor sized for the tiny vision model (16 px tiles, two at most); the PIL one on
    transformers 5.x, whose default needs torchvision."""
    try:
        from transformers.models.mllama.image_processing_pil_mllama import (
            MllamaImageProcessorPil as MllamaImageProcessor,
        )
    except ImportError:
        from transformers.models.mllama.image_processing_mllama import MllamaImageProcessor
    return MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)


def tiny_processor(tokenizer):
    """Mllama's processor over the tiny tokenizer and image processor."""
    from transformers import MllamaProcessor

    return MllamaProcessor(image_processor=tiny_image_processor(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def tiny_model(tokenizer):
    """A tiny random Mllama (seed 0) whose norms, biases and tanh gates are perturbed: the gates start at zero, which
    would shut the cross-attention layer off and hide any error in it."""
    from transformers import MllamaForConditionalGeneration

    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(tiny_config(tokenizer)).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("_gate"):
                parameter.fill_(0.8)
    return model


def save_tiny_mllama(folder: Path) -> Path:
    """Save a tiny random Mllama, its tokenizer and its processor."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tiny_processor(tokenizer).save_pretrained(folder)
    return folder


def image(seed: int, size: tuple[int, int]):
    """A random RGB image of ``size`` (height x width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def image_batch(processor) -> dict[str, torch.Tensor]:
    """Two rows, each with one image after a few words of text (those tokens see no image: their cross-attention
    rows are masked out), the second padded on the left; the first image two tiles wide, the second one tile.
    Labels are the text tokens (image token, padding and begin-of-text ignored)."""
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    texts = ["a hat <|image|>the cat in a hat", "in <|image|>a tin"]
    images = [[image(1, IMAGE_SIZES[0])], [image(2, IMAGE_SIZES[1])]]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    labels = batch["input_ids"].clone()
    ignored = torch.tensor([tokenizer.convert_tokens_to_ids(token) for token in (IMAGE_TOKEN, SPECIAL[0])])
    labels[torch.isin(labels, ignored)] = -100
    labels[batch["attention_mask"] == 0] = -100
    keys = ("input_ids", "attention_mask", "pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
    inputs = {key: batch[key] for key in keys}
    inputs["cross_attention_mask"] = batch["cross_attention_mask"]
    inputs["labels"] = labels
    return inputs
