"""fastft.bench.measure: saved-for-backward bytes, FLOP counts, matmul rate and peak RSS."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastft.bench.measure import (
    SavedTensorBytes,
    attention_flops,
    count_flops,
    lora_step_flops,
    matmul_rate,
    peak_rss_bytes,
    reset_peak_rss,
    resident_bytes,
)


def test_saved_bytes_count_each_storage_once_and_leave_out_the_excluded():
    weight = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    with SavedTensorBytes(exclude=[weight]) as saved:
        hidden = x @ weight  # saves x and weight
        out = hidden.exp()  # saves its output
        # Two views of one buffer, each saved by a multiplication.
        total = (out[:4] * out[:4]).sum() + (out[4:] * 2).sum()
    assert saved.excluded == 1
    assert saved.bytes == x.nbytes + out.nbytes
    assert saved.raw_bytes > saved.bytes  # the views of `out` add their own nbytes to the raw sum
    assert saved.tensors >= 3 and len(saved.storages) == 2
    total.backward()  # the hooks unpack to the same tensors


def test_flops_of_a_linear_layer_forward_and_backward():
    layer = torch.nn.Linear(48, 24, bias=False)
    x = torch.randn(16, 48, requires_grad=True)
    flops = count_flops(lambda: layer(x).sum().backward())
    # Forward, input gradient and weight gradient: three matmuls of 16 x 48 x 24.
    assert flops == 3 * 2 * 16 * 48 * 24


def _torch_211_formulas(monkeypatch):
    """Make torch's own sdpa formulas fail on GQA shapes as torch 2.11's did on the H100 (32 query heads, 8 kv)."""
    from torch.utils import flop_counter

    def asserting(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    # The module-level table FlopCounterMode copies at construction (its name has changed across torch versions).
    registry = getattr(flop_counter, "flop_registry", None) or flop_counter._FLOP_REGISTRY
    patched = [packet for packet in registry if "scaled_dot_product" in str(packet)]
    assert patched, "no sdpa formula found in torch's flop registry"
    for packet in patched:
        monkeypatch.setitem(registry, packet, asserting)


def test_attention_flops_use_the_query_heads_under_gqa():
    # 2 sequences, 8 query heads over 2 kv heads, 16 queries over 12 keys, head dim 4 (q.k) and 6 (values).
    query, key, value = (2, 8, 16, 4), (2, 2, 12, 4), (2, 2, 12, 6)
    scores, weighted = 2 * 2 * 8 * 16 * 12 * 4, 2 * 2 * 8 * 16 * 12 * 6
    assert attention_flops(query, key, value) == scores + weighted
    # Backward: recomputed scores, grads of the query and key (q.k width), grads of the scores and values.
    assert attention_flops(query, key, value, backward=True) == 3 * scores + 2 * weighted
    with pytest.raises(ValueError, match=r"8 query heads are not a multiple of 3 key/value heads"):
        attention_flops(query, (2, 3, 12, 4), (2, 3, 12, 6))
    with pytest.raises(ValueError, match="disagree"):
        attention_flops(query, (2, 2, 12, 5), value)


@pytest.mark.parametrize(
    "op", ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"], ids=["efficient", "flash"]
)
def test_the_gpu_sdpa_kernels_are_counted_on_gqa_shapes_where_torchs_formula_asserts(monkeypatch, op):
    # The CUDA kernels' meta implementations take GQA shapes, so the operator the H100 ran is counted here as is.
    _torch_211_formulas(monkeypatch)
    query = torch.empty(1, 32, 64, 16, device="meta")
    key = value = torch.empty(1, 8, 64, 16, device="meta")
    arguments = (query, key, value, None, True) if "efficient" in op else (query, key, value)
    flops = count_flops(lambda: getattr(torch.ops.aten, op)(*arguments))
    assert flops == 2 * (2 * 1 * 32 * 64 * 64 * 16)


def test_gqa_sdpa_forward_and_backward_on_the_cpu_are_counted(monkeypatch):
    _torch_211_formulas(monkeypatch)
    query = torch.randn(2, 4, 16, 8, requires_grad=True)
    key = torch.randn(2, 2, 16, 8, requires_grad=True)
    value = torch.randn(2, 2, 16, 8, requires_grad=True)
    flops = count_flops(
        lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True).sum().backward()
    )
    one = 2 * 2 * 4 * 16 * 16 * 8  # one [16 x 8] @ [8 x 16] per query head and sequence
    assert flops == 2 * one + 5 * one


def _tiny_gqa_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    # GQA, and hidden (64) != heads x head_dim (4 x 24 = 96).
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=128,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return config, get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=targets))


def test_a_tiny_gqa_llama_step_counts_as_by_hand_and_as_from_its_config(monkeypatch):
    _torch_211_formulas(monkeypatch)
    config, model = _tiny_gqa_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    counted = count_flops(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward())
    # By hand: 32 tokens; q 64->96, k and v 64->48, o 96->64, gate and up 64->96, down 96->64; LoRA r=4; vocab 128.
    tokens, flop = 32, lambda fan_in, fan_out: 2 * 32 * fan_in * fan_out
    base = flop(64, 96) + 2 * flop(64, 48) + flop(96, 64) + 2 * flop(64, 96) + flop(96, 64)
    lora_a = 3 * flop(64, 4) + flop(96, 4) + 2 * flop(64, 4) + flop(96, 4)
    lora_b = flop(4, 96) + 2 * flop(4, 48) + flop(4, 64) + 2 * flop(4, 96) + flop(4, 64)
    first_attention_inputs = flop(64, 96) + 2 * flop(64, 48)  # no input gradient into the embedding
    first_lora_a_inputs = 3 * flop(64, 4)
    layers = 2 * (2 * base + 3 * lora_a + 3 * lora_b) - first_attention_inputs - first_lora_a_inputs
    attention = 2 * (2 + 5) * (2 * 2 * 4 * 16 * 16 * 24)  # two layers, forward 2 and backward 5 matmuls a head
    head = 2 * flop(64, 128)  # forward and its input gradient
    assert tokens == 32 and counted == layers + attention + head
    assert lora_step_flops(config, batch=2, seq=16, rank=4) == counted
    assert lora_step_flops(config.to_dict(), batch=2, seq=16, rank=4) == counted


def test_lora_step_flops_names_what_the_config_lacks():
    with pytest.raises(ValueError, match=r"no \['intermediate_size'\]"):
        lora_step_flops({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4}, 1, 4, 2)
    config = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"unknown projections \['qkv'\]"):
        lora_step_flops(config | {"vocab_size": 4}, 1, 4, 2, targets=["qkv"])


def test_matmul_rate_is_a_positive_rate():
    rate = matmul_rate(torch.device("cpu"), torch.float32, size=256, repeats=3)
    assert math.isfinite(rate) and rate > 1e7  # any CPU of this century does more than 10 MFLOP/s


def test_peak_rss_sees_an_allocation_above_the_old_peak():
    # The high-water mark only moves once the resident size passes it, so allocate past it (on a 24 GiB machine the
    # test process's peak is a few GiB at most).
    before, resident = peak_rss_bytes(), resident_bytes()
    size = before - resident + (256 << 20)
    block = torch.ones(size // 4)  # written, so every page is resident
    assert resident + 0.95 * block.nbytes <= peak_rss_bytes() <= resident + 2 * block.nbytes


def test_resetting_the_peak_reports_whether_it_took():
    reset = reset_peak_rss()
    # Some kernels (this sandbox's among them) accept the write and keep the old peak: the result must say so.
    assert reset == (peak_rss_bytes() <= resident_bytes() + (8 << 20))
