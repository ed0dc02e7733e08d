"""LoRA-QKV with RoPE in one node (``lora_qkv_rope``): q, k, v per head with q and k rotated, and dX, dA, dB, against
float64 (the projections as in test_kernel_lora, then transformers' rotate-half rotation), on both kernel paths."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error
from test_kernel_lora import HIDDEN, KV_OUT, NO_BIAS, Q_OUT, QWEN2_BIAS, Reference, make_projection, qkv_projections

from fastft import ShapeContractError
from fastft.kernels import LoRAGroup, apply_rope
from fastft.kernels.lora_qkv_rope import LoRAQKVRoPEFunction, lora_qkv_rope

HEAD_DIM = 12  # 6 heads and 2 kv heads over hidden 48: hidden != heads · head_dim
BATCH, SEQ = 2, 19

CASES = {
    "ranks-8-1-4": ([(8, 2.0), (1, 0.5), (4, 1.5)], NO_BIAS, ("dense",) * 3),
    "k-without-lora": ([(4, 0.25), None, (2, 3.0)], NO_BIAS, ("dense",) * 3),
    "qwen2-bias": ([(8, 2.0), (1, 0.5), (4, 1.5)], QWEN2_BIAS, ("dense",) * 3),
    "nf4": ([(8, 2.0), (1, 0.5), (4, 1.5)], NO_BIAS, ("params4bit-nested",) * 3),
}


def _tables(dtype: torch.dtype, gen: torch.Generator, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    angles = random_tensor((batch, SEQ, HEAD_DIM // 2), torch.float32, gen, scale=3.0)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotated64(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    heads = y.view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)
    half = HEAD_DIM // 2
    turned = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    return heads * cos.double().unsqueeze(1) + turned * sin.double().unsqueeze(1)


def _check(outputs, expected, grads, x, ref, projections, dtype) -> None:
    live = [(out64, g.double()) for out64, g in zip(expected, grads, strict=True) if g is not None]
    torch.autograd.backward([out64 for out64, _ in live], [g for _, g in live])
    bound = TOLERANCE[dtype]
    for out, out64 in zip(outputs, expected, strict=True):
        assert out.dtype == dtype and out.shape == out64.shape
        assert relative_error(out, out64) < bound
    assert x.grad.shape == x.shape and relative_error(x.grad, ref.x.grad) < bound
    for i, projection in enumerate(projections):
        assert projection.weight.grad is None
        if projection.lora_a is not None:
            assert relative_error(projection.lora_a.grad, ref.a[i].grad) < bound, f"dA of projection {i}"
            assert relative_error(projection.lora_b.grad, ref.b[i].grad) < bound, f"dB of projection {i}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_qkv_rope_against_float64(kernel_path, gen, dtype, case):
    specs, biases, nf4 = CASES[case]
    projections = qkv_projections(dtype, gen, specs, nf4=nf4, biases=biases)
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), dtype, gen).requires_grad_()
    cos, sin = _tables(dtype, gen)
    outputs = lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    assert type(outputs[0].grad_fn).__name__ == "LoRAQKVRoPEFunctionBackward"
    assert [tuple(out.shape) for out in outputs] == [(BATCH, 6, SEQ, HEAD_DIM)] + [(BATCH, 2, SEQ, HEAD_DIM)] * 2
    grads = [random_tensor(out.shape, dtype, gen) for out in outputs]
    torch.autograd.backward(outputs, grads)

    ref = Reference(x, projections)
    q, k, v = (ref.project(i, ref.x.view(-1, HIDDEN)) for i in range(3))
    expected = [_rotated64(q, cos, sin), _rotated64(k, cos, sin), v.view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)]
    _check(outputs, expected, grads, x, ref, projections, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_packed_qkv_projection_splits_then_rotates(kernel_path, gen, dtype):
    # Phi-3's qkv_proj: one projection and adapter over q | k | v, its output split at the config's widths.
    projection = make_projection(Q_OUT + 2 * KV_OUT, HIDDEN, dtype, gen, (8, 2.0))
    group = LoRAGroup("lora_packed_qkv", ("qkv_proj",), (projection,), "qkv", split=(Q_OUT, KV_OUT, KV_OUT))
    x = random_tensor((BATCH, SEQ, HIDDEN), dtype, gen).requires_grad_()
    cos, sin = _tables(dtype, gen, batch=BATCH)
    outputs = lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    grads = [random_tensor(out.shape, dtype, gen) for out in outputs]
    torch.autograd.backward(outputs, grads)

    ref = Reference(x, [projection])
    q, k, v = ref.project(0, ref.x.view(-1, HIDDEN)).split([Q_OUT, KV_OUT, KV_OUT], dim=1)
    expected = [_rotated64(q, cos, sin), _rotated64(k, cos, sin), v.reshape(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)]
    _check(outputs, expected, grads, x, ref, [projection], dtype)


def test_outputs_without_gradient_give_zero_gradients_there(kernel_path, gen):
    # Only v reaches the loss: q's and k's gradients arrive as None; their adapters get exact zeros, v's its own.
    projections = qkv_projections(torch.float32, gen, [(4, 1.0), (4, 1.0), (4, 1.0)])
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), torch.float32, gen).requires_grad_()
    cos, sin = _tables(torch.float32, gen)
    _, _, v = lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    v.sum().backward()
    for projection in projections[:2]:
        assert torch.equal(projection.lora_a.grad, torch.zeros_like(projection.lora_a))
        assert torch.equal(projection.lora_b.grad, torch.zeros_like(projection.lora_b))
    assert projections[2].lora_b.grad.norm() > 0 and x.grad.norm() > 0


def test_equal_to_the_group_then_apply_rope(kernel_path, gen):
    # The fused node and the unfused chain it replaces give the same numbers, forward and backward.
    projections = qkv_projections(torch.float32, gen, [(8, 2.0), (1, 0.5), (4, 1.5)])
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), torch.float32, gen).requires_grad_()
    cos, sin = _tables(torch.float32, gen)
    grads = [
        random_tensor(shape, torch.float32, gen) for shape in [(BATCH, 6, SEQ, HEAD_DIM)] + [(BATCH, 2, SEQ, 12)] * 2
    ]
    leaves = [x] + [t for p in projections for t in (p.lora_a, p.lora_b)]

    fused = lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    fused_grads = torch.autograd.grad(fused, leaves, grads)
    q, k, v = (t.view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2) for t in group(x))
    chain = (*apply_rope(q, k, cos, sin), v)
    chain_grads = torch.autograd.grad(chain, leaves, grads)
    for a, b in zip((*fused, *fused_grads), (*chain, *chain_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_saves_x_xa_tables_and_adapters_only(gen):
    projections = qkv_projections(torch.float32, gen, [(8, 2.0), (1, 0.5), (4, 1.5)])
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), torch.float32, gen).requires_grad_()
    cos, sin = _tables(torch.float32, gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    rows = BATCH * SEQ
    shapes = sorted(tuple(t.shape) for t in saved)
    adapters = [tuple(t.shape) for p in projections for t in (p.lora_a, p.lora_b)]
    # X, X Aᵀ (13 = 8 + 1 + 4 columns), cos, sin and the adapters: never q, k or v.
    assert shapes == sorted([(rows, HIDDEN), (rows, 13), (1, SEQ, HEAD_DIM), (1, SEQ, HEAD_DIM), *adapters])


def test_tables_that_do_not_fit_are_refused_with_both_shapes(gen):
    projections = qkv_projections(torch.float32, gen, [(4, 1.0), None, (4, 1.0)])
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), torch.float32, gen)
    cos, sin = (
        random_tensor((1, SEQ + 1, HEAD_DIM), torch.float32, gen),
        random_tensor((1, SEQ + 1, 12), torch.float32, gen),
    )
    with pytest.raises(ShapeContractError, match="lora_qkv_rope") as error:
        lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    assert str(SEQ + 1) in str(error.value) and str(SEQ) in str(error.value)


def test_the_function_is_the_graph_node_and_grads_reach_every_adapter(gen):
    projections = qkv_projections(torch.float32, gen, [(4, 1.0), (4, 1.0), (4, 1.0)])
    group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
    x = random_tensor((BATCH, SEQ, HIDDEN), torch.float32, gen)
    cos, sin = _tables(torch.float32, gen)
    outputs = lora_qkv_rope(group, x, cos, sin, HEAD_DIM)
    assert all(type(out.grad_fn).__name__ == f"{LoRAQKVRoPEFunction.__name__}Backward" for out in outputs)
    sum(out.sum() for out in outputs).backward()
    assert all(t.grad is not None and t.grad.norm() > 0 for p in projections for t in (p.lora_a, p.lora_b))
