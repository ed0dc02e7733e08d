"""The decoder layer as one autograd node (fastft.patches.fused_layer, fastft.kernels.lora_decoder_layer): the same
loss and gradients as the per-module fused path, bit for bit where nothing else differs, on every path it takes and
every reason it steps aside."""

from __future__ import annotations

import pytest
import torch
from conftest import CastCounter
from parity import count, graph_nodes, lora_model, make_batch, save_family

from fastft.patches.fused_layer import upstream_layer_forward

FUSED_NODE = "LoRADecoderLayerFunctionBackward"
FAMILIES = ["llama", "mistral", "qwen2"]


def _layers(model) -> list[torch.nn.Module]:
    return list(model.get_base_model().model.layers)


def _per_module(model) -> None:
    """Put the layers back on upstream's class: each part still runs its own fused patch, as before this node."""
    for layer in _layers(model):
        layer.__class__ = type(layer).__mro__[1]


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    nodes = graph_nodes(loss)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads, nodes


def _assert_same(fused, separate, batch, tolerance: float = 0.0) -> list[str]:
    loss, grads, nodes = _loss_and_grads(fused, batch)
    expected_loss, expected, _ = _loss_and_grads(separate, batch)
    assert torch.allclose(loss, expected_loss, rtol=tolerance, atol=tolerance), (loss, expected_loss)
    assert grads.keys() == expected.keys() and any("lora_A" in name for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], rtol=tolerance, atol=tolerance), name
    return nodes


@pytest.fixture(scope="module", params=FAMILIES)
def family_folder(request, tmp_path_factory, smol_tokenizer) -> str:
    return save_family(tmp_path_factory.mktemp(request.param), request.param, smol_tokenizer)


@pytest.mark.parametrize("checkpointing", [False, True, "offload", "sqrt"])
def test_one_node_per_layer_and_the_per_module_numbers(family_folder, checkpointing):
    fused = lora_model(family_folder, patch=True, checkpointing=checkpointing)
    separate = lora_model(family_folder, patch=True, checkpointing=checkpointing)
    _per_module(separate)
    batch = make_batch(fused.config.vocab_size, batch=2, seq=9, pad=3)
    nodes = _assert_same(fused, separate, batch)
    layers = len(_layers(fused))
    if checkpointing is False:
        assert count(nodes, FUSED_NODE) == layers
        assert count(nodes, "LoRAMLPFunction") == 0 and count(nodes, "RMSNormFunction") == 1  # the final norm


