"""The checkpointer's recompute and the "sqrt" replay call the fused layer's own rerun instead of its forward.

The fused Llama layer offers its node, plan and arguments to the listening checkpointer (fastft.checkpointing.rerun);
the layer's forward (argument binding, hook checks, seven projection stamps) then runs once per layer and step, and
the kernel as often as before. Where the recompute has to go through the forward again (a hook on the layer, a
trainable base weight) no offer is made, and the forward runs as it did. The backward's recompute builds the node
without computing its output (lora_decoder_layer(..., output=False)): nothing reads it, so the down projection's GEMM
is not run a third time.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_same_loss_and_grads, randomize_lora_b, save_tiny_llama

import fastft.patches.fused_layer as fused_layer
from fastft import FastModel
from fastft.bench.operators import OperatorMode
from fastft.checkpointing import rerun

LAYERS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smol_tokenizer):
    return save_tiny_llama(tmp_path_factory, smol_tokenizer, "tiny-llama-4-layers-rerun", num_hidden_layers=LAYERS)


def _model(folder, mode, attention_dropout=0.0):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    for layer in model.base_model.model.model.layers:
        # Drawn inside the fused node (LoRA dropout would take the layer off the fused path).
        layer.self_attn.attention_dropout = attention_dropout
    return model


def _step(model):
    torch.manual_seed(42)
    ids = torch.randint(3, 49152, (2, 23), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


@pytest.fixture
def runs(monkeypatch):
    """How often, per step, the fused layer's forward decided its plan, how often its node ran in full and how often
    the backward-only recompute built it."""
    counts = {"forward": 0, "node": 0, "recompute": 0}
    plan, node = fused_layer.attention_plan, fused_layer.lora_decoder_layer

    def counted_plan(*args, **kwargs):
        counts["forward"] += 1
        return plan(*args, **kwargs)

    def counted_node(*args, **kwargs):
        counts["node" if kwargs.get("output", True) else "recompute"] += 1
        return node(*args, **kwargs)

    monkeypatch.setattr(fused_layer, "attention_plan", counted_plan)
    monkeypatch.setattr(fused_layer, "lora_decoder_layer", counted_node)
    return counts


@pytest.mark.parametrize(
    ("mode", "nodes"),
    # Segments of two layers under "sqrt": the replay runs each segment's first layer once more, in full (its output
    # is the next layer's input).
    [(True, LAYERS), ("offload", LAYERS), ("sqrt", LAYERS + LAYERS // 2)],
    ids=["recompute", "offload", "sqrt"],
)
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "attention-dropout"])
def test_the_recompute_runs_the_node_without_the_layer_forward(folder, runs, mode, nodes, dropout):
    expected = _step(_model(folder, False, dropout))
    model = _model(folder, mode, dropout)
    runs.update(forward=0, node=0, recompute=0)
    # With dropout, the rerun must draw the forward's masks (the checkpointer's RNG state) or every gradient moves.
    assert_same_loss_and_grads(expected, _step(model))
    assert runs == {"forward": LAYERS, "node": nodes, "recompute": LAYERS}


@pytest.mark.lane
@pytest.mark.parametrize("mode", [True, "sqrt"], ids=["recompute", "sqrt"])
def test_gradients_with_and_without_the_rerun_are_bit_equal(folder, monkeypatch, mode):
    model = _model(folder, mode, attention_dropout=0.1)
    with_rerun = _step(model)
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(fused_layer, "listening", lambda: False)
    without = _step(model)
    assert torch.equal(with_rerun[0], without[0])
    assert with_rerun[1].keys() == without[1].keys()
    for name, grad in with_rerun[1].items():
        assert torch.equal(grad, without[1][name]), name


@pytest.mark.lane
def test_a_hooked_layer_is_recomputed_through_its_forward_and_its_hook_runs_as_before(folder, runs, monkeypatch):
    model = _model(folder, True)
    calls = []
    model.base_model.model.model.layers[1].register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    runs.update(forward=0, node=0, recompute=0)
    _step(model)
    # The hooked layer's recompute goes through its forward (so its node runs in full): the other layers' do not.
    assert runs == {"forward": LAYERS + 1, "node": LAYERS + 1, "recompute": LAYERS - 1}
    with_offers = list(calls)
    calls.clear()
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(fused_layer, "listening", lambda: False)
    _step(model)
    # Where transformers' wrapper puts the hook (outside the checkpoint from 5.23 on, inside it before, so the
    # recompute runs it again) is unchanged by the rerun.
    assert with_offers == calls and calls


def test_a_trainable_base_weight_is_recomputed_through_the_forward_and_gets_its_gradient(folder, runs):
    expected_model = _model(folder, False)
    model = _model(folder, True)
    for each in (expected_model, model):
        each.base_model.model.model.layers[2].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    expected = _step(expected_model)
    runs.update(forward=0, node=0, recompute=0)
    actual = _step(model)
    name = "base_model.model.model.layers.2.self_attn.q_proj.base_layer.weight"
    assert name in actual[1]
    assert_same_loss_and_grads(expected, actual, bound=1e-5)
    # Layer 2 forward-ran fused without a graph; its recompute needs the weight's gradient, so it took the forward
    # again (and the per-module path, whose attention plan it decided once more).
    assert runs == {"forward": LAYERS + 1, "node": LAYERS, "recompute": LAYERS - 1}


def test_an_offer_is_kept_only_when_it_is_the_one_offer_for_the_calls_input():
    x, other = torch.ones(2), torch.zeros(2)

    def double(tensor):
        return tensor * 2

    rerun.offer(x, double)  # nobody listens: nothing is kept anywhere
    assert not rerun.listening()
    slot = rerun.listen()
    assert rerun.listening()
    inner = rerun.listen()
    rerun.offer(x, double)
    rerun.stop(inner)
    # Without a second callable, the backward's recompute takes the full rerun.
    assert inner.taken_for(x) == (double, double) and inner.taken_for(other) is None
    assert slot.taken_for(x) is None  # the offer went to the innermost listener only
    rerun.offer(x, double)
    rerun.offer(x, double)
    rerun.stop(slot)
    assert slot.taken_for(x) is None and slot.source is None  # two offers: neither kept, no tensor held
    assert not rerun.listening()


def test_listeners_are_per_thread():
    slot = rerun.listen()
    heard = []
    thread = threading.Thread(target=lambda: heard.append(rerun.listening()) or rerun.offer(torch.ones(1), abs))
    thread.start()
    thread.join()
    rerun.stop(slot)
    assert heard == [False] and slot.offers == 0


def test_an_offer_keeps_its_rerun_for_the_backward_apart():
    x = torch.ones(2)
    slot = rerun.listen()
    rerun.offer(x, abs, torch.neg)
    rerun.stop(slot)
    assert slot.taken_for(x) == (abs, torch.neg)
    slot = rerun.listen()
    rerun.offer(x, abs, torch.neg)
    rerun.offer(x, abs, torch.neg)
    rerun.stop(slot)
    assert slot.taken_for(x) is None and slot.for_backward is None


class _DownGemms(OperatorMode):
    """Counts the GEMMs that read one of the given weights (by storage: a transpose is a view of it)."""

    GEMMS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}

    def __init__(self, weights):
        super().__init__()
        self.storages = {weight.untyped_storage().data_ptr() for weight in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.GEMMS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.count += any(t.untyped_storage().data_ptr() in self.storages for t in tensors)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("mode", "per_step"),
    # A forward GEMM and a dX GEMM per layer in every mode: the backward's recompute does not run down's GEMM. Only
    # "sqrt"'s replay of each segment's first layer does, since its output is the next layer's input.
    [(False, 2 * LAYERS), (True, 2 * LAYERS), ("offload", 2 * LAYERS), ("sqrt", 2 * LAYERS + LAYERS // 2)],
    ids=["none", "recompute", "offload", "sqrt"],
)
@pytest.mark.parametrize("down_lora", [True, False], ids=["down-lora", "down-frozen"])
def test_the_backward_recompute_skips_the_down_projection_gemm(folder, mode, per_step, down_lora):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"] + (["down_proj"] if down_lora else [])
    models = []
    for each in (False, mode):
        model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128)
        model = FastModel.get_peft_model(
            model, r=8, lora_alpha=16, target_modules=targets, use_gradient_checkpointing=each
        )
        randomize_lora_b(model)
        models.append(model)
    expected = _step(models[0])
    downs = [layer.mlp.down_proj for layer in models[1].base_model.model.model.layers]
    weights = [getattr(down, "base_layer", down).weight for down in downs]
    with _DownGemms(weights) as counted:
        actual = _step(models[1])
    assert counted.count == per_step
    assert_same_loss_and_grads(expected, actual)


def test_the_backward_only_node_refuses_to_run_without_grad():
    from fastft.kernels.lora_decoder_layer import lora_decoder_layer

    x = torch.ones(1, 2, 4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="output=False called with grad mode off"):
        lora_decoder_layer(None, x, x, x, None, x, x, output=False)
