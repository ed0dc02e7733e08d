"""LoRA-MoE experts against upstream and under the checks: parity with transformers' own experts (Qwen3-MoE with peft's
LoRA on the expert parameters, gpt-oss's clamped SwiGLU with biases), the bytes kept for backward against stock
transformers + peft, the shape contracts at construction and per call, the custom ops (opcheck, torch.compile)."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, TOLERANCE, random_tensor, relative_error
from test_kernel_moe import make_case

from fastft.kernels import dispatch, lora_moe_math
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_moe_experts import LoRAMoEExperts, lora_moe_experts
from fastft.kernels.lora_projection import LoRAWeights

E, H, I, R, T, K = 8, 32, 48, 8, 24, 2  # noqa: E741 - the paper's names: experts, hidden, intermediate, ...


def _routing(gen: torch.Generator, tokens: int = T, experts: int = E, top_k: int = K):
    probs, index = torch.softmax(torch.randn((tokens, experts), generator=gen), -1).topk(top_k, dim=-1)
    return index.to(KERNEL_DEVICE), probs.to(KERNEL_DEVICE).requires_grad_()


def _stock_qwen3_moe(gen: torch.Generator, implementation: str):
    """transformers' Qwen3MoeExperts with peft's LoRA on gate_up_proj and down_proj (B made non-zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    config._experts_implementation = implementation

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Qwen3MoeExperts(config)

        def forward(self, x, index, weights):
            return self.experts(x, index, weights)

    block = Block()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.1)
    model = get_peft_model(block, LoraConfig(r=R, lora_alpha=16, target_parameters=["gate_up_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.1)
    return model.to(KERNEL_DEVICE)


def _fused_from_peft(model) -> tuple[LoRAMoEExperts, list[torch.Tensor]]:
    """The same experts and adapters in the kernels' layout: views of peft's flat lora_A [r·E, in] / lora_B
    [out, r·E], so gradients land in peft's parameters."""
    outer = model.base_model.model.experts  # down_proj's ParamWrapper around gate_up_proj's around the experts
    inner = outer.base_layer
    experts = inner.base_layer
    a1, b1 = inner.lora_A["default"].weight, inner.lora_B["default"].weight
    a2, b2 = outer.lora_A["default"].weight, outer.lora_B["default"].weight
    fused = LoRAMoEExperts(
        LoRAWeights(experts.gate_up_proj, a1.view(E, R, H), b1.view(2 * I, R, E).permute(2, 0, 1), 2.0),
        LoRAWeights(experts.down_proj, a2.view(E, R, I), b2.view(H, R, E).permute(2, 0, 1), 2.0),
    )
    return fused, [a1, b1, a2, b2]


def _saved(function) -> tuple[torch.Tensor, list[torch.Tensor]]:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = function()
    return out, saved


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_equals_transformers_and_peft_and_keeps_under_half_the_bytes(kernel_path, gen, implementation):
    model = _stock_qwen3_moe(gen, implementation)
    fused, adapters = _fused_from_peft(model)
    x = random_tensor((T, H), torch.float32, gen).requires_grad_()
    index, weights = _routing(gen)
    leaves = [x, weights, *adapters]

    stock_out, stock_saved = _saved(lambda: model(x, index, weights))
    grad_out = torch.randn_like(stock_out)
    stock_grads = torch.autograd.grad(stock_out, leaves, grad_out)
    fused_out, fused_saved = _saved(lambda: fused(x, index, weights))
    fused_grads = torch.autograd.grad(fused_out, leaves, grad_out)

    assert relative_error(fused_out, stock_out) < TOLERANCE[torch.float32]
    for name, got, want in zip(["x", "weights", "A1", "B1", "A2", "B2"], fused_grads, stock_grads, strict=True):
        assert relative_error(got, want) < TOLERANCE[torch.float32], name
    # Nothing of [tokens, experts, intermediate] size: besides the adapters (views of peft's parameters), the widest
    # kept tensor is the gate | up rows [T·k, 2I].
    adapter_storages = {a.untyped_storage().data_ptr() for a in adapters}
    activations = [t for t in fused_saved if t.untyped_storage().data_ptr() not in adapter_storages]
    assert len(activations) == len(fused_saved) - 4
    assert max(t.numel() for t in activations) == T * K * 2 * I < T * E * I
    # Measured at these shapes: 78,472 bytes fused against 310,976 (eager) / 304,512 (grouped_mm) stock, 0.25x.
    fused_bytes, stock_bytes = _nbytes(fused_saved), _nbytes(stock_saved)
    assert fused_bytes <= 0.5 * stock_bytes, (fused_bytes, stock_bytes)


def test_gpt_oss_equals_transformers_gpt_oss_experts(kernel_path, gen):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts

    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "eager"
    stock = GptOssExperts(config)
    with torch.no_grad():
        for parameter in stock.parameters():
            # Wide enough that the clamp at swiglu_limit (7) is hit.
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 2.0)
        stock.requires_grad_(False)
    stock = stock.to(KERNEL_DEVICE)
    x = random_tensor((T, H), torch.float32, gen).requires_grad_()
    index, weights = _routing(gen)
    expected = stock(x, index, weights)
    assert (expected.abs() > 0).all()
    fused = LoRAMoEExperts(
        LoRAWeights(stock.gate_up_proj.transpose(1, 2), bias=stock.gate_up_proj_bias),
        LoRAWeights(stock.down_proj.transpose(1, 2), bias=stock.down_proj_bias),
        "gpt_oss",
        interleaved=True,
        alpha=config.swiglu_alpha,
        limit=config.swiglu_limit,
    )
    got = fused(x, index, weights)
    assert relative_error(got, expected) < TOLERANCE[torch.float32]
    grad_out = torch.randn_like(got)
    for a, b in zip(
        torch.autograd.grad(got, [x, weights], grad_out),
        torch.autograd.grad(expected, [x, weights], grad_out),
        strict=True,
    ):
        assert relative_error(a, b) < TOLERANCE[torch.float32]


def test_the_reference_takes_grouped_mm_for_aligned_shapes(monkeypatch, gen):
    calls = []
    grouped_mm = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    case = make_case(gen, torch.float32)
    with dispatch.force_reference():
        out = case.experts()(case.x.cpu(), case.index.cpu(), case.weights.cpu())
        out.sum().backward()
    # Forward: X A1ᵀ, gate_up (+ its LoRA term), H A2ᵀ, down (+ LoRA); backward: the rest, the four dA / dB sums.
    assert len(calls) >= 14


# Contracts ------------------------------------------------------------------------------------------------------------


def _weights(gen, *, experts=E, gate_up=(2 * I, H), down=(H, I), a1=(R, H), b1=(2 * I, R), a2=(R, I), b2=(H, R)):
    def t(shape, grad=False):
        return random_tensor(shape, torch.float32, gen, 0.1).requires_grad_(grad)

    gate_up_w = t((experts, *gate_up))
    down_w = t((experts, *down))
    return (
        LoRAWeights(gate_up_w, t((experts, *a1), True), t((experts, *b1), True), 2.0),
        LoRAWeights(down_w, t((experts, *a2), True), t((experts, *b2), True), 2.0),
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"gate_up": (H, 2 * I)}, r"gate_up_proj: must be \[E, 2·I, H\] = \[8, 96, 32\].*got \[8, 32, 96\].*transpose"),
        ({"down": (I, H)}, r"down_proj: must be \[E, H, I\] = \[8, 32, 48\].*got \[8, 48, 32\].*transpose"),
        ({"gate_up": (H, 2 * I), "down": (I, H)}, r"both transposed: this is gpt-oss's storage.*interleaved=True"),
        ({"down": (H, I + 2)}, r"down_proj: must be \[E, H, I\] = \[8, 32, 48\].*got \[8, 32, 50\]"),
        ({"gate_up": (2 * I + 1, H)}, r"odd number \(97\) of rows"),
        ({"a1": (R, H + 1)}, r"gate_up_proj: LoRA A must be \[experts, r, in\] = \[8, r, 32\].*got \[8, 8, 33\]"),
        ({"b1": (2 * I, R + 1)}, r"gate_up_proj: LoRA B must be \[experts, out, r\] = \[8, 96, 8\].*got \[8, 96, 9\]"),
        ({"a2": (R, H)}, r"down_proj: LoRA A must be \[experts, r, in\] = \[8, r, 48\].*got \[8, 8, 32\]"),
        ({"b2": (I, R)}, r"down_proj: LoRA B must be \[experts, out, r\] = \[8, 32, 8\].*got \[8, 48, 8\]"),
    ],
    ids=[
        "gate_up transposed",
        "down transposed",
        "gpt-oss storage",
        "down width",
        "odd gate_up",
        "A1",
        "B1",
        "A2",
        "B2",
    ],
)
def test_shape_errors_at_construction_name_module_and_shapes(gen, changes, match):
    gate_up, down = _weights(gen, **changes)
    with pytest.raises(ShapeContractError, match=match):
        LoRAMoEExperts(gate_up, down, name="model.layers.3.mlp.experts")
    with pytest.raises(ShapeContractError, match=r"^model\.layers\.3\.mlp\.experts"):
        LoRAMoEExperts(gate_up, down, name="model.layers.3.mlp.experts")


