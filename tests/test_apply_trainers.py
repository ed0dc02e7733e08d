"""fastft inside trainers it did not build: transformers' ``Trainer`` with :class:`FastftCallback` or a
``fastft.apply(trainer.model)`` before ``train()``, and trl's ``SFTTrainer`` with the callback and its own
``peft_config``. A few steps each: the loss falls, the layers ran fused, the optimizer holds exactly the trainable
parameters of the model it trained, and a trainer's ``gradient_checkpointing=True`` runs fastft's checkpointer."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import trl_logprobs_status
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import fastft
from fastft.checkpointing import modes
from fastft.checkpointing.layer import LayerCheckpoint
from fastft.integrations import FastftCallback
from fastft.registry import patch_report

pytestmark = pytest.mark.lane

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 8
LAYERS = 2
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns a short sentence quickly.",
    "Seven blue birds sat on the old wooden fence.",
    "Fine-tuning with LoRA trains only the low-rank adapters.",
]


def _checkpointing_field(config_class: type) -> str:
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing.
    names = {field.name for field in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def _common(tmp_path, config_class: type) -> dict:
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 2e-2,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": 5,
        _checkpointing_field(config_class): True,
    }


def _token_rows(tokenizer) -> Dataset:
    # Padded by hand: SmolLM2's tokenizer has no pad token under transformers 4.x.
    ids = [(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] * 16)[:16] for text in SENTENCES]
    rows = ids * 4
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 16] * len(rows), "labels": rows})


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _assert_trained_fused(trainer, calls: list[str]) -> None:
    losses = _losses(trainer)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) / 2 < 0.85 * sum(losses[:2]) / 2, losses
    model = trainer.model
    rows = {row["name"]: row for row in patch_report(model)}
    for part in ("rms_norm", "attention", "mlp"):
        assert rows[f"llama.{part}"]["status"] == "applied" and not rows[f"llama.{part}"]["fallbacks"], rows
    # Every step ran each layer fused (forward, and the recompute in backward).
    assert calls.count("LoRADecoderLayer") + calls.count("LoRAQKVRoPEFunction") >= LAYERS * STEPS, calls[:8]
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained and {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == trained
    base = model.get_base_model()
    assert modes.get_mode(base) == "recompute"
    assert all(isinstance(layer._gradient_checkpointing_func, LayerCheckpoint) for layer in base.model.layers)


def _peft_model(folder):
    return get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(folder)), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    )


def test_trainer_with_the_callback_trains_fused(tiny_llama_dir, smol_tokenizer, tmp_path, fused_calls):
    model = _peft_model(tiny_llama_dir)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**_common(tmp_path, TrainingArguments)),
        train_dataset=_token_rows(smol_tokenizer),
        callbacks=[FastftCallback()],
    )
    # The callback applied at the end of __init__, before train() builds the optimizer.
    assert trainer.optimizer is None and type(model.get_base_model()).__name__ == "FastLlamaForCausalLM"
    trainer.train()
    _assert_trained_fused(trainer, fused_calls)


def test_trainer_with_apply_before_train_trains_fused(tiny_llama_dir, smol_tokenizer, tmp_path, fused_calls):
    trainer = Trainer(
        model=_peft_model(tiny_llama_dir),
        args=TrainingArguments(**_common(tmp_path, TrainingArguments)),
        train_dataset=_token_rows(smol_tokenizer),
    )
    fastft.apply(trainer.model)
    trainer.train()
    _assert_trained_fused(trainer, fused_calls)


def test_an_optimizer_built_before_apply_trains_the_same_parameters(tiny_llama_dir, smol_tokenizer, tmp_path):
    trainer = Trainer(
        model=_peft_model(tiny_llama_dir),
        args=TrainingArguments(**_common(tmp_path, TrainingArguments)),
        train_dataset=_token_rows(smol_tokenizer),
    )
    trainer.create_optimizer()
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    fastft.apply(trainer.model)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert {id(p) for p in held} == {id(p) for p in trained}


@pytest.fixture(autouse=True)
def _environment_restored():
    """TrainingArguments exports its precision as ACCELERATE_MIXED_PRECISION (trl 0.19's SFTConfig defaults to bf16),
    which every later Trainer in the process would pick up: each test here leaves os.environ as it found it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _sft_trainer(folder, tokenizer, tmp_path, callbacks):
    from trl import SFTConfig, SFTTrainer

    settings = _common(tmp_path, SFTConfig)
    names = {field.name for field in dataclasses.fields(SFTConfig)}
    settings["max_length" if "max_length" in names else "max_seq_length"] = 32
    return SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(folder)),
        args=SFTConfig(**settings),
        train_dataset=Dataset.from_dict({"text": SENTENCES * 4}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        callbacks=callbacks,
    )


def _assert_sft_head(trainer) -> None:
    base = trainer.model.get_base_model()
    if trl_logprobs_status() == "applied":
        # trl's fused LM head (assigned on the model when the trainer was built) ran through fastft's kernel.
        assert base.fastft_fused_logprob_calls >= STEPS
    else:
        assert base.fastft_fused_loss_calls >= STEPS


def test_sft_trainer_with_its_peft_config_and_the_callback_trains_fused(
    tiny_llama_dir, smol_tokenizer, tmp_path, fused_calls
):
    trainer = _sft_trainer(tiny_llama_dir, smol_tokenizer, tmp_path, [FastftCallback()])
    trainer.train()
    _assert_trained_fused(trainer, fused_calls)
    _assert_sft_head(trainer)


def test_sft_trainer_with_apply_after_it_was_built_trains_fused(tiny_llama_dir, smol_tokenizer, tmp_path, fused_calls):
    trainer = _sft_trainer(tiny_llama_dir, smol_tokenizer, tmp_path, None)
    # trl has already put its LM head on the stock model; apply hands it to fastft's class.
    fastft.apply(trainer.model)
    trainer.train()
    _assert_trained_fused(trainer, fused_calls)
    _assert_sft_head(trainer)
