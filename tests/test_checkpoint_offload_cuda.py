"""The CUDA half of the offloaded checkpointer: pinned buffers, side-stream copies, prefetch, and the memory it frees.

These need a GPU (the copies, streams and events exist only there); the CPU half, with the same bookkeeping driven
through ``park_cpu_tensors``, is tests/test_checkpoint_offload.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b, relative_error
from transformers import LlamaConfig, LlamaForCausalLM

from fastft import FastModel
from fastft.checkpointing.modes import engine_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA copy path needs a GPU"),
]


def _model(mode, layers=4, hidden=256, dropout=0.0, dtype=torch.float32):
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=dropout, use_gradient_checkpointing=mode)
    randomize_lora_b(model)
    return model


def _forward(model, length=128, seed=42):
    ids = torch.randint(0, 1024, (2, length), generator=torch.Generator().manual_seed(3)).cuda()
    torch.manual_seed(seed)
    return model(input_ids=ids, labels=ids).loss


def _step(model, length=128, seed=42):
    loss = _forward(model, length, seed)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_offload_gradients_equal_no_checkpointing(dropout):
    loss, grads = _step(_model(False, dropout=dropout))
    model = _model("offload", dropout=dropout)
    for _ in range(2):  # the second step reuses the pinned buffers of the first
        model.zero_grad()
        offload_loss, offload_grads = _step(model)
        assert relative_error(offload_loss, loss) <= 1e-6
        for name, grad in grads.items():
            assert relative_error(offload_grads[name], grad) <= 1e-5, name
    engine = engine_of(model)
    assert engine.allocations() == 3, "one pinned buffer per parked layer, reused by the second step"
    pools = list(engine._pools.values())
    assert pools and all(buffer.is_pinned() for pool in pools for buffers in pool._free.values() for buffer in buffers)


def test_cuda_offload_peak_memory_is_below_plain_checkpointing():
    # True and "offload" run the same checkpointer (fastft's, since True moved onto it after the H100 run of 36b0bdd,
    # where True was transformers' own: a different recompute with its own per-layer peak, and offload came out only
    # 21 MiB lower), so the two differ in where the layer inputs wait and nothing else.
    layers, length = 8, 2048
    hidden_state = 2 * length * 1024 * 2  # one layer input: 2 rows of 2048 tokens, hidden 1024, bf16
    held, peaks = {}, {}
    for mode in (True, "offload"):
        model = _model(mode, layers=layers, hidden=1024, dtype=torch.bfloat16)
        _step(model, length=length)  # warm-up: allocator pools, pinned buffers
        model.zero_grad(set_to_none=True)
        layer_grads = sum(
            p.numel() * p.element_size() for p in model.get_base_model().model.layers[0].parameters() if p.requires_grad
        )
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = _forward(model, length=length)
        held[mode] = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model, loss
        torch.cuda.empty_cache()
    print(
        f"\nin hidden states of {hidden_state:,} B: held after the forward {held[True] / hidden_state:.2f} (recompute) "
        f"{held['offload'] / hidden_state:.2f} (offload); peak {peaks[True] / hidden_state:.2f} / "
        f"{peaks['offload'] / hidden_state:.2f}; LoRA gradients of a layer {layer_grads:,} B"
    )
    # The caching allocator hands out a cached block whole when at most 1 MiB of it would be left over, so a tensor
    # can count up to 1 MiB more in one run than in the other; two hidden states (16 MiB) cover that.
    slack = 2 * hidden_state
    # Between forward and backward offload holds one layer input (the last layer's) instead of all eight: anything
    # less saved means a parked input stayed on the device.
    assert held[True] - held["offload"] >= (layers - 1) * hidden_state - slack
    # Recompute peaks in the last layer's backward, with all eight inputs resident; offload holds two inputs at most
    # (a layer's own and the one prefetched), but meanwhile each finished layer has added its LoRA gradients, so its
    # peak comes in the second layer's backward, six layers' gradients later: (layers - 2) inputs fewer, less six
    # layers' LoRA gradients (r=8: 131,072 parameters a layer, at most 3 MiB for six, against 48 MiB of inputs).
    assert peaks[True] - peaks["offload"] >= (layers - 2) * (hidden_state - layer_grads) - slack


@pytest.mark.parametrize("mode", [True, "sqrt-offload"])
def test_cuda_recompute_and_sqrt_offload_gradients_equal_no_checkpointing(mode):
    loss, grads = _step(_model(False, layers=9, dropout=0.1))
    model = _model(mode, layers=9, dropout=0.1)
    for _ in range(2):
        model.zero_grad()
        other_loss, other_grads = _step(model)
        assert relative_error(other_loss, loss) <= 1e-6
        for name, grad in grads.items():
            assert relative_error(other_grads[name], grad) <= 1e-5, name
    # Nine layers, segments of three: the kept inputs of the first two segments are parked, nothing else.
    assert engine_of(model).allocations() == (2 if mode == "sqrt-offload" else 0)


def _pinned_copies(model) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    _step(model)  # warm-up: pinned buffers, streams
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model)
    counts = {event.key: event.count for event in prof.key_averages()}
    return counts.get("Memcpy DtoH (Device -> Pinned)", 0), counts.get("Memcpy HtoD (Pinned -> Device)", 0)


def test_cuda_offload_moves_each_parked_input_once_each_way():
    """The device copies of a step, from the profiler: against the same checkpointer keeping its inputs on the device,
    "offload" adds one copy to pinned memory and one back per layer but the last, "sqrt-offload" one each per
    parked segment input."""
    kept = _pinned_copies(_model(True, layers=9))
    for mode, parked in (("offload", 8), ("sqrt-offload", 2)):
        to_host, to_device = _pinned_copies(_model(mode, layers=9))
        assert (to_host - kept[0], to_device - kept[1]) == (parked, parked), mode
