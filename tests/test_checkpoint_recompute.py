"""use_gradient_checkpointing=True on fastft's checkpointer: the recompute, what a call costs, what it must not skip.

True ("recompute") keeps every layer input on the device and recomputes the layer in backward through the same
:class:`~fastft.checkpointing.layer.LayerCheckpoint` as "offload" and "sqrt"; where the ``checkpoint.offload`` patch
does not apply it is transformers' own checkpointing, without a warning (it is what True asks for).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_same_loss_and_grads, randomize_lora_b, save_tiny_llama
from torch.utils.flop_counter import FlopCounterMode

from fastft import FastModel
from fastft.bench.operators import OperatorMode
from fastft.checkpointing.layer import _CheckpointedLayer
from fastft.checkpointing.modes import MODES, LayerCheckpoint, engine_of, resolve_mode

LAYERS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smol_tokenizer):
    """A four-layer tiny Llama on disk (the 4-bit case loads it quantised)."""
    return save_tiny_llama(tmp_path_factory, smol_tokenizer, "tiny-llama-4-layers-recompute", num_hidden_layers=LAYERS)


def _model(folder, mode, dropout=0.0, load_in_4bit=False, patch=True):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit, patch=patch)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=dropout, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    return model


def _ids(length: int = 23, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 49152, (2, length), generator=torch.Generator().manual_seed(seed))


def _step(model, seed: int = 42):
    """One forward and backward; the loss, every LoRA gradient, and the CPU RNG state the step left behind."""
    torch.manual_seed(seed)
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads, torch.get_rng_state()


def _checkpoints(model) -> list:
    return [layer._gradient_checkpointing_func for layer in model.base_model.model.model.layers]


def test_the_mode_names():
    assert resolve_mode(True) == resolve_mode("recompute") == resolve_mode("RECOMPUTE") == "recompute"
    assert MODES == ("recompute", "offload", "sqrt", "sqrt-offload")


@pytest.mark.lane
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_recompute_runs_on_fastfts_checkpointer_with_the_gradients_of_no_checkpointing(folder, dropout):
    expected = _step(_model(folder, False, dropout))
    model = _model(folder, True, dropout)
    checkpoints = _checkpoints(model)
    assert all(type(c) is LayerCheckpoint and c.keep_on_device and not c.segment for c in checkpoints)
    actual = _step(model)
    assert_same_loss_and_grads(expected, actual)
    # The recompute ran under the forward's RNG state and then gave the caller's back: with dropout the step leaves
    # the generator where a step without checkpointing leaves it.
    assert torch.equal(actual[2], expected[2])


@pytest.mark.parametrize("mode", MODES)
def test_a_flop_count_of_a_checkpointed_step_runs_and_changes_no_gradient(folder, mode):
    # FlopCounterMode's module tracker hooks every module's inputs; inside the checkpointer's torch.autograd.grad
    # those hooks once asked the engine about a leaf and torch raised ("A leaf node was passed to
    # _will_engine_execute_node ...").
    expected = _step(_model(folder, False))
    with FlopCounterMode(display=False) as plain:
        _step(_model(folder, False))
    with FlopCounterMode(display=False) as counted:
        actual = _step(_model(folder, mode))
    assert_same_loss_and_grads(expected, actual)
    # The recompute's forward is counted on top of the step's own.
    assert counted.get_total_flops() > plain.get_total_flops() > 0


@pytest.mark.lane
def test_recompute_with_a_4bit_base(folder):
    expected = _step(_model(folder, False, load_in_4bit=True))
    assert_same_loss_and_grads(expected, _step(_model(folder, True, load_in_4bit=True)))


def test_the_fused_kernels_run_in_the_forward_and_in_the_recompute(folder, fused_calls):
    calls = fused_calls
    model = _model(folder, True)
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    # Each Llama layer is one fused node (its q / k / v, o and MLP inside), in the forward and again in the recompute.
    assert calls == ["LoRADecoderLayer"] * LAYERS
    loss.backward()
    assert calls == ["LoRADecoderLayer"] * (2 * LAYERS)


def test_without_the_patch_true_is_transformers_checkpointing_and_says_nothing(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="fastft.checkpoint"):
        model = _model(folder, True, patch=False)
        model.get_base_model().gradient_checkpointing_enable()
    assert engine_of(model) is None
    assert not any(isinstance(c, LayerCheckpoint) for c in _checkpoints(model))
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)
    assert not [r.message for r in caplog.records if r.name == "fastft.checkpoint"]
    assert_same_loss_and_grads(_step(_model(folder, False)), _step(model), bound=1e-4)


def test_autocast_is_replayed_whether_or_not_the_backward_runs_under_it(folder):
    """Backward outside autocast (as trainers run it): the recompute enters the forward's autocast. Backward inside
    the same autocast: nothing to enter. Either way the arithmetic is the forward's bf16."""
    for backward_under_autocast in (False, True):
        results = []
        for mode in (False, True):
            model = _model(folder, mode)
            ids = _ids()
            torch.manual_seed(42)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
                if backward_under_autocast:
                    loss.backward()
            if not backward_under_autocast:
                loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        # A recompute in fp32 would be off by about 1e-2.
        assert_same_loss_and_grads(*results, bound=1e-6)


