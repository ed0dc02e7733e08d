"""The Axolotl plugin against Axolotl's own ``PluginManager`` and ``BasePlugin`` (axolotl 0.19.0, the newest release):
loaded by its dotted name as ``plugins:`` names it, its fields merged into Axolotl's config schema and validated
there, and its hooks driven in the order Axolotl's model loader calls them on a tiny Llama. After them the model runs
fused, its checkpointing request lands on fastft's checkpointer, its loss and LoRA gradients equal transformers +
peft's, and a Trainer built as Axolotl builds one trains it.

Axolotl pins exact transformers / peft / trl versions that no lane has (0.19.0: transformers 5.16.1, peft 0.20.0,
trl 1.9.0), so it is not a test dependency: the ``axolotl`` lane (``.ci/lanes/axolotl.txt``) installs it without its
dependencies and runs this file (``python .ci/lanes.py --lane axolotl``). Elsewhere it is skipped, by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import randomize_lora_b
from parity import assert_lora_step_matches, make_batch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from fastft.checkpointing import modes
from fastft.checkpointing.layer import LayerCheckpoint
from fastft.registry import patch_report

pytestmark = pytest.mark.axolotl
base_module = pytest.importorskip(
    "axolotl.integrations.base", reason="axolotl is not installed (see this file's docstring for how)"
)
from axolotl.utils.dict import DictDefault  # noqa: E402

PLUGIN = "fastft.integrations.axolotl.FastftPlugin"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def manager(monkeypatch):
    """A fresh Axolotl PluginManager (a process-wide singleton) with the fastft plugin registered."""
    monkeypatch.setattr(base_module.PluginManager, "_instance", None)
    manager = base_module.PluginManager.get_instance()
    manager.register(PLUGIN)
    return manager


def _config(**settings) -> dict:
    return {
        "base_model": "tiny",
        "datasets": [{"path": "rows.jsonl", "type": "alpaca"}],
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3,
        "sequence_len": 64,
        "adapter": "lora",
        "gradient_checkpointing": True,
        "plugins": [PLUGIN],
        **settings,
    }


def _load(manager, cfg, folder):
    """What Axolotl's ModelLoader.load does around the plugin hooks, on a tiny Llama with LoRA."""
    manager.pre_model_load(cfg)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    manager.post_model_build(cfg, model)
    if cfg.gradient_checkpointing:
        # Axolotl's loader turns checkpointing on here, before the adapter, by this (in transformers 5.23 and later
        # deprecated) name (axolotl/loaders/model.py).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`gradient_checkpointing_enable` is deprecated", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs)
    manager.pre_lora_load(cfg, model)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    manager.post_lora_load(cfg, model)
    manager.post_model_load(cfg, model)
    return model


def test_the_plugin_loads_by_name_and_its_fields_join_axolotls_schema(manager):
    from axolotl.integrations.config import merge_input_args
    from pydantic import ValidationError

    from fastft.integrations.axolotl import FastftPlugin

    assert isinstance(manager.plugins[PLUGIN], FastftPlugin)
    assert isinstance(manager.plugins[PLUGIN], base_module.BasePlugin)
    _, schema = merge_input_args()
    config = schema(**_config(fastft_gradient_checkpointing="offload"))
    assert config.fastft_gradient_checkpointing == "offload" and config.fastft_apply is True
    with pytest.raises(ValidationError, match="fastft_gradient_checkpointing"):
        schema(**_config(fastft_gradient_checkpointing="sometimes"))
    with pytest.raises(ValidationError, match=r"fastft plugin: adapter: 'llama-adapter' is not served .*fastft_apply"):
        schema(**_config(adapter="llama-adapter"))
    assert schema(**_config(adapter="llama-adapter", fastft_apply=False)).fastft_apply is False


def test_the_hooks_put_the_model_on_the_fused_path_with_stock_parity(manager, tiny_llama_dir):
    cfg = DictDefault(_config())
    model = _load(manager, cfg, tiny_llama_dir)
    base = model.get_base_model()
    assert type(base).__name__ == "FastLlamaForCausalLM"
    rows = {row["name"]: row for row in patch_report(model)}
    for part in ("rms_norm", "attention", "mlp", "causal_lm_loss"):
        assert rows[f"llama.{part}"]["status"] == "applied" and not rows[f"llama.{part}"]["fallbacks"], rows
    # Axolotl's checkpointing request, made after post_model_build, runs fastft's checkpointer.
    assert modes.get_mode(base) == "recompute"
    assert all(isinstance(layer._gradient_checkpointing_func, LayerCheckpoint) for layer in base.model.layers)

    randomize_lora_b(model)
    stock = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
        LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
    )
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    model.train()
    stock.train()
    batch = make_batch(model.config.vocab_size, batch=2, seq=12, pad=3)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
    assert_lora_step_matches(model, stock, "lora_A", **inputs)
    assert base.fastft_fused_loss_calls == 1


def test_a_mode_in_the_config_is_kept_over_axolotls_request(manager, tiny_llama_dir):
    model = _load(manager, DictDefault(_config(fastft_gradient_checkpointing="sqrt")), tiny_llama_dir)
    assert modes.get_mode(model.get_base_model()) == "sqrt"


def test_fastft_apply_false_leaves_the_model_stock(manager, tiny_llama_dir):
    model = _load(manager, DictDefault(_config(fastft_apply=False)), tiny_llama_dir)
    assert not any(type(m).__module__.startswith("fastft.") for m in model.modules())


def test_a_trainer_built_after_the_hooks_trains_fused(manager, tiny_llama_dir, smol_tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    cfg = DictDefault(_config())
    model = _load(manager, cfg, tiny_llama_dir)
    text = "Fine-tuning with LoRA trains only the low-rank adapters."
    ids = (smol_tokenizer(text)["input_ids"] + [smol_tokenizer.eos_token_id] * 16)[:16]
    rows = Dataset.from_dict({"input_ids": [ids] * 8, "attention_mask": [[1] * 16] * 8, "labels": [ids] * 8})
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    callbacks = manager.add_callbacks_pre_trainer(cfg, model)
    trainer = Trainer(model=model, args=arguments, train_dataset=rows, callbacks=callbacks)
    manager.post_trainer_create(cfg, trainer)
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.85 * losses[0], losses
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }
    assert model.get_base_model().fastft_fused_loss_calls >= 6
