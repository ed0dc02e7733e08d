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
from fastft.checkpoint import engine_of

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


def _step(model, length=128, seed=42):
    ids = torch.randint(0, 1024, (2, length), generator=torch.Generator().manual_seed(3)).cuda()
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
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
    peaks = {}
    for mode in (True, "offload"):
        model = _model(mode, layers=8, hidden=1024, dtype=torch.bfloat16)
        _step(model, length=2048)  # warm-up: allocator pools, pinned buffers
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, length=2048)
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    hidden_state = 2 * 2048 * 1024 * 2
    print(f"\npeak above resident: recompute {peaks[True]:,} B, offload {peaks['offload']:,} B")
    # Seven of eight layer inputs leave the GPU; prefetch brings back at most one ahead.
    assert peaks["offload"] <= peaks[True] - 4 * hidden_state


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
