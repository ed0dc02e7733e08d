"""Mixture-of-experts models: the expert-layout contracts, and LoRA on attention, experts and (when asked) router
through ``FastModel.get_peft_model``, in whichever layout the installed transformers loads (fused 3-D experts on
5.x, per-expert modules on 4.x)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error
from parity import assert_backbone_router_logits_match, assert_moe_step_matches, stock_like
from safetensors.torch import save_file

from fastft import FastModel
from fastft.contracts import ShapeContractError, check_moe_layout
from fastft.contracts.moe import moe_blocks

pytestmark = pytest.mark.lane

E, TOP_K, HIDDEN, INTERMEDIATE, VOCAB = 4, 2, 32, 48, 256


def _config(family: str, **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=128,
    )
    if family == "qwen3_moe":
        common.update(head_dim=8, intermediate_size=64, moe_intermediate_size=INTERMEDIATE, num_experts=E)
        common.update(overrides)
        return transformers.Qwen3MoeConfig(**common)
    common.update(intermediate_size=INTERMEDIATE, num_local_experts=E)
    common.update(overrides)
    return transformers.MixtralConfig(**common)


def _model(family: str, **overrides) -> torch.nn.Module:
    import transformers

    config = _config(family, **overrides)
    cls = transformers.Qwen3MoeForCausalLM if family == "qwen3_moe" else transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return cls(config).float()


FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory, word_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    _model(request.param).save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


def _layout() -> str:
    return next(moe_blocks(_model("mixtral"))).layout


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_contract_accepts_every_block(family):
    model = _model(family)
    blocks = list(moe_blocks(model))
    assert check_moe_layout(model) == len(blocks) == 2
    assert {block.layout for block in blocks} == {_layout()}


def _break_expert(model: torch.nn.Module) -> tuple[str, list[int]]:
    # Layer 1's first expert tensor transposed (fused) or its down projection sized for another config (per-expert).
    block = list(moe_blocks(model))[1]
    if block.layout == "fused":
        weight = block.experts.gate_up_proj
        block.experts.gate_up_proj = torch.nn.Parameter(weight.detach().transpose(1, 2).contiguous())
        return f"{block.name}.experts", [E, 2 * INTERMEDIATE, HIDDEN]
    expert = block.experts[0]
    name = "down_proj" if "down_proj" in expert._modules else "w2"
    setattr(expert, name, torch.nn.Linear(INTERMEDIATE + 8, HIDDEN, bias=False))
    return f"{block.name}.experts.0.{name}", [HIDDEN, INTERMEDIATE]


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_contract_refuses_a_wrong_expert_tensor(family):
    model = _model(family)
    where, expected = _break_expert(model)
    with pytest.raises(ShapeContractError) as caught:
        check_moe_layout(model)
    message = str(caught.value)
    assert where in message and str(expected) in message
    # get_peft_model refuses it before adding anything.
    with pytest.raises(ShapeContractError, match="expected"):
        FastModel.get_peft_model(model, r=4, lora_alpha=8)
    assert not any("lora_" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_contract_refuses_a_router_of_the_wrong_width(family):
    model = _model(family)
    block = next(moe_blocks(model))
    router = block.block.gate
    if isinstance(router, torch.nn.Linear):
        block.block.gate = torch.nn.Linear(HIDDEN, E + 1, bias=False)
    else:
        router.weight = torch.nn.Parameter(torch.zeros(E + 1, HIDDEN))
    with pytest.raises(ShapeContractError, match=rf"{block.name}\.gate: router weight has shape \[{E + 1}, {HIDDEN}\]"):
        check_moe_layout(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_contract_refuses_top_k_above_the_expert_count(family):
    model = _model(family)
    model.config.num_experts_per_tok = E + 1
    with pytest.raises(ShapeContractError, match=rf"num_experts_per_tok={E + 1} routes each token to more experts"):
        check_moe_layout(model)


def _lora_names(model: torch.nn.Module) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def test_defaults_adapt_attention_and_every_expert_not_the_router(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    names = _lora_names(model)
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert any(f"self_attn.{projection}.lora_A" in name for name in names)
    assert any(".experts." in name for name in names)
    assert not any(".gate.lora" in name or ".gate.base_layer" in name for name in names)
    if _layout() == "fused":
        # One ParamWrapper per 3-D tensor: E stacked A's of rank 4 on each.
        a = [p for n, p in model.named_parameters() if n.endswith("experts.lora_A.default.weight")]
        assert a and all(p.shape[0] == 4 * E for p in a)


def test_train_router_adds_a_lora_on_the_router(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, train_router=True)
    assert any(".gate.lora_A" in name for name in _lora_names(model))


def test_a_trained_router_matches_stock_peft(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, train_router=True, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    assert_moe_step_matches(model, stock_like(model, moe_dir), input_ids=ids, labels=ids)
    assert any(".gate." in n and p.grad is not None and p.grad.norm() > 0 for n, p in model.named_parameters())


def test_train_router_on_a_dense_model_is_refused(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    with pytest.raises(ValueError, match="train_router=True, but .*LlamaForCausalLM has no mixture-of-experts router"):
        FastModel.get_peft_model(model, r=4, train_router=True)


def _route_to_first_two(model: torch.nn.Module) -> None:
    # Every token goes to experts 0 and 1 (equal weights): experts 2 and 3 receive none.
    def hook(module, args, output):
        logits, weights, indices = output if len(output) == 3 else (output, None, None)
        if indices is None:  # a Linear router (per-expert layout): make its logits pick experts 0 and 1
            forced = torch.full_like(logits, -30.0)
            forced[:, :2] = 0.0
            return forced + logits * 0
        picked = torch.arange(TOP_K, device=indices.device).expand_as(indices).contiguous()
        return logits, torch.full_like(weights, 1.0 / TOP_K) + weights * 0, picked

    for block in moe_blocks(model):
        block.block.gate.register_forward_hook(hook)


def _expert_grads(model: torch.nn.Module) -> dict[int, float]:
    """The summed |grad| of each expert's LoRA A and B, whatever the layout stores them as."""
    totals = dict.fromkeys(range(E), 0.0)
    for name, parameter in model.named_parameters():
        if ".experts." not in name or "lora_" not in name or parameter.grad is None:
            continue
        grad = parameter.grad
        after = name.split(".experts.", 1)[1]
        if after.split(".", 1)[0].isdigit():  # per-expert modules
            totals[int(after.split(".", 1)[0])] += grad.abs().sum().item()
        elif "lora_A" in name:  # stacked rows: expert e owns rows e·r .. (e+1)·r
            for expert, rows in enumerate(grad.reshape(E, -1, grad.shape[-1])):
                totals[expert] += rows.abs().sum().item()
        else:  # columns j·E + e (peft's ParamWrapper layout)
            for expert in range(E):
                totals[expert] += grad.reshape(grad.shape[0], -1, E)[..., expert].abs().sum().item()
    return totals


