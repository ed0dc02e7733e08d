"""FastModel on the stock path: loading, LoRA wiring, mode switches, merged export, adapter round trip."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import lora_model, relative_error
from peft import PeftModel

from fastft import FastModel, patch_report
from fastft.checkpointing.modes import is_enabled
from fastft.model import DEFAULT_TARGET_MODULES, resolve_dtype


def _input_ids(vocab: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))


def test_resolve_dtype_on_cpu():
    expected = (torch.bfloat16, torch.float16) if torch.cuda.is_available() else (torch.float32,)
    assert resolve_dtype(None) in expected
    assert resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="not one of"):
        resolve_dtype("float8")


def test_from_pretrained_local_dir(tiny_llama_dir):
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=96)
    assert model.dtype == torch.float32
    assert tokenizer.model_max_length == 96 and tokenizer.pad_token is not None
    assert model.max_seq_length == 96
    # Every registered patch has a recorded outcome (test_registry.py checks which one and why).
    report = patch_report(model)
    assert report and all(row["status"] in ("applied", "skipped", "not applicable") for row in report)
    logits = model(_input_ids(model.config.vocab_size)).logits
    assert logits.shape == (2, 17, model.config.vocab_size) and torch.isfinite(logits).all()


def test_from_pretrained_4bit_is_nf4_double_quant(tiny_llama_dir):
    import bitsandbytes as bnb

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), load_in_4bit=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bnb.nn.Linear4bit)
    assert q_proj.weight.quant_state.quant_type == "nf4"
    assert q_proj.weight.quant_state.nested, "double quantisation must be on"
    assert q_proj.compute_dtype == torch.float32
    assert torch.isfinite(model(_input_ids(model.config.vocab_size)).logits).all()


def test_bad_arguments_are_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_seq_length"):
        FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=0)
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="use_gradient_checkpointing"):
        FastModel.get_peft_model(model, use_gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="not linear layers.*q_proj"):
        FastModel.get_peft_model(model, target_modules=["qkv_proj"])
    with pytest.raises(ValueError, match="r must be"):
        FastModel.get_peft_model(model, r=0)


def test_get_peft_model_wires_seven_projections(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    peft_model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    assert isinstance(peft_model, PeftModel)
    assert set(peft_model.peft_config["default"].target_modules) == set(DEFAULT_TARGET_MODULES)
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 2 * 7 * 2
    assert is_enabled(peft_model.get_base_model())
    assert peft_model.config.use_cache is False
    with pytest.raises(ValueError, match="already has LoRA"):
        FastModel.get_peft_model(peft_model)


def test_random_state_is_deterministic_and_leaves_global_rng(tiny_llama_dir):
    weights = []
    for _ in range(2):
        model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
        torch.manual_seed(123)
        expected_next = torch.rand(1)
        torch.manual_seed(123)
        peft_model = FastModel.get_peft_model(model, r=4, random_state=11)
        assert torch.equal(torch.rand(1), expected_next), "get_peft_model must not consume the caller's RNG"
        weights.append(peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.clone())
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("mode", [False, True, "offload", "unsloth"])
def test_checkpointing_modes_and_switches(tiny_llama_dir, mode):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode)
    base = peft_model.get_base_model()
    assert is_enabled(base) is bool(mode)
    # A Trainer asks for checkpointing at start-up; the mode chosen in get_peft_model stays. The deprecated
    # name reaches the same entry point on every transformers version.
    base.gradient_checkpointing_enable()
    assert is_enabled(base) is bool(mode)
    FastModel.for_inference(peft_model)
    assert not peft_model.training and base.config.use_cache and not is_enabled(base)
    FastModel.for_training(peft_model)
    assert peft_model.training and not base.config.use_cache
    assert is_enabled(base) is bool(mode)


def test_checkpointing_keeps_gradients(tiny_llama_dir):
    ids = _input_ids(49152)
    grads = []
    for mode in (False, "offload"):
        model, _ = lora_model(tiny_llama_dir, use_gradient_checkpointing=mode)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[0].items():
        assert relative_error(grads[1][name], grad) < 1e-6, name


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["fp32", "nf4"])
def test_save_merged_matches_adapter_model(tiny_llama_dir, tmp_path, load_in_4bit):
    from transformers import AutoModelForCausalLM

    model, tokenizer = lora_model(tiny_llama_dir, load_in_4bit=load_in_4bit)
    ids = _input_ids(model.config.vocab_size)
    FastModel.for_inference(model)
    with torch.no_grad():
        expected = model(ids).logits
    FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=torch.float32)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert (tmp_path / "merged" / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        actual = merged(ids).logits
    assert relative_error(actual, expected) < 1e-5
    # The model in memory keeps its adapters: nothing was merged into it.
    assert any("lora_A" in name for name, _ in model.named_parameters())


@pytest.mark.lane
def test_a_patched_model_saves_under_its_upstream_class_name(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    patched = type(model)
    assert patched.__name__ == "FastLlamaForCausalLM"
    model.save_pretrained(tmp_path / "full")
    assert json.loads((tmp_path / "full" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert type(model) is patched, "the model keeps fastft's class after saving"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0)


def test_save_merged_fp16_dtype(tiny_llama_dir, tmp_path):
    from safetensors import safe_open

    model, tokenizer = lora_model(tiny_llama_dir)
    FastModel.save_merged(model, tokenizer, tmp_path / "half")
    with safe_open(str(tmp_path / "half" / "model.safetensors"), "pt") as handle:
        dtypes = {handle.get_tensor(key).dtype for key in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
    assert dtypes == {torch.float16}


def test_adapter_reloads_in_plain_peft_without_fastft(tiny_llama_dir, tmp_path):
    model, _ = lora_model(tiny_llama_dir)
    ids = _input_ids(model.config.vocab_size)
    FastModel.for_inference(model)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained({str(tiny_llama_dir)!r})
        model = PeftModel.from_pretrained(base, {str(tmp_path / "adapter")!r}).eval()
        with torch.no_grad():
            logits = model(torch.load({str(tmp_path / "ids.pt")!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        assert not any(name == "fastft" or name.startswith("fastft.") for name in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    actual = torch.load(tmp_path / "logits.pt")
    assert relative_error(actual, expected) < 1e-6


def test_peft_state_dict_keys_are_peft_own(tiny_llama_dir):
    from peft import get_peft_model_state_dict

    model, _ = lora_model(tiny_llama_dir)
    keys = list(get_peft_model_state_dict(model))
    assert keys and all(key.startswith("base_model.model.model.layers.") for key in keys)
    assert all(key.endswith(("lora_A.weight", "lora_B.weight")) for key in keys)


def test_dense_weight_of_nf4_with_in_features_off_the_blocksize():
    """bnb 0.50's AVX-512 CPU dequantiser mis-scales [32, 96] at blocksize 64 (error ~0.29); merging must not."""
    import bitsandbytes as bnb

    from fastft import ShapeContractError
    from fastft.export.merge import dense_weight

    weight = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    packed = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64)
    packed = packed.to("cpu")
    dense = dense_weight("layers.0.mlp.down_proj.weight", packed)
    assert dense.shape == (32, 96) and dense.dtype == torch.float32
    assert relative_error(dense, weight) < 0.12  # NF4's own rounding is ~0.09

    packed.quant_state = None  # what rebuilding the parameter (DataParallel replication) leaves
    with pytest.raises(ShapeContractError, match=r"layers\.0\.mlp\.down_proj\.weight: .*no quant_state"):
        dense_weight("layers.0.mlp.down_proj.weight", packed)


