"""use_gradient_checkpointing="sqrt": one layer input kept per segment, the others replayed in backward.

Nine layers make segments of three (layers 0-2, 3-5, 6-8): three inputs kept instead of nine, and six replayed.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import assert_same_loss_and_grads, randomize_lora_b, relative_error, save_tiny_llama

from fastft import FastModel
from fastft.bench.measure import SavedTensorBytes
from fastft.checkpointing.modes import LayerCheckpoint, resolve_mode
from fastft.checkpointing.replay import Segment, segment_length

LAYERS = 9
BATCH, LENGTH = 2, 23


@pytest.fixture(scope="module")
def nine_layers(tmp_path_factory, smol_tokenizer):
    """A nine-layer tiny Llama on disk (the 4-bit case loads it quantised)."""
    return save_tiny_llama(tmp_path_factory, smol_tokenizer, "tiny-llama-9-layers", num_hidden_layers=LAYERS)


def _model(folder, mode, dropout=0.0, load_in_4bit=False):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=dropout, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    return model


def _ids(vocab: int = 49152) -> torch.Tensor:
    return torch.randint(3, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(3))


def _step(model, retain: bool = False):
    """One forward (bytes saved for backward counted) and backward; the loss, LoRA gradients and saved bytes."""
    torch.manual_seed(42)
    ids = _ids()
    with SavedTensorBytes([*model.parameters(), *model.buffers()]) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, saved.bytes


def _count_layer_runs(model) -> list[int]:
    runs = [0] * LAYERS
    for index, layer in enumerate(model.model.model.layers):
        layer.mlp.register_forward_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    return runs


def test_segment_lengths_and_the_mode_name():
    assert [segment_length(n) for n in (1, 2, 4, 9, 10, 30, 32)] == [1, 2, 2, 3, 4, 6, 6]
    assert resolve_mode("sqrt") == resolve_mode("SQRT") == "sqrt"
    with pytest.raises(ValueError, match="'sqrt'"):
        resolve_mode("sqrt2")


@pytest.mark.lane
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_sqrt_gradients_equal_no_checkpointing(nine_layers, dropout):
    expected = _step(_model(nine_layers, False, dropout))
    model = _model(nine_layers, "sqrt", dropout)
    checkpoints = [layer._gradient_checkpointing_func for layer in model.model.model.layers]
    assert all(type(c) is LayerCheckpoint and c.segment == 3 for c in checkpoints)
    runs = _count_layer_runs(model)
    # The replay runs each layer's forward again under that layer's own RNG state: with dropout, any other draw
    # would change the replayed inputs and so every gradient below the segment's first layer.
    assert_same_loss_and_grads(expected, _step(model))
    # Forward and recompute for every layer; the replay runs the first two layers of each segment once more.
    assert runs == [3, 3, 2] * 3


def test_sqrt_keeps_one_input_per_segment(nine_layers):
    recompute = _step(_model(nine_layers, True))
    model = _model(nine_layers, "sqrt")
    sqrt = _step(model)
    assert_same_loss_and_grads(recompute, sqrt)
    hidden = BATCH * LENGTH * model.config.hidden_size * 4
    print(f"\nsaved for backward, {LAYERS} layers: recompute {recompute[2]:,} B, sqrt {sqrt[2]:,} B")
    # Six of the nine layer inputs are replayed instead of kept; everything else saved is the same.
    assert recompute[2] - sqrt[2] == (LAYERS - 3) * hidden


def test_the_inputs_it_replays_are_freed_after_the_forward(nine_layers):
    """Not only left out of what autograd saves: nothing else (a hook, a closure, the chain) keeps them alive."""
    model = _model(nine_layers, "sqrt")
    inputs: list[weakref.ref] = []
    for layer in model.model.model.layers:
        layer.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert [reference() is not None for reference in inputs] == [True, False, False] * 3
    loss.backward()


def test_one_replay_per_segment_and_the_cache_is_drained(nine_layers, monkeypatch):
    made: list[Segment] = []
    original = Segment.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Segment, "__init__", recording)
    model = _model(nine_layers, "sqrt")
    _step(model)
    assert [len(segment.calls) for segment in made] == [3, 3, 3]
    # Each segment ran its first two layers once (not once per unpacked input) and handed every cached input out.
    assert [segment.replays for segment in made] == [2, 2, 2]
    assert all(not segment._cache for segment in made)


def test_a_second_backward_through_a_retained_graph_replays_again(nine_layers):
    once = _step(_model(nine_layers, False))
    twice = _step(_model(nine_layers, "sqrt"), retain=True)
    for name, grad in once[1].items():
        assert relative_error(twice[1][name], 2 * grad) <= 1e-6, name


def test_a_layer_input_changed_between_layers_starts_a_segment(nine_layers):
    """An input that is not the layer before's output (here a hook rescales it) is kept, never replayed wrongly."""

    def rescale(module, args, kwargs):
        return (args[0] * 1.5, *args[1:]), kwargs

    models = {mode: _model(nine_layers, mode) for mode in (False, "sqrt")}
    for model in models.values():
        model.model.model.layers[4].register_forward_pre_hook(rescale, with_kwargs=True)
    runs = _count_layer_runs(models["sqrt"])
    assert_same_loss_and_grads(_step(models[False]), _step(models["sqrt"]))
    # Segments 0-2, 3 (cut short by the rescaled input of layer 4), 4-6, 7-8.
    assert runs == [3, 3, 2, 2, 3, 3, 2, 3, 2]


@pytest.mark.lane
def test_sqrt_with_a_4bit_base(nine_layers):
    expected = _step(_model(nine_layers, False, load_in_4bit=True))
    assert_same_loss_and_grads(expected, _step(_model(nine_layers, "sqrt", load_in_4bit=True)))