def test_kernel_paths_agree_with_the_separate_nodes(kernel_path, smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    fused = lora_model(folder, patch=True, checkpointing=False)
    separate = lora_model(folder, patch=True, checkpointing=False)
    _per_module(separate)
    batch = make_batch(fused.config.vocab_size, batch=2, seq=7, pad=2)
    nodes = _assert_same(fused, separate, batch, tolerance=1e-6)
    assert count(nodes, FUSED_NODE) == len(_layers(fused))


def test_under_autocast_it_casts_where_each_node_would(smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    fused = lora_model(folder, patch=True, checkpointing=False)
    separate = lora_model(folder, patch=True, checkpointing=False)
    _per_module(separate)
    batch = make_batch(fused.config.vocab_size, batch=2, seq=7, pad=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nodes = _assert_same(fused, separate, batch)
    assert count(nodes, FUSED_NODE) == len(_layers(fused))


def test_trainable_norms_get_their_gradients(smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    models = [lora_model(folder, patch=True, checkpointing=False) for _ in range(2)]
    _per_module(models[1])
    for model in models:
        for layer in _layers(model):
            layer.input_layernorm.weight.requires_grad_(True)
            layer.post_attention_layernorm.weight.requires_grad_(True)
    batch = make_batch(models[0].config.vocab_size, batch=1, seq=6)
    _, grads, nodes = _loss_and_grads(models[0], batch)
    assert count(nodes, FUSED_NODE) == len(_layers(models[0]))
    assert any("input_layernorm" in name for name in grads) and any("post_attention" in name for name in grads)
    _assert_same(*models, batch)


def test_it_steps_aside_for_a_hook_a_cache_and_attention_weights(smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    model = lora_model(folder, patch=True, checkpointing=False)
    batch = make_batch(model.config.vocab_size, batch=1, seq=5)
    layer = _layers(model)[0]
    seen = []
    handle = layer.mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    _, _, nodes = _loss_and_grads(model, batch)
    handle.remove()
    # The hooked layer runs part by part (its hook fires); the others stay one node each.
    assert seen == [torch.Size([1, 5, model.config.hidden_size])]
    assert count(nodes, FUSED_NODE) == len(_layers(model)) - 1
    _, _, nodes = _loss_and_grads(model, batch)
    assert count(nodes, FUSED_NODE) == len(_layers(model))

    # Generation with a KV cache, and attention weights asked for: upstream's forward, the same tokens as stock.
    stock = lora_model(folder, patch=False, checkpointing=False)
    with torch.no_grad():
        ids = batch["input_ids"]
        tokens = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, use_cache=True)
        expected = stock.generate(input_ids=ids, max_new_tokens=4, do_sample=False, use_cache=True)
    assert torch.equal(tokens, expected)


def test_the_class_changes_forward_only_and_keeps_transformers_checkpoint_wrapper(smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    model = lora_model(folder, patch=True, checkpointing=False)
    layer = _layers(model)[0]
    fast, upstream = type(layer), type(layer).__mro__[1]
    assert fast.__name__ == "FastLlamaDecoderLayer" and upstream.__name__ == "LlamaDecoderLayer"
    assert set(vars(fast)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__", "__static_attributes__"} == {
        "forward"
    }
    assert upstream_layer_forward(fast) is not upstream_layer_forward(upstream)
    # transformers >= 5.23 checkpoints in a wrapper around every subclass's forward: fastft's checkpointer still
    # receives the call (use_gradient_checkpointing=True ran above through the same class).
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_layer_casts_its_fp32_adapters_with_one_copy_each_way(smol_tokenizer, tmp_path, checkpointing):
    # peft keeps A and B in fp32 over a bf16 base: the layer's node casts all 14 with one _foreach_copy_ (one launch on
    # CUDA) in every forward, recompute's included, and its 14 LoRA gradients back with one in backward; the numbers
    # are the per-module nodes' (which cast group by group), bit for bit.
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    fused = lora_model(folder, patch=True, checkpointing=checkpointing, dtype=torch.bfloat16)
    separate = lora_model(folder, patch=True, checkpointing=checkpointing, dtype=torch.bfloat16)
    _per_module(separate)
    adapters = [p for name, p in fused.named_parameters() if "lora_" in name]
    assert adapters and {p.dtype for p in adapters} == {torch.float32}
    assert fused.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    hidden, ranks = fused.config.hidden_size, {p.shape[0] for name, p in fused.named_parameters() if "lora_A" in name}
    shapes = {tuple(p.shape) for p in adapters} | {(n * rank, hidden) for rank in ranks for n in (2, 3)}
    batch = make_batch(fused.config.vocab_size, batch=2, seq=7, pad=2)
    layers = len(_layers(fused))

    fused.zero_grad(set_to_none=True)
    with CastCounter(shapes) as forward:
        loss = fused(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    with CastCounter(shapes) as backward:
        loss.backward()
    assert (forward.batched, forward.single) == (layers, 0)
    # Recompute runs each layer's forward again inside backward: one more copy for it.
    assert (backward.batched, backward.single) == ((2 if checkpointing else 1) * layers, 0)
    # No gradient is left referenced by the node, which would make AccumulateGrad copy it into a new one.
    assert backward.copies == 0
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters)
    _assert_same(fused, separate, batch)


def _first_layer_input(model, batch) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """The first decoder layer, with the input and keyword arguments the model hands it."""
    layer = _layers(model)[0]
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, dict(kwargs)))

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    args, kwargs = seen["call"]
    hidden = args[0] if args else kwargs.pop("hidden_states")
    return layer, hidden, kwargs


def test_an_input_changed_in_place_after_the_forward_is_caught_by_the_backward(smol_tokenizer, tmp_path):
    """The node's math runs below autograd's dispatch keys, where a view gets a version counter of its own: the saved
    view of the layer's input is made above them, so autograd still sees the input change under it."""
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    model = lora_model(folder, patch=True, checkpointing=False)
    layer, hidden, kwargs = _first_layer_input(model, make_batch(model.config.vocab_size, batch=2, seq=9, pad=3))
    x = hidden.detach().clone().requires_grad_() * 1.0
    out = layer(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    assert type(out.grad_fn).__name__ == FUSED_NODE
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified inplace"):
        out.sum().backward()


def test_the_node_s_math_runs_below_autograd_and_its_attention_above(smol_tokenizer, tmp_path, monkeypatch):
    """Its kernels' ops skip the autograd and ADInplaceOrView keys (host time per op); the attention, which autograd
    differentiates, does not."""
    import fastft.kernels.lora_decoder_layer as node

    folder = save_family(tmp_path, "llama", smol_tokenizer)
    model = lora_model(folder, patch=True, checkpointing=False)
    batch = make_batch(model.config.vocab_size, batch=2, seq=9, pad=3)
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
    seen: dict[str, list[bool]] = {}

    def watch(name, function):
        def run(*args, **kwargs):
            seen.setdefault(name, []).append(excluded(torch._C.DispatchKey.ADInplaceOrView))
            return function(*args, **kwargs)

        monkeypatch.setattr(node, name, run)

    for name in ("rms_norm_forward", "qkv_rope_forward", "mlp_forward", "mlp_backward", "qkv_rope_backward"):
        watch(name, getattr(node, name))
    watch("attention_backward", node.attention_backward)
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    layers = len(_layers(model))
    assert seen.pop("attention_backward") == [False] * layers
    assert seen.keys() == {"rms_norm_forward", "qkv_rope_forward", "mlp_forward", "mlp_backward", "qkv_rope_backward"}
    assert all(all(flags) and len(flags) >= layers for flags in seen.values()), seen
    assert len(seen["rms_norm_forward"]) == 2 * layers


def test_a_second_backward_through_a_layer_says_what_happened(smol_tokenizer, tmp_path):
    folder = save_family(tmp_path, "llama", smol_tokenizer)
    model = lora_model(folder, patch=True, checkpointing=False)
    layer, hidden, kwargs = _first_layer_input(model, make_batch(model.config.vocab_size, batch=2, seq=9, pad=3))
    out = layer(hidden.detach().requires_grad_(), **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="fastft lora_decoder_layer: this layer's backward already ran"):
        out.sum().backward()