def test_other_construction_errors(gen):
    gate_up, down = _weights(gen)
    with pytest.raises(ShapeContractError, match=r"down_proj: must hold one matrix per expert.*\[8, 96, 32\]"):
        LoRAMoEExperts(gate_up, LoRAWeights(down.weight[:7], None, None))
    with pytest.raises(ShapeContractError, match=r"the bias must be \[experts, out\] = \[8, 96\], got \[8, 48\]"):
        LoRAMoEExperts(LoRAWeights(gate_up.weight, bias=torch.zeros(E, I)), down)
    with pytest.raises(ValueError, match="pass both lora_a and lora_b"):
        LoRAMoEExperts(LoRAWeights(gate_up.weight, gate_up.lora_a, None), down)
    with pytest.raises(ShapeContractError, match=r"must be 3-D \[experts, out, in\], got \[96, 32\]"):
        LoRAMoEExperts(LoRAWeights(gate_up.weight[0]), down)
    with pytest.raises(ValueError, match="activation must be one of 'silu', 'gpt_oss'"):
        LoRAMoEExperts(gate_up, down, "gelu")
    with pytest.raises(ValueError, match="4-bit experts are not supported"):
        LoRAMoEExperts(LoRAWeights(gate_up.weight, quant_state=object()), down)


def test_call_errors_name_the_shapes(gen):
    gate_up, down = _weights(gen)
    experts = LoRAMoEExperts(gate_up, down, name="experts")
    x = random_tensor((T, H), torch.float32, gen)
    index, weights = _routing(gen)
    with pytest.raises(ShapeContractError, match=r"x must be \[..., hidden\] = \[..., 32\].*got x of shape \[24, 31\]"):
        experts(x[:, :31], index, weights)
    with pytest.raises(ShapeContractError, match=r"top_k must be at most the number of experts \(8\).*top_k 9"):
        experts(x, torch.zeros((T, 9), dtype=torch.int64), torch.zeros((T, 9)))
    with pytest.raises(ShapeContractError, match=r"top_k_index must hold expert indices in \[0, 8\).*got 8"):
        experts(x, torch.full((T, K), 8), weights)
    with pytest.raises(ShapeContractError, match=r"top_k_index must hold expert indices in \[0, 8\).*got -1"):
        experts(x, torch.full((T, K), -1), weights)
    with pytest.raises(ShapeContractError, match=r"top_k_weights must be \[tokens, top_k\] = \[24, 2\].*got \[24, 8\]"):
        experts(x, index, torch.zeros((T, E)))
    with pytest.raises(ShapeContractError, match=r"top_k_index must be \[tokens, top_k\] = \[24, k\].*got \[23, 2\]"):
        experts(x, index[:-1], weights)
    with pytest.raises(TypeError, match="integer expert indices"):
        experts(x, index.float(), weights)
    with pytest.raises(TypeError, match="x is torch.float16 but the expert weights are torch.float32"):
        experts(x.half(), index, weights)
    trainable = LoRAMoEExperts(LoRAWeights(gate_up.weight.clone().requires_grad_()), down)
    with pytest.raises(ValueError, match=r"requires grad.*freeze it"):
        trainable(x, index, weights)


