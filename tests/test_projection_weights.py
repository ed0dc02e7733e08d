"""projection_weights: a projection whose forward is not its own (an accelerate hook, a torch hook, an instance-level
forward) runs through that forward; a plain one is read as weights."""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from peft import LoraConfig, get_peft_model

from fastft.kernels import LoRAWeights
from fastft.patches.lora_layers import projection_weights


class _Owner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 6, bias=False)


def _lora() -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(_Owner(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    return model.base_model.model.q_proj


def _plain() -> torch.nn.Module:
    return torch.nn.Linear(8, 6, bias=False).requires_grad_(False)


@pytest.mark.parametrize("build", [_lora, _plain], ids=["lora", "plain"])
def test_a_plain_projection_is_read_as_weights(build):
    assert isinstance(projection_weights(build(), "q_proj", training=True), LoRAWeights)


@pytest.mark.parametrize("build", [_lora, _plain], ids=["lora", "plain"])
def test_an_accelerate_hook_sends_the_projection_through_its_forward(build):
    module = build()
    add_hook_to_module(module, ModelHook())
    reason = projection_weights(module, "q_proj", training=True)
    assert reason == "q_proj has its forward replaced on the instance (an accelerate / offload hook?)"


def test_an_instance_forward_without_an_accelerate_hook_counts_too():
    module = _lora()
    module.forward = lambda x: x  # noqa: ARG005 - only its presence matters
    assert "forward replaced on the instance" in projection_weights(module, "q_proj", training=True)


def test_a_hook_on_the_base_layer_is_named_there():
    module = _lora()
    add_hook_to_module(module.base_layer, ModelHook())
    reason = projection_weights(module, "q_proj", training=True)
    assert reason == "q_proj.base_layer has its forward replaced on the instance (an accelerate / offload hook?)"


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_torch_forward_hook_sends_the_projection_through_its_forward(kind):
    module = _lora()
    hook = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
    handle = hook(lambda *args: None)
    assert projection_weights(module, "q_proj", training=True) == "q_proj has forward hooks the fused path would bypass"
    handle.remove()
    assert isinstance(projection_weights(module, "q_proj", training=True), LoRAWeights)


def test_a_nested_base_layer_is_read_down_to_the_innermost_one_as_peft_does():
    module = _lora()
    inner = module.base_layer
    holder = torch.nn.Module()
    holder.base_layer = inner
    module.base_layer = holder
    assert module.get_base_layer() is inner
    weights = projection_weights(module, "q_proj", training=True)
    assert isinstance(weights, LoRAWeights) and weights.weight is inner.weight


@pytest.mark.parametrize("layout", ["fused-3d", "per-expert"])
def test_an_accelerate_hook_on_the_experts_changes_the_kept_decisions_stamp(layout):
    # The kept MoE decision is reused while its stamp holds; the decision refuses a module with accelerate's
    # _hf_hook, so the stamp must change when one appears, even with no instance-level forward beside it.
    from fastft.patches import moe_experts, moe_experts_4x

    stamp = moe_experts._stamp if layout == "fused-3d" else moe_experts_4x._stamp
    block = torch.nn.Module()
    block.experts = torch.nn.ModuleList()
    before = stamp(block)
    block.experts.__dict__["_hf_hook"] = ModelHook()
    assert stamp(block) != before
