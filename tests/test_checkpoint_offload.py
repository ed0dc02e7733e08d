"""fastft's offloaded checkpointer (use_gradient_checkpointing="offload"): gradients, saved bytes, buffers, hooks.

On CPU the layer inputs stay in place (plain recompute). ``park_cpu_tensors`` makes the engine copy them into its
host buffers as it does on CUDA, so the buffer, prefetch and retained-graph bookkeeping runs here too; only the
streams, events and page-locking are left to the GPU.
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from conftest import randomize_lora_b, relative_error, save_tiny_llama, tiny_llama_config
from transformers import LlamaForCausalLM

from fastft import FastModel, patch_report
from fastft.bench.measure import SavedTensorBytes
from fastft.bench.operators import OperatorMode
from fastft.checkpointing.modes import PATCH_NAME, LayerCheckpoint, engine_of
from fastft.checkpointing.offload import OffloadEngine

LAYERS = 4


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smol_tokenizer):
    """A four-layer tiny Llama on disk (the 4-bit tests load it quantised)."""
    return save_tiny_llama(tmp_path_factory, smol_tokenizer, "tiny-llama-4-layers", num_hidden_layers=LAYERS)


def _model(folder, mode, dropout=0.0, park=False, load_in_4bit=False):
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=dropout, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    if park:
        engine_of(model).park_cpu_tensors = True
    return model


def _ids(vocab: int, length: int = 23, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _step(model, batches, seed: int = 42):
    """Forward and backward over each batch (gradient accumulation); loss values and LoRA gradients."""
    torch.manual_seed(seed)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    return losses, _grads(model)


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _assert_same(expected, actual, bound: float = 1e-6) -> None:
    for loss, other in zip(expected[0], actual[0], strict=True):
        assert relative_error(other, loss) <= bound
    assert expected[1].keys() == actual[1].keys()
    for name, grad in expected[1].items():
        assert grad.norm() > 0, name
        assert relative_error(actual[1][name], grad) <= bound, name


def _layer_backward_nodes(loss: torch.Tensor) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "_CheckpointedLayerBackward"
        stack.extend(child for child, _ in node.next_functions)
    return count


@pytest.mark.lane
@pytest.mark.parametrize("park", [False, True], ids=["recompute-on-cpu", "parked"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_offload_gradients_equal_no_checkpointing(tiny_folder, dropout, park):
    expected = _step(_model(tiny_folder, False, dropout), [_ids(49152)])
    model = _model(tiny_folder, "offload", dropout, park)
    assert all(type(layer._gradient_checkpointing_func) is LayerCheckpoint for layer in model.model.model.layers)
    actual = _step(model, [_ids(49152)])
    _assert_same(expected, actual)
    if dropout:
        # The recompute must replay the forward's masks: without the RNG restored the gradients differ.
        other_seed = _step(_model(tiny_folder, False, dropout), [_ids(49152)], seed=43)
        assert relative_error(other_seed[1][next(iter(expected[1]))], next(iter(expected[1].values()))) > 1e-3


@pytest.mark.lane
def test_offload_with_a_4bit_base(tiny_folder):
    expected = _step(_model(tiny_folder, False, load_in_4bit=True), [_ids(49152)])
    model = _model(tiny_folder, "offload", park=True, load_in_4bit=True)
    ids = _ids(49152)
    torch.manual_seed(42)
    loss = model(input_ids=ids, labels=ids).loss
    assert _layer_backward_nodes(loss) == LAYERS
    loss.backward()
    _assert_same(expected, ([loss.detach()], _grads(model)))


def test_the_fused_kernels_run_in_the_forward_and_in_the_recompute(tiny_folder, fused_calls):
    calls = fused_calls
    model = _model(tiny_folder, "offload", park=True)
    ids = _ids(49152)
    loss = model(input_ids=ids, labels=ids).loss
    # A Llama layer whose parts are all fused runs as one node, in the forward and again in the recompute.
    assert calls == ["LoRADecoderLayer"] * LAYERS
    loss.backward()
    assert calls == ["LoRADecoderLayer"] * (2 * LAYERS)


@pytest.mark.lane
def test_gradient_accumulation_reuses_the_host_buffers(tiny_folder):
    # Two micro-batches of different lengths, twice: the second step allocates no new buffer.
    batches = [_ids(49152, 23, seed=1), _ids(49152, 17, seed=2)]
    expected = _step(_model(tiny_folder, False), batches)
    model = _model(tiny_folder, "offload", park=True)
    actual = _step(model, batches)
    _assert_same(expected, actual)
    engine = engine_of(model)
    # One buffer per parked layer (the last layer keeps its input): the second micro-batch reused the first's.
    assert engine.allocations() == LAYERS - 1
    assert engine.held_bytes() >= (LAYERS - 1) * 2 * 23 * 64 * 4
    model.zero_grad()
    _step(model, batches)
    assert engine.allocations() == LAYERS - 1
    FastModel.for_inference(model)
    assert engine.held_bytes() == 0
    FastModel.for_training(model)
    model.zero_grad()
    _assert_same(expected, _step(model, batches))


def test_two_forwards_before_one_backward_keep_their_own_inputs(tiny_folder):
    # The second forward must not overwrite the buffers the first one's backward still needs.
    first, second = _ids(49152, 19, seed=1), _ids(49152, 19, seed=2)
    results = []
    for mode, park in ((False, False), ("offload", True)):
        model = _model(tiny_folder, mode, park=park)
        loss = model(input_ids=first, labels=first).loss + 0.5 * model(input_ids=second, labels=second).loss
        loss.backward()
        results.append(([loss.detach()], _grads(model)))
    _assert_same(*results)


def test_a_retained_graph_can_run_backward_twice(tiny_folder):
    model = _model(tiny_folder, "offload", park=True)
    ids = _ids(49152)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    once = _grads(model)
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert relative_error(parameter.grad, 2 * once[name]) <= 1e-6, name


def test_autocast_is_replayed_in_the_recompute(tiny_folder):
    results = []
    for mode in (False, "offload"):
        model = _model(tiny_folder, mode)
        ids = _ids(49152)
        torch.manual_seed(42)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append(([loss.detach()], _grads(model)))
    # Identical bf16 arithmetic on both sides; a recompute in fp32 would be off by about 1e-2.
    _assert_same(*results, bound=1e-6)


@pytest.mark.lane
def test_offload_saves_one_hidden_state_per_layer(smol_tokenizer):
    """Acceptance: bytes saved for backward over one forward of a multi-layer model, with and without offload."""
    layers, batch, length = 6, 2, 64
    config = tiny_llama_config(smol_tokenizer, num_hidden_layers=layers, vocab_size=512, tie_word_embeddings=False)
    ids = torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(0))
    saved, marks = {}, []
    for mode in (False, "offload"):
        torch.manual_seed(0)
        model = FastModel.get_peft_model(LlamaForCausalLM(config), r=8, use_gradient_checkpointing=mode)
        counter = SavedTensorBytes(model.parameters())
        if mode is False:
            # One decoder layer's own activations: what the count grew by between its pre-hook and its hook.
            layer = model.model.model.layers[2]
            layer.register_forward_pre_hook(lambda *_, counter=counter: marks.append(counter.bytes))
            layer.register_forward_hook(lambda *_, counter=counter: marks.append(counter.bytes))
        with counter:
            loss = model(input_ids=ids, labels=ids).loss
        saved[mode] = counter.bytes
        loss.backward()
    layer_bytes = marks[1] - marks[0]
    hidden_bytes = batch * length * config.hidden_size * 4
    print(
        f"\nsaved for backward, {layers} layers, {batch}x{length} tokens: no checkpointing {saved[False]:,} B, "
        f"offload {saved['offload']:,} B (one layer's activations {layer_bytes:,} B, one hidden state "
        f"{hidden_bytes:,} B)"
    )
    assert saved["offload"] <= layer_bytes + layers * hidden_bytes
    assert saved["offload"] <= 0.25 * saved[False]


def test_patch_report_and_the_stock_fallback(tiny_folder, caplog):
    model = _model(tiny_folder, "offload")
    row = {row["name"]: row for row in patch_report(model)}[PATCH_NAME]
    assert row["status"] == "applied" and row["modules"] == LAYERS
    # Without fastft's patches "offload" still checkpoints (transformers' recompute) and says why, once.
    stock, _ = FastModel.from_pretrained(str(tiny_folder), max_seq_length=128, patch=False)
    with caplog.at_level(logging.WARNING, logger="fastft.checkpoint"):
        stock = FastModel.get_peft_model(stock, r=8, use_gradient_checkpointing="offload")
        stock.get_base_model().gradient_checkpointing_enable()
    randomize_lora_b(stock)
    assert sum("runs transformers' recompute checkpointing" in r.message for r in caplog.records) == 1
    assert "disabled" in caplog.text
    assert not any(type(layer._gradient_checkpointing_func) is LayerCheckpoint for layer in stock.model.model.layers)
    expected = _step(_model(tiny_folder, False), [_ids(49152)])
    # Stock modules against fastft's patched ones: equal within the fp32 rounding of the fused path.
    _assert_same(expected, _step(stock, [_ids(49152)]), bound=1e-4)


def test_a_copied_model_has_its_own_engine(tiny_folder):
    model = _model(tiny_folder, "offload", park=True)
    twin = copy.deepcopy(model)
    assert engine_of(twin) is not engine_of(model)
    assert all(layer._gradient_checkpointing_func.layer is layer for layer in twin.model.model.layers)
    _assert_same(_step(model, [_ids(49152)]), _step(twin, [_ids(49152)]))


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([1.5, -2.0, 0.5]))

    def forward(self, x, shift=None, pair=None):
        out = x * self.weight + shift
        return out * pair[0] + pair[1], None


def test_keyword_tensors_that_need_grad_get_it():
    layer = _Scale()
    checkpointed = LayerCheckpoint(layer, 0, OffloadEngine(park_cpu_tensors=True), keep_on_device=False)
    x, shift = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    pair = (torch.randn(4, 3, requires_grad=True), torch.randn(3))
    grads = []
    for run in (layer, functools.partial(checkpointed, layer)):
        out, nothing = run(x, shift=shift, pair=pair)
        assert nothing is None
        grads.append(torch.autograd.grad(out.square().sum(), [x, shift, pair[0], layer.weight]))
    for expected, actual in zip(*grads, strict=True):
        assert torch.allclose(actual, expected, rtol=1e-6, atol=0)


def test_a_layer_returning_something_else_is_refused_by_name():
    layer = torch.nn.Linear(3, 3)
    checkpointed = LayerCheckpoint(layer, 2, OffloadEngine(), keep_on_device=False)
    with pytest.raises(TypeError, match=r"Linear 2 returned a dict.*use_gradient_checkpointing=False.*patch=False"):
        checkpointed(lambda x: {"out": layer(x)}, torch.randn(2, 3))


@pytest.mark.lane
def test_installed_transformers_has_a_checkpoint_record_whose_signature_matches():
    from fastft.registry import records, select

    record, reason = select(PATCH_NAME, records()[PATCH_NAME])
    assert record is not None, reason


def test_sft_trainer_with_offload_ends_where_no_checkpointing_does(tiny_folder, tmp_path):
    from datasets import Dataset
    from trl import SFTTrainer

    from fastft.training.trl import sft_config

    texts = ["The quick brown fox jumps over the lazy dog. " * (1 + i % 3) for i in range(8)]
    weights = []
    for mode, park in ((False, False), ("offload", True)):
        model, tokenizer = FastModel.from_pretrained(str(tiny_folder), max_seq_length=128)
        model = FastModel.get_peft_model(model, r=8, lora_dropout=0.1, random_state=5, use_gradient_checkpointing=mode)
        engine_of(model).park_cpu_tensors = park
        args = sft_config(
            str(tmp_path / str(mode)),
            torch.float32,
            128,
            max_steps=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            save_strategy="no",
            seed=5,
        )
        dataset = Dataset.from_dict({"text": texts})
        SFTTrainer(model=model, processing_class=tokenizer, train_dataset=dataset, args=args).train()
        layers = model.base_model.model.model.layers
        installed = [type(getattr(layer, "_gradient_checkpointing_func", None)) is LayerCheckpoint for layer in layers]
        assert all(installed) is bool(mode)
        weights.append({name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad})
    for name, weight in weights[0].items():
        assert relative_error(weights[1][name], weight) <= 1e-6, name


def test_the_host_buffer_pool_reuses_the_smallest_fit_and_grows_by_replacing():
    from fastft.checkpointing.offload import HostBufferPool

    pool = HostBufferPool(pin_memory=False)
    small, large = pool.take(0, 10), pool.take(0, 3 << 20)
    assert small.numel() == 1 << 20 and large.numel() == 3 << 20  # whole MiB
    pool.give(0, large)
    pool.give(0, small)
    assert pool.take(0, 100).data_ptr() == small.data_ptr()  # the smallest that fits
    assert pool.take(1, 100).data_ptr() not in (small.data_ptr(), large.data_ptr())  # slots do not share
    pool.give(0, small)
    bigger = pool.take(0, 5 << 20)  # nothing fits: the largest too-small buffer makes way for a bigger one
    assert pool.allocations == 4 and pool.held_bytes() == small.numel()
    pool.close()
    pool.give(0, bigger)
    assert pool.held_bytes() == 0


class _Stream:
    """A stand-in CUDA stream that writes what is queued on it into a shared trace."""

    def __init__(self, name: str, trace: list) -> None:
        self.name, self.trace = name, trace

    def wait_stream(self, other: _Stream) -> None:
        self.trace.append(("wait", self.name, other.name))

    def record_event(self) -> int:
        event = len(self.trace)
        self.trace.append(("record", self.name, event))
        return event

    def wait_event(self, event: int) -> None:
        self.trace.append(("wait event", self.name, event))


class _RecordedStreams:
    """CUDA's stream operations replayed on CPU: copies run at once, every call lands in ``trace``."""

    def __init__(self) -> None:
        self.trace: list = []
        self.compute = _Stream("compute", self.trace)

    def new_stream(self, device):
        return _Stream("side", self.trace)

    def current(self, device):
        return self.compute

    def copy(self, destination, source, stream, label):
        destination.copy_(source)
        self.trace.append(("copy", stream.name, label))

    def keep_until_done(self, tensor, stream):
        self.trace.append(("keep", stream.name))

    def empty(self, shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _copies(trace: list) -> dict[str, int]:
    """How many copies of each label the side stream ran."""
    return {label: sum(item == ("copy", "side", label) for item in trace) for label in _labels()}


def _labels() -> list[str]:
    return [f"{way} {slot}" for slot in range(LAYERS) for way in ("to host", "to device")]


@pytest.mark.lane
def test_the_copies_are_ordered_against_the_compute_stream(tiny_folder):
    """The CUDA protocol, replayed with recorded stand-in streams: each parked input crosses to the host once and
    back once per step; each copy waits for what it reads, is waited for before its result is read, and the backward's
    copy of a layer's input is queued before the layer above recomputes.
    """
    expected = _step(_model(tiny_folder, False), [_ids(49152)])
    model = _model(tiny_folder, "offload", park=True)
    streams = _RecordedStreams()
    engine_of(model).cpu_stream_ops = streams
    for index, layer in enumerate(model.model.model.layers):
        # On the first submodule: transformers 5.23 checkpoints the layer's forward, inside the layer's own hooks.
        layer.input_layernorm.register_forward_pre_hook(
            lambda *_, index=index: streams.trace.append(
                ("layer", index, "recompute" if torch.is_grad_enabled() else "forward")
            )
        )
    for step in range(2):  # the second step reuses the first one's host buffers
        streams.trace.clear()
        model.zero_grad(set_to_none=True)
        _assert_same(expected, _step(model, [_ids(49152)]))
        trace = streams.trace
        # Exactly one copy each way per parked layer input; the last layer keeps its input on the device.
        once = {label: int(not label.endswith(f" {LAYERS - 1}")) for label in _labels()}
        assert _copies(trace) == once, f"step {step}"
        assert sum(item[0] == "copy" for item in trace) == 2 * (LAYERS - 1)
        at = trace.index
        for slot in range(LAYERS - 1):
            to_host = at(("copy", "side", f"to host {slot}"))
            # Forward: the side stream first waits for the compute stream (which produced the input), the copy is
            # queued before the layer's own kernels so it overlaps them, and the input's memory is held until the
            # copy ran.
            assert trace[to_host - 1] == ("wait", "side", "compute") and trace[to_host + 1] == ("keep", "side")
            assert to_host < at(("layer", slot, "forward"))
            assert slot == 0 or at(("layer", slot - 1, "forward")) < to_host
            # Backward: the copy back waits for the compute stream (its destination was allocated there), records
            # an event, and the compute stream waits for that event before the layer recomputes from the copy.
            to_device = at(("copy", "side", f"to device {slot}"))
            assert trace[to_device - 1] == ("wait", "side", "compute")
            assert trace[to_device + 1] == ("record", "side", to_device + 1)
            waited = at(("wait event", "compute", to_device + 1))
            recompute = at(("layer", slot, "recompute"))
            assert to_device < waited < recompute
            # Prefetch: queued during the backward of the layer above, before that layer recomputes, and not waited
            # for until it has.
            above = at(("layer", slot + 1, "recompute"))
            assert at(("layer", LAYERS - 1, "forward")) < to_device < above < waited
    assert engine_of(model).allocations() == LAYERS - 1


class _CopyOps(OperatorMode):
    """Counts the aten ops that copy tensor data."""

    KINDS = ("aten.copy_.default", "aten._to_copy.default", "aten.clone.default")

    def __init__(self) -> None:
        super().__init__()
        self.counts = dict.fromkeys(self.KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.counts:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_offload_adds_exactly_the_two_copies_per_parked_input_to_a_step(tiny_folder):
    """Every aten copy of a step, counted: offloading adds one copy to host and one back per parked layer input to
    what the same checkpointer does when it keeps the inputs on the device (``True``), and nothing else (no RNG state
    round trip, no second copy of a pinned buffer)."""
    counts = {}
    for mode in (True, "offload"):
        model = _model(tiny_folder, mode, park=mode == "offload")
        engine_of(model).cpu_stream_ops = _RecordedStreams() if mode == "offload" else None
        _step(model, [_ids(49152)])  # the first step allocates the host buffers
        model.zero_grad(set_to_none=True)
        with _CopyOps() as copies:
            _step(model, [_ids(49152)])
        counts[mode] = copies.counts
    added = {kind: counts["offload"][kind] - counts[True][kind] for kind in _CopyOps.KINDS}
    assert added == {"aten.copy_.default": 2 * (LAYERS - 1), "aten._to_copy.default": 0, "aten.clone.default": 0}
