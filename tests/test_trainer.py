"""FastModel models inside trl's SFTTrainer: plain text, chat data, and gradient accumulation."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import relative_error
from datasets import Dataset
from trl import SFTTrainer

from fastft import FastModel
from fastft.demo import demo_path
from fastft.training.data import to_sft_rows
from fastft.training.trl import loss_history, sft_config

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns a short sentence quickly.",
    "Seven blue birds sat on the old wooden fence.",
    "Fine-tuning with LoRA trains only the low-rank adapters.",
]


def _demo_rows(count: int) -> list[dict]:
    lines = demo_path().read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def _train(folder, dataset, tmp_path, steps, load_in_4bit=False, **config):
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, random_state=5)
    args = sft_config(str(tmp_path / "out"), torch.float32, 128, max_steps=steps, save_strategy="no", seed=5, **config)
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args)
    trainer.train()
    return model, [row["loss"] for row in loss_history(trainer.state)]


def _assert_falls(losses: list[float]) -> None:
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"loss did not fall by 20%: {losses}"


def test_sft_on_plain_text_loss_falls(tiny_llama_dir, tmp_path):
    dataset = Dataset.from_dict({"text": SENTENCES * 4})
    _, losses = _train(tiny_llama_dir, dataset, tmp_path, steps=12, learning_rate=3e-2, per_device_train_batch_size=4)
    assert len(losses) == 12
    _assert_falls(losses)


def test_sft_qlora_on_4bit_base_loss_falls(tiny_llama_dir, tmp_path):
    dataset = Dataset.from_dict({"text": SENTENCES * 4})
    model, losses = _train(
        tiny_llama_dir,
        dataset,
        tmp_path,
        steps=12,
        load_in_4bit=True,
        learning_rate=3e-2,
        per_device_train_batch_size=4,
    )
    assert type(model.get_base_model().model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    _assert_falls(losses)


def test_sft_on_chat_messages_loss_falls(tiny_llama_dir, smol_tokenizer, tmp_path):
    rows = _demo_rows(8)
    messages = [
        [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["response"]}]
        for row in rows
    ]
    dataset = Dataset.from_dict({"messages": messages * 2})
    # The rows really go through SmolLM2's chat template.
    rendered = smol_tokenizer.apply_chat_template(messages[0], tokenize=False)
    assert "<|im_start|>assistant" in rendered
    _, losses = _train(tiny_llama_dir, dataset, tmp_path, steps=12, learning_rate=3e-2, per_device_train_batch_size=4)
    _assert_falls(losses)


def test_instruction_rows_become_prompt_completion(smol_tokenizer):
    dataset = Dataset.from_list(_demo_rows(3))
    shaped = to_sft_rows(dataset, smol_tokenizer)
    assert set(shaped.column_names) == {"prompt", "completion"}
    assert shaped[0]["completion"][0]["role"] == "assistant"
    with pytest.raises(ValueError, match="expected 'messages'"):
        to_sft_rows(Dataset.from_dict({"question": ["x"]}), smol_tokenizer)


def test_gradient_accumulation_matches_one_big_batch(tiny_llama_dir, tmp_path):
    # Examples of different lengths, so a wrong per-micro-batch mean would show.
    dataset = Dataset.from_dict({"text": [s * (1 + i % 3) for i, s in enumerate(SENTENCES * 2)]})
    common = dict(learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", warmup_steps=0)
    big, big_losses = _train(
        tiny_llama_dir,
        dataset,
        tmp_path / "big",
        2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        **common,
    )
    small, small_losses = _train(
        tiny_llama_dir,
        dataset,
        tmp_path / "acc",
        2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        **common,
    )
    assert len(big_losses) == len(small_losses) == 2
    for a, b in zip(big_losses, small_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (big_losses, small_losses)
    big_weights = {n: p for n, p in big.named_parameters() if p.requires_grad}
    for name, weight in small.named_parameters():
        if weight.requires_grad:
            assert relative_error(weight, big_weights[name]) < 1e-5, name
