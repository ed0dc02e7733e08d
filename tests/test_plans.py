"""Patched modules decide once and reuse the decision until something it depends on changes (fastft.patches.plans),
and read their arguments as Signature.bind would (fastft.patches.arguments)."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from conftest import lora_model

from fastft.patches import plans
from fastft.patches.arguments import ArgumentReader


@pytest.fixture
def model(tiny_llama_dir):
    model, _ = lora_model(tiny_llama_dir, use_gradient_checkpointing=False)
    return model


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The name of the module class each time a plan is (re)built."""
    seen: list[str] = []
    original = plans.planned

    def counting(module, stamp, build):
        def recorded():
            seen.append(type(module).__name__)
            return build()

        return original(module, stamp, recorded)

    import fastft.patches.decoder as decoder

    monkeypatch.setattr(decoder, "planned", counting)
    return seen


def _step(model, dtype=torch.long) -> torch.Tensor:
    ids = torch.arange(1, 9, dtype=dtype).unsqueeze(0)
    return model(input_ids=ids, labels=ids).loss


def _layers(model) -> int:
    return model.config.num_hidden_layers


def test_a_plan_is_built_once_and_reused(model, builds):
    _step(model).backward()
    assert len(builds) == 2 * _layers(model)  # one attention, one MLP plan per layer
    for _ in range(3):
        _step(model).backward()
    assert len(builds) == 2 * _layers(model)


@pytest.mark.parametrize("rerun", [True, False], ids=["rerun", "through-the-forward"])
@pytest.mark.parametrize("mode", [True, "offload", "sqrt"])
def test_checkpointing_decides_once_per_grad_mode_it_runs_under(tiny_llama_dir, builds, monkeypatch, mode, rerun):
    """The checkpointed forward runs without grad. Its recompute runs the node the forward offered
    (fastft.checkpointing.rerun) and decides nothing; where it goes through the forward instead, it decides with grad:
    then two decisions per module, each made once, not one made again on every call."""
    if not rerun:
        import fastft.patches.fused_layer as fused_layer

        monkeypatch.setattr(fused_layer, "listening", lambda: False)
    model, _ = lora_model(tiny_llama_dir, use_gradient_checkpointing=mode)
    _step(model).backward()
    first = len(builds)
    assert first == (1 if rerun else 2) * 2 * _layers(model)
    for _ in range(3):
        _step(model).backward()
    assert len(builds) == first


def test_a_fused_layer_looks_up_one_plan_and_asks_again_for_a_replaced_module(model, builds, monkeypatch):
    """A fused Llama layer keeps one plan under its attention's and MLP's stamps (fastft.patches.fused_layer): later
    calls do not look up the attention's own plan. A new attention module holding the very same projections (equal
    stamps) still makes the layer ask it, and that module decides for itself."""
    import fastft.patches.fused_layer as fused_layer

    asked = []
    original = fused_layer.attention_plan

    def asking(family, module):
        asked.append(module)
        return original(family, module)

    monkeypatch.setattr(fused_layer, "attention_plan", asking)
    _step(model).backward()
    assert len(asked) == _layers(model)
    loss = _step(model)
    loss.backward()
    assert len(asked) == _layers(model)

    layer = model.base_model.model.model.layers[0]
    replacement = copy.copy(layer.self_attn)  # shallow: the same projection objects, so the same stamps
    del replacement.__dict__[plans.PLAN_ATTRIBUTE]
    layer.self_attn = replacement
    before = len(builds)
    again = _step(model)
    assert asked[-1] is replacement
    assert len(builds) == before + 1  # the replacement's own attention plan
    assert torch.equal(again, loss)


def test_a_plan_keeps_a_few_recent_decisions():
    module = torch.nn.Linear(2, 2)
    made = []

    def build(tag):
        return lambda: (made.append(tag) or tag, [])

    for stamp in ("a", "b", "a", "b", "c", "d", "e", "a"):
        assert plans.planned(module, stamp, build(stamp)) == stamp
    # a and b built once each while they alternate; c, d, e push a out (four kept), so a is built again.
    assert made == ["a", "b", "c", "d", "e", "a"]