# Custom ops -----------------------------------------------------------------------------------------------------------


def test_opcheck_forward_and_backward_ops(kernel_path, gen):
    case = make_case(gen, torch.float32, gpt_oss=True, experts=5, hidden=16, inter=16, tokens=6)
    arguments = case.experts().op_arguments()
    inputs = (case.x, case.index, case.weights)
    results = torch.library.opcheck(lora_moe_math.op, inputs, arguments)
    assert set(results.values()) == {"SUCCESS"}, results
    outputs = lora_moe_math.op(*(t.detach() for t in inputs), **arguments)
    backward_args = (torch.randn_like(outputs[0]), case.x.detach(), case.weights.detach(), *outputs[1:])
    backward_kwargs = {
        "gate_up_proj": arguments["gate_up_proj"],
        "down_proj": arguments["down_proj"],
        "lora_a": [a.detach() for a in arguments["lora_a"]],
        "lora_b": [b.detach() for b in arguments["lora_b"]],
        **{k: arguments[k] for k in ("biases", "layout", "scales", "activation", "alpha", "limit")},
        "needs": [True, True, True, True],
    }
    results = torch.library.opcheck(lora_moe_math.backward_op, backward_args, backward_kwargs)
    assert set(results.values()) == {"SUCCESS"}, results


def test_compiled_call_is_one_op_and_matches_eager(kernel_path, gen):
    case = make_case(gen, torch.float32, experts=5, hidden=16, inter=16, tokens=6)
    experts = case.experts()
    leaves = case.leaves()

    def run(x, index, weights):
        return experts(x * 2.0, index, weights).tanh()

    def grads(function):
        out = function(case.x, case.index, case.weights)
        return [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    expected = grads(run)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(run)(case.x, case.index, case.weights)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert "fastft.lora_moe_experts.default" in targets, targets
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    for got, want in zip(grads(compiled), expected, strict=True):
        assert relative_error(got, want) < TOLERANCE[torch.float32]
    torch._dynamo.reset()


def test_function_form_equals_the_held_experts(gen):
    case = make_case(gen, torch.float32)
    a1, b1, a2, b2 = case.adapters
    out = lora_moe_experts(
        case.x, case.index, case.weights, LoRAWeights(case.gate_up, a1, b1, 2.0), LoRAWeights(case.down, a2, b2, 0.5)
    )
    assert torch.equal(out, case.experts()(case.x, case.index, case.weights))
