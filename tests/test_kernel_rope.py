"""RoPE kernel: Triton and reference paths against transformers' apply_rotary_pos_emb in float64."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from fastft.kernels import dispatch
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.rope import RoPEFunction, apply_rope, rope_reference


def _tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos / sin (halves repeated) for the given positions, computed in float64, rounded to dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype).to(KERNEL_DEVICE), angles.sin().to(dtype).to(KERNEL_DEVICE)


def _sources(layout: str, batch, heads, kv_heads, seq, head_dim, dtype, gen) -> list[torch.Tensor]:
    """The leaf tensors that q and k of a layout are views of."""
    if layout == "contiguous":
        shapes = [(batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim)]
    elif layout == "transposed":
        shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim)]
    else:
        shapes = [(batch, seq, (heads + 2 * kv_heads) * head_dim)]
    return [random_tensor(shape, dtype, gen).requires_grad_() for shape in shapes]


def _qk(layout: str, sources: list[torch.Tensor], heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [batch, heads, seq, hd] and k [batch, kv_heads, seq, hd] in the layout, as views of the sources."""
    if layout == "contiguous":
        return sources[0], sources[1]
    if layout == "transposed":  # what transformers' attention hands over: .view(b, s, h, hd).transpose(1, 2)
        return sources[0].transpose(1, 2), sources[1].transpose(1, 2)
    # "qkv": slices of one fused q | k | v projection output, so the batch and seq strides span all three.
    (qkv,) = sources
    batch, seq, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    q = qkv[..., : heads * head_dim].view(batch, seq, heads, head_dim)
    k = qkv[..., heads * head_dim : (heads + kv_heads) * head_dim].view(batch, seq, kv_heads, head_dim)
    return q.transpose(1, 2), k.transpose(1, 2)