def test_lora_gradients_reach_exactly_the_experts_that_got_tokens(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    _route_to_first_two(model)
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    totals = _expert_grads(model)
    assert totals[0] > 0 and totals[1] > 0
    assert totals[2] == 0.0 and totals[3] == 0.0


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload", "sqrt"]))
@pytest.mark.parametrize("router_logits", lane_cases([True, False]))
def test_loss_and_lora_gradients_match_stock_peft(moe_dir, kernel_path, checkpointing, router_logits):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=checkpointing)
    randomize_lora_b(model)
    stock = stock_like(model, moe_dir)
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    # With router logits on, the loss carries stock's auxiliary load-balancing term too.
    assert_moe_step_matches(model, stock, input_ids=ids, labels=ids, output_router_logits=router_logits)


@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_router_logits_from_the_backbone_keep_their_gradient_under_checkpointing(moe_dir, checkpointing):
    # trl >= 1.15 calls the backbone itself with output_router_logits and adds the load-balancing loss.
    assert_backbone_router_logits_match(moe_dir, checkpointing, VOCAB)


def test_attention_norms_and_loss_take_the_fused_path(moe_dir):
    from fastft.registry import patch_report

    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    family = model.config.model_type
    applied = {row["name"] for row in patch_report(model) if row["status"] == "applied"}
    assert {f"{family}.rms_norm", f"{family}.attention", f"{family}.causal_lm_loss"} <= applied


