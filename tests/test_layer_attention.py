"""The fused layer's attention graph walked back by hand (fastft.kernels.layer_attention): the gradients autograd's
engine gives, bit for bit, without an engine pass, for the graphs transformers' sdpa path builds (with a padding mask
it repeats k and v per query head first)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fastft.kernels import layer_attention


class _Attention(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _graph(mask: torch.Tensor | None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8))
    leaves = tuple(torch.randn(shape, generator=generator).requires_grad_() for shape in shapes)
    module = _Attention()

    def attend(query, key, value):
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.3)
        return out.reshape(2, 6, -1).contiguous()

    attention, graph = layer_attention.run_attention(attend, *leaves, record=True)
    grad = torch.randn(graph[-1].shape, generator=generator)
    return graph, grad


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_walked_by_hand_with_the_engines_bits(monkeypatch, masked):
    mask = None
    if masked:
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
        mask[0, :, :, :2] = False  # row 0 left-padded
        mask[0, :, :2, 0] = True  # padded rows still attend somewhere
    graph, grad = _graph(mask)
    *leaves, out = graph
    expected = torch.autograd.grad(out, leaves, grad, retain_graph=True)

    def no_engine(*args, **kwargs):
        raise AssertionError("attention_backward ran an autograd engine pass")

    monkeypatch.setattr(torch.autograd, "grad", no_engine)
    found = layer_attention.attention_backward(out, tuple(leaves), grad)
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))


def test_any_other_graph_goes_through_the_engine():
    # A leaf used twice below the attention node: not a chain with branches to distinct leaves; the engine sums it.
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 2, 4, 8, generator=generator).requires_grad_() for _ in range(3))
    with torch.enable_grad():
        out = torch.nn.functional.scaled_dot_product_attention(query, key * 2 + query, value)
    grad = torch.randn(out.shape, generator=generator)
    expected = torch.autograd.grad(out, (query, key, value), grad, retain_graph=True)
    found = layer_attention.attention_backward(out, (query, key, value), grad)
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))
