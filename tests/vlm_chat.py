"""A tiny random Qwen2.5-VL saved with a chat template that renders image parts as Qwen's does, for the collator,
``fastft train`` and notebook tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from vlm_tiny import SPECIAL, tiny_config, tiny_image_processor, tiny_tokenizer

# Qwen2-VL's template, cut to what the tests use: a string or a list of text / image parts per turn, a system turn,
# the generation prompt.
VISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer():
    """The tiny Qwen tokenizer with ChatML's markers as single tokens, as in Qwen's own tokenizer."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    tokenizer.chat_template = VISION_TEMPLATE
    return tokenizer


def save_chat_vlm(folder: Path) -> Path:
    """Save a tiny random Qwen2.5-VL (seed 0), its chat tokenizer and its image processor into ``folder``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer)).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tiny_image_processor().save_pretrained(folder)
    return folder


def chat_processor(folder: Path):
    """The processor ``FastModel.from_pretrained`` returns for ``folder`` (without torchvision: the image-only one)."""
    import warnings

    from transformers import AutoTokenizer

    from fastft.loading.vision import load_processor

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastft.from_pretrained.*processor could not be built")
        return load_processor(str(folder), AutoTokenizer.from_pretrained(folder), 256)