@pytest.mark.parametrize(
    "change",
    ["disable_adapter", "grad_mode", "hook", "requires_grad", "dropout_mode", "scale"],
)
def test_a_change_rebuilds_the_plan_and_matches_a_fresh_decision(model, builds, change):
    """After each change the kept plans are replaced, and the output equals the stock peft model's, which decides
    everything afresh on every call."""
    _step(model)
    first = len(builds)
    ids = torch.arange(1, 9).unsqueeze(0)
    layer = model.base_model.model.model.layers[0]
    q_proj = layer.self_attn.q_proj
    if change == "disable_adapter":
        adapted = model(input_ids=ids).logits.detach()
        with model.disable_adapter():
            disabled = model(input_ids=ids).logits.detach()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.zero_()
        # Adapters off is the base model: what zeroed B's give, and not what the adapted model gave.
        assert torch.allclose(disabled, model(input_ids=ids).logits.detach(), atol=1e-6)
        assert not torch.allclose(disabled, adapted, atol=1e-4)
    elif change == "grad_mode":
        with torch.no_grad():
            _step(model)
    elif change == "hook":
        calls = []
        handle = q_proj.register_forward_hook(lambda module, args, output: calls.append(1))
        _step(model)
        handle.remove()
        assert calls, "a forward hook on q_proj must run: the layer falls back to the projection's own forward"
    elif change == "requires_grad":
        q_proj.base_layer.weight.requires_grad_(True)
        _step(model)
        q_proj.base_layer.weight.requires_grad_(False)
    elif change == "dropout_mode":
        q_proj.lora_dropout["default"] = torch.nn.Dropout(0.5)
        _step(model)
        q_proj.lora_dropout["default"].eval()
        _step(model)
    elif change == "scale":
        before = _step(model).item()
        q_proj.scaling["default"] *= 4.0
        after = _step(model).item()
        assert after != before
    assert len(builds) > first


def test_scale_change_is_seen_by_the_fused_output(model):
    ids = torch.arange(1, 9).unsqueeze(0)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    model(input_ids=ids)
    q_proj.scaling["default"] *= 3.0
    fused = model(input_ids=ids).logits
    from fastft.kernels import dispatch

    # The same weights through peft's own layers (no fastft patch decides anything there).
    q_proj.register_forward_hook(lambda module, args, output: None)  # forces this layer's fallback path
    with dispatch.force_reference():
        unfused = model(input_ids=ids).logits
    assert torch.allclose(fused, unfused, atol=1e-5)


def test_a_deep_copied_model_decides_anew(model):
    _step(model)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.__dict__.get("_fastft_plan"), plans.Plan)
    copied = copy.deepcopy(model)
    assert copied.base_model.model.model.layers[0].self_attn.__dict__.get("_fastft_plan") is None
    # ... and computes with its own weights, not the original's.
    with torch.no_grad():
        for name, parameter in copied.named_parameters():
            if "lora_B" in name:
                parameter.mul_(2.0)
    ids = torch.arange(1, 9).unsqueeze(0)
    assert not torch.allclose(copied(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_pickled_module_has_no_plan(model):
    _step(model)
    attention = model.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.__dict__.get("_fastft_plan"), plans.Plan)
    assert pickle.loads(pickle.dumps(attention)).__dict__.get("_fastft_plan") is None


def _upstream(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    return None


def _no_var_keyword(self, x, y=2):
    return None


@pytest.mark.parametrize(
    ("function", "args", "kwargs"),
    [
        (_upstream, (1, 2, 3), {}),
        (_upstream, (1,), {"position_embeddings": 2, "attention_mask": 3, "flag": 4}),
        (_upstream, (), {"hidden_states": 1, "position_embeddings": 2, "attention_mask": None}),
        (_upstream, (1, 2, 3, 4), {"other": 5}),
        (_no_var_keyword, (1,), {}),
        (_no_var_keyword, (), {"x": 1, "y": 3}),
    ],
)
def test_reader_agrees_with_bind(function, args, kwargs):
    signature = inspect.signature(function)
    bound = signature.bind("self", *args, **kwargs)
    bound.apply_defaults()
    expected = dict(bound.arguments)
    expected.pop("self")
    expected_extra = expected.pop("kwargs", {})
    named, extra = ArgumentReader(signature).read("self", args, dict(kwargs))
    assert named == expected
    assert extra == expected_extra


@pytest.mark.parametrize(
    ("function", "args", "kwargs"),
    [
        (_upstream, (1, 2, 3, 4, 5), {}),  # too many positional
        (_upstream, (1,), {"hidden_states": 1, "position_embeddings": 2, "attention_mask": 3}),  # given twice
        (_upstream, (1,), {"attention_mask": 3}),  # missing
        (_no_var_keyword, (1,), {"z": 3}),  # unknown keyword
    ],
)
def test_reader_raises_binds_own_error(function, args, kwargs):
    signature = inspect.signature(function)
    with pytest.raises(TypeError) as expected:
        signature.bind("self", *args, **kwargs)
    with pytest.raises(TypeError) as actual:
        ArgumentReader(signature).read("self", args, dict(kwargs))
    assert str(actual.value) == str(expected.value)
