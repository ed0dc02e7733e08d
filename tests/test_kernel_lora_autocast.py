"""The fused LoRA projections under autocast: fp32 weights and inputs, bf16 compute (the module docstring of
test_kernel_lora.py says how they are checked against float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, TOLERANCE, random_tensor, reference_kernels_everywhere, relative_error
from test_kernel_lora import HIDDEN, Q_OUT, QWEN2_BIAS, Reference, make_projection, mlp_projections, qkv_projections

from fastft.kernels import dispatch
from fastft.kernels.lora_mlp import lora_mlp
from fastft.kernels.lora_o import lora_o
from fastft.kernels.lora_qkv import lora_qkv

# The interpreter cannot do bf16 dots (DESIGN.md): on the CPU the reference path runs under bf16 autocast, on a GPU the
# compiled Triton kernels as well.
AUTOCAST_PATHS = ["reference", "triton"] if KERNEL_DEVICE == "cuda" else ["reference"]


@pytest.mark.parametrize("path", AUTOCAST_PATHS)
def test_autocast_bf16_with_fp32_weights(gen, monkeypatch, path):
    # Inputs cast to bf16 as F.linear does under autocast (on the device the tensors are on), outputs bf16, gradients
    # in the leaves' fp32.
    dtype, compute = torch.float32, torch.bfloat16
    qkv = qkv_projections(
        dtype, gen, [(4, 2.0), None, (1, 0.5)], nf4=("dense", "dense", "params4bit-nested"), biases=QWEN2_BIAS
    )
    o = make_projection(HIDDEN, Q_OUT, dtype, gen, (2, 1.5))
    mlp = mlp_projections(dtype, gen, [(2, 1.0), (1, 2.0), (3, 0.5)])
    projections = [*qkv, o, *mlp]
    x = random_tensor((2, 19, HIDDEN), dtype, gen).requires_grad_()

    if path == "reference":
        reference_kernels_everywhere(monkeypatch)
    with dispatch.poison_outputs():
        assert dispatch.use_triton(x) == (path == "triton")
        with torch.autocast(KERNEL_DEVICE, dtype=compute):
            q, k, v = lora_qkv(x, *qkv)
            y_o = lora_o(q, o)
            y_mlp = lora_mlp(x, *mlp)
        outputs = [q, k, v, y_o, y_mlp]
        assert all(out.dtype == compute for out in outputs)
        grads = [random_tensor(out.shape, compute, gen) for out in outputs]
        torch.autograd.backward(outputs, grads)

    # float64 from the bf16-cast inputs (the 4-bit weight: its fp32 values rounded to bf16, as dequantised; the fp32
    # biases rounded to bf16, as autocast hands them to F.linear).
    ref = Reference(x, projections, cast=compute)
    q64, k64, v64 = (ref.project(i, ref.x) for i in range(3))
    expected = [
        q64,
        k64,
        v64,
        ref.project(3, q64),
        ref.project(6, F.silu(ref.project(4, ref.x)) * ref.project(5, ref.x)),
    ]
    torch.autograd.backward(expected, [g.double() for g in grads])

    bound = TOLERANCE[compute]
    for out, out64 in zip(outputs, expected, strict=True):
        assert relative_error(out, out64) < bound
    assert x.grad.dtype == dtype
    assert relative_error(x.grad, ref.x.grad) < bound
    for i, projection in enumerate(projections):
        if projection.lora_a is None:
            continue
        assert projection.lora_a.grad.dtype == projection.lora_b.grad.dtype == dtype
        assert relative_error(projection.lora_a.grad, ref.a[i].grad) < bound, f"dA of projection {i}"
        assert relative_error(projection.lora_b.grad, ref.b[i].grad) < bound, f"dB of projection {i}"