@pytest.mark.parametrize("load_in_4bit", [False, True], ids=["fp32", "nf4"])
def test_a_reward_model_loads_as_a_fused_sequence_classifier(tiny_llama_dir, load_in_4bit):
    model, _ = FastModel.from_pretrained(
        str(tiny_llama_dir), max_seq_length=64, task="sequence-classification", load_in_4bit=load_in_4bit
    )
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    # The decoder layers run fastft's kernels; the new head is a plain (never quantised) Linear.
    assert type(model.model.layers[0].self_attn).__name__ == "FastLlamaAttention"
    assert type(model.score) is torch.nn.Linear
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["trl.fused_logprobs"]["status"] == "not applicable"
    peft_model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    assert peft_model.peft_config["default"].task_type == "SEQ_CLS"
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    scores = peft_model(input_ids=ids).logits
    assert scores.shape == (2, 1)
    scores.sum().backward()
    assert any("score" in name and p.grad is not None for name, p in peft_model.named_parameters())


def test_task_arguments_that_do_not_fit_are_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="task must be one of"):
        FastModel.from_pretrained(str(tiny_llama_dir), task="token-classification")
    # num_labels on a causal LM would land silently in its config: refused, naming the way to a reward model.
    with pytest.raises(ValueError, match="task='sequence-classification'"):
        FastModel.from_pretrained(str(tiny_llama_dir), num_labels=1)
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    with pytest.raises(ValueError, match="task_type='SEQ_CLS' does not fit .*CausalLM.*sequence-classification"):
        FastModel.get_peft_model(model, task_type="SEQ_CLS")


def test_a_trainer_reenabling_checkpointing_every_step_is_told_once(tiny_llama_dir, caplog):
    import logging

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    base = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload").get_base_model()
    with caplog.at_level(logging.INFO, logger="fastft.checkpoint"):
        # What trl's DPO / KTO / GRPO do around each reference forward.
        for _ in range(3):
            base.gradient_checkpointing_enable()
    assert sum("keeps gradient checkpointing mode 'offload'" in r.message for r in caplog.records) == 1
    assert is_enabled(base)
