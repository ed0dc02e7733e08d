"""torch.compile sees through fastft: a patched decoder layer of every family traces as one graph (fastft's kernels are
custom ops), regional compilation shares one compiled layer among all layers, and compiled training gives the eager
loss and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, relative_error
from parity import FAMILIES, GRAD_TOLERANCE, LOSS_TOLERANCE, lora_model, loss_and_grads, make_batch, save_family
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fastft import FastModel
from fastft.kernels.traced_reference import opaque_reference
from fastft.loading.compile import compile_layers, compiled_layers, decoder_layers, uncompile_layers

pytestmark = pytest.mark.lane


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smol_tokenizer) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp(f"compile-{request.param}")
    return request.param, save_family(folder, request.param, smol_tokenizer)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer_call(model, batch) -> tuple[torch.nn.Module, tuple, dict]:
    """Decoder layer 0 and the arguments the model hands it on this batch."""
    layer = decoder_layers(model)[0]
    seen = {}

    def capture(module, args, kwargs):
        seen.setdefault("call", (args, dict(kwargs)))

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        handle.remove()
    args, kwargs = seen["call"]
    return layer, args, kwargs


@pytest.mark.parametrize("patch", lane_cases([True, False], ids=["fastft", "stock"]))
def test_a_patched_decoder_layer_has_no_graph_break(family, patch):
    name, folder = family
    model = lora_model(folder, patch=patch, checkpointing=False)
    batch = make_batch(model.config.vocab_size, batch=2, seq=9, pad=2)
    layer, args, kwargs = _layer_call(model, batch)
    hidden = args[0].detach().requires_grad_(True) if args else kwargs["hidden_states"]
    call_args = (hidden, *args[1:]) if args else ()
    explanation = torch._dynamo.explain(layer)(*call_args, **kwargs)
    assert explanation.graph_break_count == 0, (name, [str(reason) for reason in explanation.break_reasons])
    assert explanation.graph_count == 1
    if patch:
        # This suite runs the kernels' torch reference: traced, they are aten ops the compiler fuses
        # (fastft.kernels.traced_reference); asked to stay opaque, each is its custom op, as on the Triton path.
        assert not [op for op in _targets(explanation) if "fastft." in op], f"{name}: {sorted(_targets(explanation))}"
        torch._dynamo.reset()
        with opaque_reference():
            opaque = torch._dynamo.explain(layer)(*call_args, **kwargs)
        assert opaque.graph_break_count == 0, (name, [str(reason) for reason in opaque.break_reasons])
        assert any("fastft." in op for op in _targets(opaque)), f"{name}: no fastft custom op: {_targets(opaque)}"


def _targets(explanation) -> set[str]:
    return {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload"], ids=["recompute", "no-ckpt", "offload"]))
def test_regional_compile_matches_eager(family, checkpointing):
    """Loss and every LoRA gradient of the compiled model equal eager's within fp32 rounding; the decoder layers share
    one compiled graph per kind of layer (Gemma 3's sliding and full layers are two kinds)."""
    name, folder = family
    eager = lora_model(folder, patch=True, checkpointing=checkpointing)
    compiled = lora_model(folder, patch=True, checkpointing=checkpointing)
    counter = CompileCounterWithBackend("aot_eager")
    assert compile_layers(compiled, backend=counter) == compiled.config.num_hidden_layers
    batch = make_batch(eager.config.vocab_size, batch=2, seq=11, pad=3)
    loss, grads = loss_and_grads(eager, batch)
    for _ in range(2):  # the second step runs the graphs the first one compiled
        compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
        assert relative_error(compiled_loss, loss) <= LOSS_TOLERANCE, (compiled_loss.item(), loss.item())
        assert compiled_grads.keys() == grads.keys()
        for key, grad in compiled_grads.items():
            assert relative_error(grad, grads[key]) <= GRAD_TOLERANCE, key
    # One graph per kind of layer, one more for the first layer, whose input (the frozen embeddings' output) needs no
    # gradient, and under checkpointing the forward without grad beside the recompute with it; never one per layer.
    layer_kinds = len(set(getattr(compiled.config, "layer_types", None) or ["full"]))
    bound = (layer_kinds + 1) * (2 if checkpointing else 1)
    assert 1 <= counter.frame_count <= bound, f"{name}: {counter.frame_count} compiled frames"


@pytest.mark.parametrize(
    ("checkpointing", "graphs"), lane_cases([(False, 2), ("offload", 4)], ids=["no-ckpt", "offload"])
)
def test_regional_compile_shares_one_graph_among_layers(tmp_path_factory, smol_tokenizer, checkpointing, graphs):
    """Eight layers, and as many graphs as two layers need: the first layer's (its input needs no gradient) and the one
    the other seven share; under checkpointing each twice (the forward without grad, the recompute with it)."""
    from conftest import save_tiny_llama

    folder = save_tiny_llama(tmp_path_factory, smol_tokenizer, name="deep-llama", num_hidden_layers=8)
    model = lora_model(str(folder), patch=True, checkpointing=checkpointing)
    counter = CompileCounterWithBackend("aot_eager")
    compile_layers(model, backend=counter)
    batch = make_batch(model.config.vocab_size, batch=1, seq=7)
    for _ in range(2):
        loss_and_grads(model, batch)
    assert counter.frame_count == graphs


def test_compile_switch_of_get_peft_model(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False, compile=True)
    layers = model.config.num_hidden_layers
    assert compiled_layers(model) == layers
    ids = torch.arange(1, 9).unsqueeze(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    # The compiled layers save and reload as plain transformers / peft objects.
    layer = decoder_layers(model)[0]
    assert type(layer).__name__ == "FastLlamaDecoderLayer" and isinstance(layer, LlamaDecoderLayer)
    assert uncompile_layers(model) == layers and compiled_layers(model) == 0


def test_compile_switch_refuses_a_non_bool(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    with pytest.raises(ValueError, match="compile must be True"):
        FastModel.get_peft_model(model, r=8, compile="yes")


def test_a_compiled_layer_call_runs_no_module_attribute_lookup(tiny_llama_dir):
    """Once compiled, a layer's call is its guards and its graph: no guard may go through ``Module.__getattr__``
    (a missing name raises there, and the guards replay that on every call; ``hasattr(module, "_hf_hook")`` and peft's
    ``get_base_layer`` used to, 84 times a step on four layers)."""
    import sys

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False, compile=True)
    inside = {id(module) for layer in decoder_layers(model) for module in layer.modules()}
    ids = torch.arange(1, 9).unsqueeze(0)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    code, looked_up = torch.nn.Module.__getattr__.__code__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code and id(frame.f_locals["self"]) in inside:
            looked_up.append((type(frame.f_locals["self"]).__name__, frame.f_locals["name"]))

    sys.setprofile(profile)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        sys.setprofile(None)
    assert looked_up == []


def test_a_compiled_layer_reads_each_projection_by_one_path(tiny_llama_dir):
    """Reading one object through ``module.__dict__[...]`` and as an attribute makes the compiled layer keep a Python
    guard that the two are the same object, run on every call (``_is_lora_layer`` used to: 14 of them a layer)."""
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    layer, args, kwargs = _layer_call(model, make_batch(model.config.vocab_size, batch=1, seq=8, pad=0))
    explanation = torch._dynamo.explain(layer)(args[0].detach().requires_grad_(True), *args[1:], **kwargs)
    codes = [code for guard in explanation.out_guards for code in guard.code_list or ()]
    assert codes, "no guard code to inspect"
    assert not [code for code in codes if "__dict__[" in code and " is " in code]


def test_a_function_wrapper_built_while_tracing_is_the_function_s_own_apply(monkeypatch):
    # A compiled layer builds its plans (LoRAGroups among them) inside the traced region. torch 2.15's dynamo cannot
    # evaluate direct_apply's super() lookup there (InternalTorchDynamoError: AutogradFunctionVariable() is not a
    # constant), so while compiling it hands back Function.apply, which traced code never calls (it takes the custom
    # ops) and dynamo would trace itself.
    from fastft.kernels import custom_ops
    from fastft.kernels.rms_norm import RMSNormFunction

    eager = custom_ops.direct_apply(RMSNormFunction)
    assert eager != RMSNormFunction.apply
    monkeypatch.setattr(custom_ops, "compiling", lambda: True)
    assert custom_ops.direct_apply(RMSNormFunction) == RMSNormFunction.apply


def _step_loss(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


@pytest.mark.parametrize("mode", [None, "default"], ids=["filtered", "mode-keeps-every-guard"])
def test_compiled_layers_skip_only_the_guards_on_fastft_s_own_code(tiny_llama_dir, monkeypatch, mode):
    """Replacing one of fastft's functions does not recompile a compiled layer (its identity guards are left out,
    which is what made them cost nothing per call), unless ``mode=`` keeps every guard; a fastft switch read as a value
    still recompiles, and the adapters' state still reaches the compiled layer."""
    from fastft.kernels import traced_reference

    model = lora_model(str(tiny_llama_dir), patch=True, checkpointing=False)
    counter = CompileCounterWithBackend("aot_eager")
    compile_layers(model, backend=counter, **({} if mode is None else {"mode": mode}))
    batch = make_batch(model.config.vocab_size, batch=1, seq=8)
    for _ in range(2):
        _step_loss(model, batch).backward()
    frames = counter.frame_count
    original = traced_reference._as
    monkeypatch.setattr(traced_reference, "_as", lambda tensor, dtype: original(tensor, dtype))
    adapted = _step_loss(model, batch)
    assert counter.frame_count == (frames if mode is None else frames + 2)
    frames = counter.frame_count
    with opaque_reference():
        assert torch.equal(_step_loss(model, batch), adapted)
    assert counter.frame_count > frames
    with model.disable_adapter():
        disabled = _step_loss(model, batch)
    uncompile_layers(model)
    with model.disable_adapter():
        assert torch.equal(_step_loss(model, batch), disabled)
    assert relative_error(_step_loss(model, batch), adapted) <= LOSS_TOLERANCE
    assert not torch.allclose(disabled, adapted)


def test_the_guard_filter_drops_identity_guards_of_fastft_globals_alone():
    from types import SimpleNamespace

    from fastft.loading.compile import skip_fastft_code_guards

    def entry(name, kind):
        return SimpleNamespace(name=name, guard_type=kind)

    entries = [
        entry("G['__import_fastft_dot_kernels_dot_traced_reference']._as", "CLOSURE_MATCH"),
        entry("G['__import_fastft_dot_patches_dot_decoder'].LoRAGroup", "CLASS_MATCH"),
        entry("G['__import_fastft_dot_kernels_dot_custom_ops'].torch", "MODULE_MATCH"),
        entry("G['__import_fastft_dot_kernels_dot_traced_reference']._opaque['depth']", "CONSTANT_MATCH"),
        entry("G['__import_fastft_dot_kernels_dot_lora_group'].GROUPS", "SEQUENCE_LENGTH"),
        entry("G['__import_fastfte_dot_x'].f", "CLOSURE_MATCH"),
        entry("G['__import_transformers_dot_activations'].nn", "MODULE_MATCH"),
        entry("L['self']._modules['mlp'].forward", "CLOSURE_MATCH"),
        SimpleNamespace(),
    ]
    assert skip_fastft_code_guards(entries) == [False, False, False, True, True, True, True, True, True]