def _views(layout: str, batch, heads, kv_heads, seq, head_dim, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    return _qk(layout, _sources(layout, batch, heads, kv_heads, seq, head_dim, dtype, gen), heads, kv_heads)


def _oracle(q, k, cos, sin, grad_q, grad_k):
    """transformers' apply_rotary_pos_emb in float64 on the same (rounded) inputs, with its autograd gradients."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    out_q, out_k = apply_rotary_pos_emb(q64, k64, cos.double(), sin.double())
    dq, dk = torch.autograd.grad((out_q, out_k), (q64, k64), (grad_q.double(), grad_k.double()))
    return out_q, out_k, dq, dk


def _check_against_oracle(got, expected, dtype):
    for name, actual, wanted in zip(("q", "k", "dq", "dk"), got, expected, strict=True):
        assert actual.shape == wanted.shape, name
        assert actual.dtype == dtype, name
        error = relative_error(actual, wanted)
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


SHAPES = [
    # batch, heads, kv_heads, seq, head_dim, cos batch, layout
    pytest.param(2, 9, 3, 67, 64, 1, "transposed", id="gqa9x3-hd64-b2-s67-cos1-transposed"),
    pytest.param(1, 9, 3, 67, 48, 1, "contiguous", id="gqa9x3-hd48-b1-s67-contiguous"),
    pytest.param(2, 9, 3, 1, 48, 2, "qkv", id="gqa9x3-hd48-b2-s1-cos2-qkv"),
    pytest.param(2, 4, 4, 1, 64, 2, "transposed", id="mha4-hd64-b2-s1-cos2-transposed"),
    pytest.param(2, 4, 4, 67, 48, 2, "qkv", id="mha4-hd48-b2-s67-cos2-qkv"),
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "seq", "head_dim", "cos_batch", "layout"), SHAPES)
def test_matches_float64(kernel_path, gen, dtype, batch, heads, kv_heads, seq, head_dim, cos_batch, layout):
    q, k = _views(layout, batch, heads, kv_heads, seq, head_dim, dtype, gen)
    assert layout == "contiguous" or seq == 1 or not q.is_contiguous()  # size-1 dims do not count
    # Random positions far from 0, so no row is the identity rotation.
    cos, sin = _tables(torch.randint(0, 4096, (cos_batch, seq), generator=gen), head_dim, dtype)
    grad_q = random_tensor(q.shape, dtype, gen)
    grad_k = random_tensor(k.shape, dtype, gen)

    out_q, out_k = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q, grad_k))

    _check_against_oracle((out_q, out_k, dq, dk), _oracle(q, k, cos, sin, grad_q, grad_k), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", ["packed", "broadcast"])
def test_position_ids_index_the_tables(kernel_path, gen, dtype, rows):
    batch, heads, kv_heads, seq, head_dim = 2, 9, 3, 67, 64
    if rows == "packed":  # several documents per row, positions restarting at each boundary
        lengths = [[10, 15, 30, 12], [40, 27]]
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    else:  # one row of positions shared by the batch, offset as in a continued generation
        position_ids = torch.arange(5, 5 + seq)[None]
    position_ids = position_ids.to(KERNEL_DEVICE)
    # fp32 tables with fp16 activations too: the kernel reads either dtype and computes in fp32.
    cos_table, sin_table = _tables(torch.arange(80), head_dim, torch.float32)
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, dtype, gen)
    grad_q = random_tensor(q.shape, dtype, gen)
    grad_k = random_tensor(k.shape, dtype, gen)

    out_q, out_k = apply_rope(q, k, cos_table, sin_table, position_ids=position_ids)
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q, grad_k))

    gathered_cos, gathered_sin = cos_table[position_ids], sin_table[position_ids]
    _check_against_oracle((out_q, out_k, dq, dk), _oracle(q, k, gathered_cos, gathered_sin, grad_q, grad_k), dtype)
    # The same rotation as the reference fed the gathered rows.
    ref_q, ref_k = rope_reference(q.detach(), k.detach(), gathered_cos, gathered_sin)
    assert relative_error(out_q, ref_q) < TOLERANCE[dtype]
    assert relative_error(out_k, ref_k) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_gradient_is_the_exact_transpose_for_any_tables(kernel_path, gen, dtype):
    # Random cos / sin whose halves differ: not a rotation any more, so "negate sin" alone would be wrong; the
    # backward must still be the transpose of the forward map.
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 7, 48
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, dtype, gen)
    cos = random_tensor((1, seq, head_dim), dtype, gen)
    sin = random_tensor((1, seq, head_dim), dtype, gen)
    grad_q = random_tensor(q.shape, dtype, gen)
    grad_k = random_tensor(k.shape, dtype, gen)

    out_q, out_k = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q, grad_k))

    _check_against_oracle((out_q, out_k, dq, dk), _oracle(q, k, cos, sin, grad_q, grad_k), dtype)


def _llama_rotary(heads: int, kv_heads: int, head_dim: int) -> LlamaRotaryEmbedding:
    """transformers' rotary module on the kernel test device, as it sits in a model there: it builds the tables on
    the device of its inv_freq buffer and its position_ids, which must be where the activations are."""
    config = LlamaConfig(
        # hidden != heads * head_dim (5.23 still wants it divisible by heads): head_dim must come from the config.
        hidden_size=heads * head_dim // 2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=128,
    )
    return LlamaRotaryEmbedding(config).to(KERNEL_DEVICE)


def test_reference_is_bit_exact_with_transformers(gen):
    batch, heads, kv_heads, seq, head_dim = 2, 9, 3, 37, 64
    rotary = _llama_rotary(heads, kv_heads, head_dim)
    x = random_tensor((batch, seq, heads * head_dim), torch.float32, gen)
    position_ids = torch.stack([torch.cat([torch.arange(12), torch.arange(25)]), torch.arange(3, 3 + seq)])
    position_ids = position_ids.to(KERNEL_DEVICE)
    cos, sin = rotary(x, position_ids)
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, torch.float32, gen)
    q, k = q.detach(), k.detach()

    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_reference(q, k, cos, sin)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(got_k, expected_k)

    # The Function's reference path (the CPU's, and any device's under force_reference) is the same expression.
    with dispatch.force_reference():
        got_q, got_k = apply_rope(q, k, cos, sin)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(got_k, expected_k)

    # Tables for every position, indexed by position_ids: the same bits again.
    cos_table, sin_table = rotary(x[:1], torch.arange(128, device=KERNEL_DEVICE)[None])
    got_q, got_k = rope_reference(q, k, cos_table[0], sin_table[0], position_ids=position_ids)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(got_k, expected_k)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_matches_transformers_with_real_rotary(kernel_path, gen, dtype):
    batch, heads, kv_heads, seq, head_dim = 1, 9, 3, 23, 48
    rotary = _llama_rotary(heads, kv_heads, head_dim)
    x = random_tensor((batch, seq, heads * head_dim), dtype, gen)
    cos, sin = rotary(x, torch.arange(40, 40 + seq, device=KERNEL_DEVICE)[None])
    assert cos.dtype == dtype
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, dtype, gen)
    got = apply_rope(q.detach(), k.detach(), cos, sin)
    expected = apply_rotary_pos_emb(q.detach().double(), k.detach().double(), cos.double(), sin.double())
    for actual, wanted in zip(got, expected, strict=True):
        assert relative_error(actual, wanted) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "qkv"])
def test_inplace_gives_same_values_and_gradients(kernel_path, gen, dtype, layout):
    batch, heads, kv_heads, seq, head_dim = 2, 9, 3, 13, 48
    sources = _sources(layout, batch, heads, kv_heads, seq, head_dim, dtype, gen)
    cos, sin = _tables(torch.randint(0, 4096, (batch, seq), generator=gen), head_dim, dtype)
    grad_q = random_tensor((batch, heads, seq, head_dim), dtype, gen)
    grad_k = random_tensor((batch, kv_heads, seq, head_dim), dtype, gen)

    out_q, out_k = apply_rope(*_qk(layout, sources, heads, kv_heads), cos, sin)
    expected_grads = torch.autograd.grad((out_q, out_k), sources, (grad_q, grad_k))

    # The caller owns these buffers (copies made inside the graph, so not leaves) and rotates q / k views of them.
    buffers = [source.clone() for source in sources]
    q_view, k_view = _qk(layout, buffers, heads, kv_heads)
    in_q, in_k = apply_rope(q_view, k_view, cos, sin, inplace=True)
    assert in_q.data_ptr() == q_view.data_ptr() and in_q.stride() == q_view.stride()
    assert in_k.data_ptr() == k_view.data_ptr() and in_k.stride() == k_view.stride()
    assert torch.equal(in_q, out_q) and torch.equal(in_k, out_k)
    rotated_q, rotated_k = _qk(layout, buffers, heads, kv_heads)  # fresh views: the storage holds the rotation
    assert torch.equal(rotated_q, out_q) and torch.equal(rotated_k, out_k)
    grads = torch.autograd.grad((in_q, in_k), sources, (grad_q, grad_k))
    for got, wanted in zip(grads, expected_grads, strict=True):
        assert torch.equal(got, wanted)

    # Inference: no graph to record, the same rotation.
    with torch.no_grad():
        plain_q, plain_k = _qk(layout, [source.detach().clone() for source in sources], heads, kv_heads)
        apply_rope(plain_q, plain_k, cos, sin, inplace=True)
    assert torch.equal(plain_q, out_q) and torch.equal(plain_k, out_k)

    q, k = _qk(layout, sources, heads, kv_heads)
    expected = _oracle(q, k, cos, sin, grad_q, grad_k)
    # Gradients in q / k layout: the same views taken of the source gradients.
    grad_views = _qk(layout, list(grads), heads, kv_heads)
    _check_against_oracle((in_q, in_k, *grad_views), expected, dtype)


def test_backward_leaves_a_shared_gradient_alone(kernel_path, gen):
    # An add hands its incoming gradient, the same tensor, to both operands: the rope backward must not rotate
    # it in place, or the other operand's gradient (here w.grad) would come out rotated.
    batch, heads, kv_heads, seq, head_dim = 1, 4, 2, 5, 64
    q, k = _views("contiguous", batch, heads, kv_heads, seq, head_dim, torch.float32, gen)
    w = random_tensor(q.shape, torch.float32, gen).requires_grad_()
    cos, sin = _tables(torch.randint(0, 4096, (1, seq), generator=gen), head_dim, torch.float32)
    grad_q = random_tensor(q.shape, torch.float32, gen)
    grad_k = random_tensor(k.shape, torch.float32, gen)

    out_q, out_k = apply_rope(q, k, cos, sin)
    torch.autograd.backward((out_q + w, out_k), (grad_q.clone(), grad_k))

    assert torch.equal(w.grad, grad_q)
    expected = _oracle(q, k, cos, sin, grad_q, grad_k)
    _check_against_oracle((out_q, out_k, q.grad, k.grad), expected, torch.float32)


def test_unused_output_gets_no_gradient(kernel_path, gen):
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 3, 48
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, torch.float32, gen)
    cos, sin = _tables(torch.randint(0, 4096, (1, seq), generator=gen), head_dim, torch.float32)
    grad_q = random_tensor(q.shape, torch.float32, gen)

    out_q, _ = RoPEFunction.apply(q, k, cos, sin, None, False)
    dq, dk = torch.autograd.grad(out_q, (q, k), grad_q, allow_unused=True)

    assert dk is None
    expected = _oracle(q, k, cos, sin, grad_q, torch.zeros_like(k))
    assert relative_error(dq, expected[2]) < TOLERANCE[torch.float32]


def test_learnable_tables_take_the_reference(gen):
    batch, heads, kv_heads, seq, head_dim = 1, 4, 2, 3, 16
    q, k = _views("transposed", batch, heads, kv_heads, seq, head_dim, torch.float32, gen)
    cos, sin = (t.requires_grad_() for t in _tables(torch.arange(seq)[None] + 7, head_dim, torch.float32))

    out_q, out_k = apply_rope(q, k, cos, sin)
    (out_q.sum() + out_k.sum()).backward()
    assert cos.grad is not None and sin.grad is not None and sin.grad.abs().sum() > 0

    with pytest.raises(ValueError, match="inplace=True cannot differentiate cos / sin"):
        apply_rope(q.detach().clone(), k.detach().clone(), cos, sin, inplace=True)


def _error_case(q_shape, k_shape, cos_shape, position_ids=None, match=""):
    return (q_shape, k_shape, cos_shape, position_ids, match)


ERRORS = [
    pytest.param(*_error_case((2, 4, 5, 15), (2, 2, 5, 15), (1, 5, 15), match="an even head_dim"), id="odd-hd"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 5, 8), (1, 5, 16), match="k head_dim 16"), id="k-hd"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 5, 16), (1, 5, 8), match="last dimension"), id="cos-hd"),
    pytest.param(*_error_case((2, 4, 5, 16), (1, 2, 5, 16), (1, 5, 16), match="q's batch and seq"), id="batch"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 6, 16), (1, 5, 16), match="q's batch and seq"), id="seq"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 5, 16), (1, 6, 16), match=r"\[2 or 1, 5, 16\]"), id="cos-seq"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 5, 16), (3, 5, 16), match=r"\[2 or 1, 5, 16\]"), id="cos-b"),
    pytest.param(*_error_case((2, 4, 5, 16), (2, 2, 5, 16), (64, 16), match="with position_ids"), id="table-no-pos"),
    pytest.param(*_error_case((2, 5, 16), (2, 5, 16), (1, 5, 16), match="q \\[batch, heads"), id="3d"),
    pytest.param(
        *_error_case((2, 4, 5, 16), (2, 2, 5, 16), (8, 16), torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])),
        id="pos-too-big",
    ),
    pytest.param(
        *_error_case((2, 4, 5, 16), (2, 2, 5, 16), (64, 16), torch.tensor([[0, 1, 2, 3, 4], [0, 1, -1, 2, 3]])),
        id="pos-negative",
    ),
    pytest.param(
        *_error_case((2, 4, 5, 16), (2, 2, 5, 16), (64, 16), torch.zeros(2, 5), match="integer position_ids"),
        id="pos-float",
    ),
    pytest.param(
        *_error_case((2, 4, 5, 16), (2, 2, 5, 16), (64, 16), torch.zeros(2, 4, dtype=torch.long), match=r"\[2 or 1"),
        id="pos-shape",
    ),
    pytest.param(
        *_error_case((2, 4, 5, 16), (2, 2, 5, 16), (2, 5, 16), torch.zeros(2, 5, dtype=torch.long), match="tables"),
        id="gathered-with-pos",
    ),
]


@pytest.mark.parametrize(("q_shape", "k_shape", "cos_shape", "position_ids", "match"), ERRORS)
@pytest.mark.parametrize("function", [apply_rope, rope_reference], ids=["apply_rope", "rope_reference"])
def test_bad_shapes_raise(gen, function, q_shape, k_shape, cos_shape, position_ids, match):
    q = random_tensor(q_shape, torch.float32, gen)
    k = random_tensor(k_shape, torch.float32, gen)
    cos = random_tensor(cos_shape, torch.float32, gen)
    sin = random_tensor(cos_shape, torch.float32, gen)
    if position_ids is not None:
        position_ids = position_ids.to(KERNEL_DEVICE)
        if not match:  # out of range: the message names the table's rows and the ids' actual range
            low, high = position_ids.min().item(), position_ids.max().item()
            match = rf"position_ids in \[0, {cos_shape[0]}\).*got position_ids from {low} to {high}"
    with pytest.raises(ShapeContractError, match=match) as caught:
        function(q, k, cos, sin, position_ids=position_ids)
    assert f"fastft.kernels.rope.{function.__name__}: expected" in str(caught.value)


def test_reference_tables_follow_the_tables_they_were_made_from(gen):
    # The CPU path makes its tables once per cos / sin pair (every layer reads the same ones) and must notice both a
    # new pair and the same tensors written in place.
    q = random_tensor((1, 4, 16, 16), torch.float32, gen)
    k = random_tensor((1, 2, 16, 16), torch.float32, gen)
    cos, sin = _tables(torch.arange(16)[None], 16, torch.float32)
    with dispatch.force_reference():
        first = apply_rope(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(first, apply_rope(q, k, cos, sin), strict=True))
        shifted_cos, shifted_sin = _tables(torch.arange(3, 19)[None], 16, torch.float32)
        expected = apply_rotary_pos_emb(q, k, shifted_cos, shifted_sin)
        for got in (apply_rope(q, k, shifted_cos, shifted_sin), None):
            if got is None:  # the first tensors, overwritten in place with the new values
                cos.copy_(shifted_cos)
                sin.copy_(shifted_sin)
                got = apply_rope(q, k, cos, sin)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        with torch.inference_mode():
            # Inference tensors keep no version counter: the tables are made afresh, and still right.
            frozen_cos, frozen_sin = cos.clone(), sin.clone()
            for a, b in zip(apply_rope(q, k, frozen_cos, frozen_sin), expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
