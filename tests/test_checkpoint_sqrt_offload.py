"""use_gradient_checkpointing="sqrt-offload": "sqrt" with the kept segment inputs parked in host memory.

Nine layers make segments of three (0-2, 3-5, 6-8). The inputs of layers 0 and 3 are parked; layer 6's (the last
segment's, whose backward comes first) stays on the device; the other six are replayed, never kept nor copied. On
CPU nothing is parked unless ``park_cpu_tensors`` asks for it, and the recorded stand-in streams of
tests/test_checkpoint_offload.py replay the CUDA copy protocol.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import assert_same_loss_and_grads, randomize_lora_b, relative_error, save_tiny_llama
from test_checkpoint_offload import _RecordedStreams

from fastft import FastModel
from fastft.bench.measure import SavedTensorBytes
from fastft.checkpointing.modes import LayerCheckpoint, engine_of, resolve_mode

LAYERS = 9
BATCH, LENGTH = 2, 23
PARKED = (0, 3)


@pytest.fixture(scope="module")
def nine_layers(tmp_path_factory, smol_tokenizer):
    """A nine-layer tiny Llama on disk (the 4-bit case loads it quantised)."""
    return save_tiny_llama(tmp_path_factory, smol_tokenizer, "tiny-llama-9-layers-parked", num_hidden_layers=LAYERS)


def _model(folder, mode, dropout=0.0, park=True, load_in_4bit=False):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=dropout, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    if park and engine_of(model) is not None:
        engine_of(model).park_cpu_tensors = True
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 49152, (BATCH, LENGTH), generator=torch.Generator().manual_seed(3))


def _step(model, retain: bool = False, before_backward=None):
    """One forward (bytes saved for backward counted) and backward; the loss, LoRA gradients and saved bytes."""
    torch.manual_seed(42)
    ids = _ids()
    with SavedTensorBytes([*model.parameters(), *model.buffers()]) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    if before_backward is not None:
        before_backward()
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, saved.bytes


def _copies(trace: list, way: str) -> list[int]:
    return [int(item[2].split()[-1]) for item in trace if item[0] == "copy" and item[2].startswith(way)]


def test_the_mode_name():
    assert resolve_mode("sqrt-offload") == resolve_mode("SQRT-OFFLOAD") == "sqrt-offload"
    with pytest.raises(ValueError, match="'sqrt-offload'"):
        resolve_mode("sqrt_offload")


@pytest.mark.lane
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_sqrt_offload_gradients_equal_no_checkpointing_and_only_kept_inputs_cross(nine_layers, dropout):
    expected = _step(_model(nine_layers, False, dropout))
    model = _model(nine_layers, "sqrt-offload", dropout)
    checkpoints = [layer._gradient_checkpointing_func for layer in model.model.model.layers]
    assert all(type(c) is LayerCheckpoint and c.segment == 3 for c in checkpoints)
    streams = _RecordedStreams()
    engine_of(model).cpu_stream_ops = streams
    for step in range(2):  # the second step reuses the host buffers
        streams.trace.clear()
        model.zero_grad(set_to_none=True)
        assert_same_loss_and_grads(expected, _step(model))
        # Each kept input of the two first segments crosses once each way; nothing replayed is ever copied.
        assert _copies(streams.trace, "to host") == list(PARKED), f"step {step}"
        assert sorted(_copies(streams.trace, "to device")) == list(PARKED), f"step {step}"
    assert engine_of(model).allocations() == len(PARKED)


def test_a_kept_input_comes_back_before_its_segment_replays(nine_layers):
    """The copy back of a segment's kept input is queued in the backward of the layer above the segment (before it
    recomputes), and the compute stream waits for it before the segment's layers are replayed from it."""
    model = _model(nine_layers, "sqrt-offload")
    streams = _RecordedStreams()
    engine_of(model).cpu_stream_ops = streams
    phase = {"backward": False}
    for index, layer in enumerate(model.model.model.layers):

        def note(*_, index=index):
            kind = "recompute" if torch.is_grad_enabled() else ("replay" if phase["backward"] else "forward")
            streams.trace.append(("layer", index, kind))

        layer.input_layernorm.register_forward_pre_hook(note)
    _step(model, before_backward=lambda: phase.update(backward=True))
    trace = streams.trace
    at = trace.index
    for first in PARKED:
        to_device = at(("copy", "side", f"to device {first}"))
        waited = at(("wait event", "compute", to_device + 1))
        above = first + 3  # the first layer of the segment above
        assert to_device < at(("layer", above, "recompute")) < waited < at(("layer", first, "replay"))
        # Borrowed for the replay and taken again by the layer's own backward: no second copy.
        assert to_device < at(("layer", first, "recompute"))
    assert [item[1] for item in trace if item[:1] == ("layer",) and item[2] == "replay"] == [6, 7, 3, 4, 0, 1]


def test_which_inputs_outlive_the_forward(nine_layers):
    """Parked inputs leave the device (only the host copy remains), replayed ones are not kept at all, and the last
    segment's kept input stays."""
    model = _model(nine_layers, "sqrt-offload")
    inputs: list[weakref.ref] = []
    for layer in model.model.model.layers:
        layer.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert [reference() is not None for reference in inputs] == [False] * 6 + [True, False, False]
    loss.backward()


def test_sqrt_offload_saves_two_hidden_states_fewer_than_sqrt(nine_layers):
    sqrt = _step(_model(nine_layers, "sqrt"))
    model = _model(nine_layers, "sqrt-offload")
    parked = _step(model)
    assert_same_loss_and_grads(sqrt, parked)
    hidden = BATCH * LENGTH * model.config.hidden_size * 4
    print(f"\nsaved for backward on the device, {LAYERS} layers: sqrt {sqrt[2]:,} B, sqrt-offload {parked[2]:,} B")
    assert sqrt[2] - parked[2] == len(PARKED) * hidden
    assert engine_of(model).held_bytes() >= len(PARKED) * hidden


def test_on_cpu_without_parking_it_is_sqrt(nine_layers):
    model = _model(nine_layers, "sqrt-offload", park=False)
    assert_same_loss_and_grads(_step(_model(nine_layers, "sqrt")), _step(model))
    assert engine_of(model).allocations() == 0


def test_a_second_backward_through_a_retained_graph_brings_the_kept_inputs_back_again(nine_layers):
    once = _step(_model(nine_layers, False))
    model = _model(nine_layers, "sqrt-offload")
    streams = _RecordedStreams()
    engine_of(model).cpu_stream_ops = streams
    twice = _step(model, retain=True)
    for name, grad in once[1].items():
        assert relative_error(twice[1][name], 2 * grad) <= 1e-6, name
    assert _copies(streams.trace, "to host") == list(PARKED)
    assert sorted(_copies(streams.trace, "to device")) == sorted(PARKED * 2)


@pytest.mark.lane
def test_sqrt_offload_with_a_4bit_base(nine_layers):
    expected = _step(_model(nine_layers, False, load_in_4bit=True))
    assert_same_loss_and_grads(expected, _step(_model(nine_layers, "sqrt-offload", load_in_4bit=True)))
