"""``fastft.apply`` on a model built by transformers and peft, not by FastModel: LoRA added before or after, loss and
every LoRA gradient equal to the un-applied model on both kernel paths and with and without checkpointing; the
report says the layers are fused; a second call changes nothing; the adapter, its dtypes and the parameters an
optimizer holds stay the same objects and values; a non-LoRA adapter is refused untouched; an unsupported family
falls back to stock with the report saying so."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, randomize_lora_b
from parity import assert_lora_step_matches, make_batch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import fastft
from fastft.checkpointing import modes
from fastft.registry import patch_report

pytestmark = pytest.mark.lane

LAYERS = 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ("rms_norm", "attention", "mlp", "causal_lm_loss")


def _lora(model):
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def _stock(folder, lora_source):
    """transformers + peft with ``lora_source``'s LoRA values: the un-applied model."""
    stock = _lora(AutoModelForCausalLM.from_pretrained(str(folder)))
    stock.load_state_dict({k: v for k, v in lora_source.state_dict().items() if "lora_" in k}, strict=False)
    stock.train()
    return stock


def _inputs(model) -> dict[str, torch.Tensor]:
    batch = make_batch(model.config.vocab_size, batch=2, seq=12, pad=3)
    return {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}


def _assert_fused(model, calls: list[str]) -> None:
    rows = {row["name"]: row for row in patch_report(model)}
    for part in FUSED:
        assert rows[f"llama.{part}"]["status"] == "applied" and not rows[f"llama.{part}"]["fallbacks"], rows
    layers = calls.count("LoRADecoderLayer") + calls.count("LoRAQKVRoPEFunction")
    assert layers >= LAYERS, calls
    assert model.get_base_model().fastft_fused_loss_calls >= 1


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload"]))
def test_lora_then_apply_matches_the_unapplied_model(tiny_llama_dir, kernel_path, fused_calls, checkpointing):
    model = _lora(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)))
    randomize_lora_b(model)
    stock = _stock(tiny_llama_dir, model)
    if checkpointing:
        base = stock.get_base_model()
        getattr(base, modes._enable_method_name(base))({"use_reentrant": False})
    assert fastft.apply(model, use_gradient_checkpointing=checkpointing) is model
    model.train()
    assert modes.get_mode(model.get_base_model()) == modes.resolve_mode(checkpointing)
    assert_lora_step_matches(model, stock, "lora_A", **_inputs(model))
    _assert_fused(model, fused_calls)


@pytest.mark.parametrize("checkpointing", [False, "offload"])
def test_apply_then_lora_matches_the_unapplied_model(tiny_llama_dir, kernel_path, fused_calls, checkpointing):
    bare = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    fastft.apply(bare, use_gradient_checkpointing=checkpointing)
    model = _lora(bare)
    randomize_lora_b(model)
    # The adapters came after: apply again (what a trainer callback does) only checks them.
    fastft.apply(model)
    model.train()
    assert_lora_step_matches(model, _stock(tiny_llama_dir, model), "lora_A", **_inputs(model))
    _assert_fused(model, fused_calls)


def test_lora_on_a_4bit_model_loaded_by_transformers_matches_the_unapplied_model(tiny_llama_dir, kernel_path):
    from fastft.loading.dtypes import _DTYPE_KWARG, guard_bnb_cpu_repack, quantization_config

    def qlora():
        # transformers 4.x would load the unquantised parts in fp16 for bitsandbytes unless told otherwise.
        quantized = AutoModelForCausalLM.from_pretrained(
            str(tiny_llama_dir), quantization_config=quantization_config(torch.float32), **{_DTYPE_KWARG: torch.float32}
        )
        return _lora(quantized)

    model = qlora()
    randomize_lora_b(model)
    stock = qlora()
    # Without this bitsandbytes computes in bf16 on an AVX-512 CPU whatever the model's dtype: the stock side
    # would be the inexact one (fastft.loading.dtypes).
    guard_bnb_cpu_repack(stock, torch.float32)
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    fastft.apply(model)
    assert type(model.get_base_model().model.layers[0].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    model.train()
    stock.train()
    assert_lora_step_matches(model, stock, "lora_A", **_inputs(model))
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["llama.mlp"]["status"] == "applied" and not rows["llama.mlp"]["fallbacks"], rows["llama.mlp"]


def test_second_apply_is_a_no_op(tiny_llama_dir):
    model = _lora(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)))
    fastft.apply(model, use_gradient_checkpointing="offload")
    base = model.get_base_model()
    report = base._fastft_patch_report
    classes = [type(m) for m in model.modules()]
    layer_checkpoints = [layer._gradient_checkpointing_func for layer in base.model.layers]
    assert fastft.apply(model) is model
    assert base._fastft_patch_report is report
    assert [type(m) for m in model.modules()] == classes
    assert [layer._gradient_checkpointing_func for layer in base.model.layers] == layer_checkpoints
    assert modes.get_mode(base) == "offload"