class _Ops(OperatorMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_checkpointing_adds_the_recompute_and_next_to_no_op_of_its_own(folder, monkeypatch):
    """Every aten op of a step, counted: the checkpointed step runs the ops of the step without checkpointing plus
    those of the layers' recompute, give or take one per layer (the input detached for the recompute, where the
    forward without checkpointing detaches something else). torch.utils.checkpoint adds about forty per layer of its
    own, and the first layer used to compute an input gradient that nothing reads."""
    counts = {}
    for mode in (False, True):
        model = _model(folder, mode)
        _step(model)
        model.zero_grad(set_to_none=True)
        with _Ops() as ops:
            _step(model)
        counts[mode] = ops.count
    recompute = []
    original = _CheckpointedLayer.backward

    def counting(ctx, *grads):
        # The recompute runs the layer's rerun for the backward where its forward offered one, else the layer call.
        call = ctx.call
        name = "function" if call.backward_rerun is None else "backward_rerun"
        function = getattr(call, name)

        def counted(*args, **kwargs):
            before = ops.count
            result = function(*args, **kwargs)
            recompute.append(ops.count - before)
            return result

        setattr(call, name, counted)
        try:
            return original(ctx, *grads)
        finally:
            setattr(call, name, function)

    monkeypatch.setattr(_CheckpointedLayer, "backward", staticmethod(counting))
    model.zero_grad(set_to_none=True)
    with _Ops() as ops:
        _step(model)
    assert ops.count == counts[True] and len(recompute) == LAYERS
    assert abs(counts[True] - counts[False] - sum(recompute)) <= LAYERS


def test_a_parameter_frozen_or_unfrozen_between_steps_is_seen_and_no_step_walks_the_layer_again(folder):
    expected_model, model = _model(folder, False), _model(folder, True)
    layer_zero = [module for name, module in model.named_modules() if name.endswith("layers.0.self_attn.q_proj")][0]
    frozen = layer_zero.lora_A["default"].weight
    name_of_frozen = "layers.0.self_attn.q_proj.lora_A.default.weight"
    for step in range(3):
        # Step 1 trains without q_proj's A in layer 0, step 2 with it again.
        for twin in (expected_model, model):
            twin.zero_grad(set_to_none=True)
            for name, parameter in twin.named_parameters():
                if "lora_" in name:
                    parameter.requires_grad_(not (step == 1 and name.endswith(name_of_frozen)))
        expected, actual = _step(expected_model), _step(model)
        assert_same_loss_and_grads(expected, actual)
        assert (frozen.grad is None) is (step == 1)
        # As trl does around its reference forwards: a new checkpointer per layer, the same walk.
        model.get_base_model().gradient_checkpointing_enable()
    assert [c.layer_parameters.walks for c in _checkpoints(model)] == [1] * LAYERS


def test_a_parameter_registered_or_swapped_in_after_a_step_gets_its_gradient(folder):
    """A walk of the layer's parameters is made again after a registration anywhere (torch's registration hooks) or
    when a module no longer holds the parameter the walk found (a write straight into ``Module._parameters``)."""
    model = _model(folder, True)
    _step(model)
    projection = [module for name, module in model.named_modules() if name.endswith("layers.1.mlp.down_proj")][0]
    for how in ("setattr", "direct"):
        fresh = torch.nn.Parameter(projection.lora_B["default"].weight.detach() * 1.5)
        if how == "setattr":
            projection.lora_B["default"].weight = fresh
        else:
            projection.lora_B["default"]._parameters["weight"] = fresh
        model.zero_grad(set_to_none=True)
        loss, grads, _ = _step(model)
        assert fresh.grad is not None and fresh.grad.norm() > 0, how
        expected = _model(folder, False)
        with torch.no_grad():
            for (_, mine), (_, theirs) in zip(model.named_parameters(), expected.named_parameters(), strict=True):
                theirs.copy_(mine)
        assert_same_loss_and_grads(_step(expected)[:2], (loss, grads))


def test_the_embedding_output_needs_no_gradient_under_fastfts_checkpointer(folder):
    """transformers' enable call hooks the input embeddings so their output requires grad (reentrant checkpointing
    needs it); fastft's checkpointer does not, so that hook is undone, and a hook set before is left alone."""
    model = _model(folder, True)
    base = model.get_base_model()
    seen = []
    base.model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].requires_grad))
    _step(model)
    base.gradient_checkpointing_enable()  # as a trainer does at start-up
    _step(model)
    assert seen == [False, False]
    assert not base.get_input_embeddings()._forward_hooks
    base.enable_input_require_grads()  # the user's own
    base.gradient_checkpointing_enable()
    _step(model)
    assert seen[-1] is True


def test_a_copied_model_walks_and_watches_its_own_layers(folder):
    import copy

    model = _model(folder, True)
    _step(model)
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    walks = [c.layer_parameters for c in _checkpoints(twin)]
    assert all(w.layer is layer for w, layer in zip(walks, twin.base_model.model.model.layers, strict=True))
    assert_same_loss_and_grads(_step(model), _step(twin))
    # A new adapter module registered into the copy's layer is seen by the copy's walk.
    projection = [module for name, module in twin.named_modules() if name.endswith("layers.2.mlp.up_proj")][0]
    old = projection.lora_B["default"]
    fresh = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        fresh.weight.copy_(old.weight * 2)
    projection.lora_B["default"] = fresh
    twin.zero_grad(set_to_none=True)
    _step(twin)
    assert fresh.weight.grad is not None and fresh.weight.grad.norm() > 0
    assert walks[2].walks == 2