def test_experts_take_the_fused_grouped_path_in_either_layout(moe_dir, monkeypatch):
    from fastft.patches import moe_experts, moe_experts_4x
    from fastft.registry import patch_report

    # 5.x's 3-D experts and 4.x's per-expert modules each have their own runner.
    runner = moe_experts._Fused if _layout() == "fused" else moe_experts_4x._Fused
    calls = []
    original = runner.__call__
    monkeypatch.setattr(runner, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    ids = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    row = next(r for r in patch_report(model) if r["name"] == f"{model.config.model_type}.experts")
    assert row["status"] == "applied" and not row.get("fallbacks")
    assert len(calls) == 2  # one per sparse block


@pytest.mark.skipif(_layout() != "fused", reason="peft's LoRA on 3-D parameters exists for 5.x's layout only")
def test_lora_dropout_on_fused_experts_is_refused_before_any_change(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"lora_dropout=0.1 cannot apply to the experts' 3-D parameters"):
        FastModel.get_peft_model(model, r=4, lora_alpha=8, lora_dropout=0.1)
    assert not any("lora_" in name for name, _ in model.named_parameters())


def test_an_explicit_target_list_adapts_only_what_it_names(moe_dir):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    names = _lora_names(model)
    assert names and all(".q_proj." in name or ".v_proj." in name for name in names)


def test_saved_adapter_loads_in_plain_peft(moe_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    model.save_pretrained(tmp_path)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(moe_dir)), tmp_path)
    ids = torch.randint(4, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)


def test_an_adapter_for_the_other_layout_is_refused_by_name(moe_dir, tmp_path):
    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    block = next(moe_blocks(model))
    if block.layout == "fused":  # a 4.x adapter: one module per expert
        key = f"base_model.model.{block.name}.experts.0.gate_proj.lora_A.weight"
        tensor = torch.zeros(4, HIDDEN)
    else:  # a 5.x adapter: the experts module's stacked A
        key = f"base_model.model.{block.name}.experts.lora_A.weight"
        tensor = torch.zeros(4 * E, HIDDEN)
    save_file({key: tensor}, str(tmp_path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ShapeContractError, match=r"expert weights are for the .* layout \(e\.g\. '.*experts\."):
        FastModel.load_adapter(model, tmp_path)


def test_merge_plan_adds_every_experts_update_as_peft_merges_it(moe_dir):
    import copy

    from fastft.export.merge import merged_state_dict

    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    ours = merged_state_dict(model, torch.float32)
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    experts = [name for name in theirs if ".experts." in name]
    assert experts and set(experts) <= set(ours)
    for name in experts:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6), name
    # The update is really there: the merged experts differ from the base ones.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(moe_dir)).state_dict()
    assert any(not torch.equal(ours[name], base[name]) for name in experts)


def test_merged_save_reloads_in_plain_transformers_and_matches(moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, std=0.2)
    FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = torch.randint(4, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    model.eval()
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(moe_dir))(input_ids=ids).logits
    assert relative_error(theirs, ours) <= 1e-5
    assert relative_error(base, ours) > 1e-3  # the adapters, experts' included, changed the model


def test_load_in_4bit_with_fused_experts_is_refused_by_name(moe_dir):
    if _layout() == "per-expert":
        # transformers 4.x: each expert is a Linear, which bitsandbytes quantises like any other.
        model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, load_in_4bit=True)
        expert = next(moe_blocks(model)).experts[0]
        assert all(type(child).__name__ == "Linear4bit" for child in expert.children() if hasattr(child, "weight"))
        return
    with pytest.raises(ValueError, match=r"load_in_4bit=True .* stores the experts as 3-D parameters"):
        FastModel.from_pretrained(str(moe_dir), max_seq_length=64, load_in_4bit=True)


def test_sft_trainer_trains_attention_and_experts(moe_dir, word_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTTrainer

    from fastft.training.trl import sft_config

    model, _ = FastModel.from_pretrained(str(moe_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = [" ".join(["word"] * 12 + [str(i % 10)]) for i in range(8)]
    args = sft_config(str(tmp_path / "out"), torch.float32, 64, max_steps=2, per_device_train_batch_size=4)
    args.learning_rate = 1e-2
    trainer = SFTTrainer(
        model=model, processing_class=word_tokenizer, train_dataset=Dataset.from_dict({"text": rows}), args=args
    )
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    changed = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])}
    assert any(".experts." in n for n in changed) and any(".self_attn." in n for n in changed)