def test_the_adapter_and_its_parameters_are_kept_exactly(tiny_llama_dir):
    model = _lora(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)))
    randomize_lora_b(model)
    # A caller's choice of dtype for the adapters stays theirs (apply casts nothing).
    for name, parameter in model.named_parameters():
        if "lora_A" in name:
            parameter.data = parameter.data.to(torch.bfloat16)
    before = {name: (p, p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}
    config = model.peft_config["default"].to_dict()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    fastft.apply(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (parameter, value, trains) in before.items():
        assert after[name] is parameter, name
        assert (
            after[name].dtype == value.dtype and torch.equal(after[name], value) and after[name].requires_grad == trains
        )
    assert model.peft_config["default"].to_dict() == config
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }


def test_a_non_lora_adapter_is_refused_and_the_model_left_alone(tiny_llama_dir):
    from peft import IA3Config

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"adapter 'default' .* IA3 adapter.*LoRA"):
        fastft.apply(model)
    assert [type(m) for m in model.modules()] == classes
    with pytest.raises(ValueError, match="has no patch record"):
        patch_report(model)


def test_not_a_transformers_model_or_a_bad_argument_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"fastft.apply: expected a transformers PreTrainedModel.*Linear"):
        fastft.apply(torch.nn.Linear(4, 4))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    with pytest.raises(ValueError, match=r"fastft.apply: .*use_gradient_checkpointing='sometimes' is not a mode"):
        fastft.apply(model, use_gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match=r"fastft.apply: max_seq_length must be a positive int.*0"):
        fastft.apply(model, max_seq_length=0)
    assert not any(type(m).__module__.startswith("fastft.") for m in model.modules())


def test_an_unsupported_family_runs_stock_and_the_report_says_so():
    from transformers import GPT2Config, GPT2LMHeadModel

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = GPT2Config(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0, **no_dropout
    )
    torch.manual_seed(0)

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))

    model = lora(GPT2LMHeadModel(config))
    randomize_lora_b(model)
    stock = lora(GPT2LMHeadModel(config))
    stock.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="no fused patches for model_type 'gpt2'"):
        fastft.apply(model)
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["architecture"]["status"] == "not applicable"
    assert not any(type(m).__module__.startswith("fastft.") for m in model.get_base_model().transformer.h.modules())
    model.train()
    stock.train()
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    assert_lora_step_matches(model, stock, "lora_A", input_ids=ids, labels=ids)


def test_max_seq_length_is_enforced_when_given(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    fastft.apply(model, max_seq_length=8)
    with pytest.raises(fastft.ShapeContractError, match="8"):
        model(input_ids=torch.ones(1, 9, dtype=torch.long))


def test_a_trainer_request_for_checkpointing_runs_fastfts_checkpointer(tiny_llama_dir):
    from fastft.checkpointing.layer import LayerCheckpoint

    model = _lora(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)))
    fastft.apply(model)
    base = model.get_base_model()
    assert not modes.is_enabled(base)
    # What transformers' Trainer does at train() when its arguments ask for checkpointing.
    enable = getattr(model, modes._enable_method_name(base))
    enable({"use_reentrant": True})
    assert modes.get_mode(base) == "recompute"
    assert all(isinstance(layer._gradient_checkpointing_func, LayerCheckpoint) for layer in base.model.layers)
