"""fastft bench on a mixture-of-experts model: the Qwen3-MoE shapes, LoRA on every expert seeded alike in every
system, the routed FLOP count, issue 32's targets, and a quick CPU run against transformers + peft end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fastft.bench import report, worker
from fastft.bench.measure import EXPERT_PARAMETERS, lora_step_flops
from fastft.bench.workloads import MODEL_SHAPES, is_moe, lora_targets, select_workloads

MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", *EXPERT_PARAMETERS)


def _tiny_moe(target_parameters):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {key: value for key, value in MODEL_SHAPES["tiny-moe"].items() if key != "model_type"}
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=target_parameters)
    return get_peft_model(model, config)


def test_gpu_workloads_add_the_qwen3_moe_shape_in_bf16_only_and_quick_keeps_its_default():
    cuda = {workload.name: workload for workload in select_workloads("cuda", False, None)}
    moe = [workload for workload in cuda.values() if is_moe(workload.model)]
    assert sorted(workload.name for workload in moe) == [
        "qwen3-30b-a3b-8l-bf16-1x8192",
        "qwen3-30b-a3b-8l-bf16-4x2048",
    ]
    assert all(workload.quant == "none" and workload.tokens == 8192 for workload in moe)
    assert "llama-3-8b-nf4-4x2048" in cuda and not is_moe("llama-3-8b") and not is_moe("smollm2-135m")
    assert [workload.name for workload in select_workloads("cpu", True, None)] == ["tiny-fp32-2x32"]
    assert select_workloads("cpu", True, ["tiny-moe-fp32-2x32"])[0].model == "tiny-moe"
    assert lora_targets("qwen3-30b-a3b-8l") == {
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
    }
    assert lora_targets("tiny")["target_parameters"] == []


def test_the_qwen3_shape_is_30b_a3bs_layer_and_fits_one_gpu_in_bf16():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = MODEL_SHAPES["qwen3-30b-a3b-8l"]
    fields = {key: value for key, value in shape.items() if key != "model_type"}
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (128, 2 * 768, 2048)
    assert tuple(experts.down_proj.shape) == (128, 2048, 768)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32 * 128, 2048)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    # Embeddings and untied head 2 x 151936 x 2048; each layer 128 experts x 3 x 2048 x 768, attention, router, norms.
    assert parameters == 2 * 151936 * 2048 + 2048 + 8 * (128 * 3 * 2048 * 768 + 18874368 + 128 * 2048 + 2 * 2048 + 256)
    assert parameters * 2 < 12e9


def test_set_lora_seeds_each_experts_adapter_by_the_parameter_it_wraps_whatever_the_wrapper_order():
    first = _tiny_moe(["experts.gate_up_proj", "experts.down_proj"])
    second = _tiny_moe(["experts.down_proj", "experts.gate_up_proj"])
    wrapped = {
        name: module.parameter_name for name, module in first.named_modules() if hasattr(module, "parameter_name")
    }
    # peft nests one wrapper in the other: which one is outside follows the list's order.
    assert sorted(wrapped.values()) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    found = [worker.set_lora(model) for model in (first, second)]
    assert found[0] == found[1] and found[0]["adapters"] == 2 * (2 + 2)

    def by_role(model):
        values = {}
        for name, module in model.named_modules():
            if hasattr(module, "parameter_name"):
                layer = name.split("layers.")[1].split(".")[0]
                values[(layer, module.parameter_name)] = module.lora_B["default"].weight.detach().clone()
        return values

    one, two = by_role(first), by_role(second)
    assert one.keys() == two.keys() and all(torch.equal(one[key], two[key]) for key in one)
    assert not torch.equal(one[("0", "gate_up_proj")][:, :4], one[("1", "gate_up_proj")][:, :4])


def test_routed_flops_count_only_each_tokens_top_k_experts():
    shape = MODEL_SHAPES["tiny-moe"]
    batch, seq, rank = 2, 32, 16
    tokens, hidden, inner, experts, top_k = batch * seq, 64, 32, 8, 2
    dense_attention = lora_step_flops({**shape, "num_experts": 0}, batch, seq, rank, MOE_TARGETS[:4])
    # Without experts the layers' MLPs are the dense ones of intermediate_size 128; take them out again.
    dense_mlp = 2 * (2 * 2 * tokens * hidden * 128 + 2 * tokens * 128 * hidden)
    rows = tokens * top_k
    router = 2 * 2 * tokens * hidden * experts
    base = 2 * (2 * rows * hidden * 2 * inner + 2 * rows * inner * hidden)
    lora = 3 * 2 * rows * rank * (hidden + 2 * inner) + 3 * 2 * rows * rank * (inner + hidden)
    expected = dense_attention - 2 * dense_mlp + 2 * (router + base + lora)
    assert lora_step_flops(shape, batch, seq, rank, MOE_TARGETS) == expected
    assert lora_step_flops(shape, batch, seq, rank, MOE_TARGETS[:4]) == expected - 2 * lora
    # Doubling the experts changes only the router's work: the routed experts' work follows top-k, not E.
    wider = lora_step_flops({**shape, "num_experts": 16}, batch, seq, rank, MOE_TARGETS)
    assert wider - expected == 2 * router
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        lora_step_flops({**shape, "num_experts_per_tok": None}, batch, seq, rank, MOE_TARGETS)


def test_gpu_moe_workloads_are_judged_by_issue_32s_targets_and_label_their_floor():
    workload = {"name": "m", "model": "qwen3-30b-a3b-8l", "batch": 4, "seq": 2048, "dtype": "bfloat16", "quant": "none"}
    systems = [{"name": name} for name in ("transformers+peft", "fastft", "unsloth-nogc")]
    record = {"device": "NVIDIA H100", "settings": {"quick": False, "workloads": [workload], "systems": systems}}
    chosen = [target for _, target in report._targets_for(record)]
    assert ("fastft", "tokens_per_s", ">=", 1.5, "transformers+peft") in chosen
    assert ("fastft", "tokens_per_s", ">=", 1.1, "unsloth-nogc") in chosen
    assert all(target[3] != 2.0 for target in chosen)
    flops, source = report.floor_flops({}, workload)
    assert flops == lora_step_flops(MODEL_SHAPES["qwen3-30b-a3b-8l"], 4, 2048, 16, ("q_proj", *MOE_TARGETS[1:]))
    assert "top-k experts only" in source


def test_quick_moe_run_matches_transformers_peft_grouped_mm(tmp_path):
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--rounds", "1"]
    command += ["--steps", "1", "--workloads", "tiny-moe-fp32-2x32", "--systems", "transformers+peft", "fastft"]
    command += ["--output-dir", str(tmp_path), "--venv-root", str(tmp_path / "venvs"), "--no-plot"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "bench-cpu-quick.json").read_text())
    runs = {run["system"]: run for run in record["runs"]}
    stock, ours = runs["transformers+peft"], runs["fastft"]
    # Two layers of q, k, v, o and two stacked expert adapters, seeded alike; the stock row ran grouped_mm experts.
    assert stock["adapters"] == ours["adapters"] == 2 * 6 and stock["lora_checksum"] == ours["lora_checksum"]
    assert stock["experts_implementation"] == "grouped_mm"
    assert "qwen3_moe.experts" in ours["fastft_patches"]
    assert "flops" not in stock and stock["flops_analytic"] == lora_step_flops(
        MODEL_SHAPES["tiny-moe"], 2, 32, 16, MOE_TARGETS
    )
    rows = {row["system"]: row for row in record["summary"]}
    assert rows["fastft"]["loss_agrees"] and rows["fastft"]["same_lora"] and rows["fastft"]["same_inputs"]
    assert rows["fastft"]["loss_rel_diff"] <= 1e-5
    assert "experts_implementation='grouped_mm'" in result.stdout
