"""RMSNorm kernel: output, dX and dW against float64, Llama's and Gemma's casting rules, layouts, saved tensors,
shape errors."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

from fastft.kernels import dispatch
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.rms_norm import RMSNormFunction, rms_norm, rms_norm_reference

# The package exports the function under the module's name, so the attribute lookup would find the function.
rms_norm_module = importlib.import_module("fastft.kernels.rms_norm")

# Round and odd hidden sizes, one row and an odd row count, with and without leading batch dimensions.
SHAPES = [(67, 64), (1, 64), (1, 67, 123), (1, 1, 123), (1, 576), (67, 576)]


def float64_reference(x, weight, grad, eps):
    """Output, dX and dW by the same formula in float64, from the already dtype-rounded inputs."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    out64 = rms_norm_reference(x64, w64, eps)
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64), grad.double())
    return out64.detach(), dx64, dw64


def run(x, weight, grad, eps=1e-6, **variant):
    """Forward and backward through rms_norm; returns output and the input grads (None where not required)."""
    out = rms_norm(x, weight, eps, **variant)
    inputs = [t for t in (x, weight) if t.requires_grad]
    grads = iter(torch.autograd.grad(out, inputs, grad))
    dx = next(grads) if x.requires_grad else None
    dw = next(grads) if weight.requires_grad else None
    return out, dx, dw


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_matches_float64(kernel_path, gen, shape, dtype):
    hidden = shape[-1]
    x = random_tensor(shape, dtype, gen).requires_grad_(True)
    weight = random_tensor((hidden,), dtype, gen).requires_grad_(True)
    grad = random_tensor(shape, dtype, gen)

    out, dx, dw = run(x, weight, grad)
    out64, dx64, dw64 = float64_reference(x, weight, grad, 1e-6)

    assert (out.dtype, dx.dtype, dw.dtype) == (dtype, dtype, dtype)
    assert out.shape == x.shape and dx.shape == x.shape and dw.shape == weight.shape
    assert relative_error(out, out64) < TOLERANCE[dtype]
    assert relative_error(dx, dx64) < TOLERANCE[dtype]
    assert relative_error(dw, dw64) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_eps_is_honoured(kernel_path, gen, dtype):
    # Mean square ~1e-6 against eps 1e-5: a kernel that dropped or hard-coded eps would be far off.
    x = random_tensor((5, 123), dtype, gen, scale=1e-3).requires_grad_(True)
    weight = random_tensor((123,), dtype, gen).requires_grad_(True)
    grad = random_tensor((5, 123), dtype, gen)

    out, dx, dw = run(x, weight, grad, eps=1e-5)
    out64, dx64, dw64 = float64_reference(x, weight, grad, 1e-5)

    assert relative_error(out, out64) < TOLERANCE[dtype]
    assert relative_error(dx, dx64) < TOLERANCE[dtype]
    assert relative_error(dw, dw64) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
    ids=["fp32", "fp16", "fp16-input-fp32-weight"],
)
def test_llama_rms_norm_parity(kernel_path, gen, dtype, weight_dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 123
    module = LlamaRMSNorm(hidden, eps=1e-6).to(device=KERNEL_DEVICE, dtype=weight_dtype)
    with torch.no_grad():
        module.weight.copy_(random_tensor((hidden,), weight_dtype, gen))
    x = random_tensor((2, 67, hidden), dtype, gen)
    expected = module(x)

    # The plain-torch reference is op for op the upstream forward: bit-identical in every dtype.
    assert torch.equal(rms_norm_reference(x, module.weight, 1e-6), expected)

    out = rms_norm(x, module.weight, 1e-6)
    # Cast back to the input dtype before the weight multiply: the output dtype is the promotion of both.
    assert out.dtype == expected.dtype == torch.promote_types(weight_dtype, dtype)
    if kernel_path == "reference":
        assert torch.equal(out, expected)
    else:
        if dtype == torch.float32:
            assert relative_error(out, expected) < 1e-5
        else:
            # The normalised row is rounded to fp16 before the weight multiply, so an ulp of difference in rstd
            # (another summation order, a hardware rsqrt) almost never changes an element. A kernel that skipped
            # that rounding would differ almost everywhere while staying inside the fp16 error bound.
            assert (out == expected).double().mean().item() > 0.99


def test_mixed_dtypes_gradients(kernel_path, gen):
    # A fp16 model whose norms were kept in fp32: dX in the input's dtype, dW in the weight's.
    x = random_tensor((67, 123), torch.float16, gen).requires_grad_(True)
    weight = random_tensor((123,), torch.float32, gen).requires_grad_(True)
    grad = random_tensor((67, 123), torch.float32, gen)

    out, dx, dw = run(x, weight, grad)
    out64, dx64, dw64 = float64_reference(x, weight, grad, 1e-6)

    assert (out.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.float16, torch.float32)
    assert relative_error(out, out64) < TOLERANCE[torch.float16]
    assert relative_error(dx, dx64) < TOLERANCE[torch.float16]
    assert relative_error(dw, dw64) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_only_required_gradients(kernel_path, gen, monkeypatch, frozen):
    x = random_tensor((1, 67, 123), torch.float32, gen).requires_grad_(frozen != "x")
    weight = random_tensor((123,), torch.float32, gen).requires_grad_(frozen != "weight")
    grad = random_tensor((1, 67, 123), torch.float32, gen)
    out = rms_norm(x, weight)
    _, dx64, dw64 = float64_reference(x, weight, grad, 1e-6)

    allocations = []
    real_empty = dispatch.empty

    def recording_empty(shape, **kwargs):
        allocations.append(tuple(shape))
        return real_empty(shape, **kwargs)

    monkeypatch.setattr(dispatch, "empty", recording_empty)
    out.backward(grad)

    # The reference path allocates nothing through dispatch (torch's own ops make its gradients).
    if frozen == "weight":
        assert weight.grad is None
        assert relative_error(x.grad, dx64) < TOLERANCE[torch.float32]
        # Only dX is allocated (in x's shape, no view afterwards): no per-program dW partial sums when the weight
        # is frozen.
        assert allocations == ([(1, 67, 123)] if kernel_path == "triton" else [])
    else:
        assert x.grad is None
        assert relative_error(weight.grad, dw64) < TOLERANCE[torch.float32]
        # Only the fp32 dW partial sums, one row per program: how many programs depends on the device (a few under
        # the interpreter, up to two per SM on a GPU, never more than the 67 rows), so only that bound is checked.
        if kernel_path == "triton":
            assert len(allocations) == 1 and allocations[0][1:] == (123,) and 1 <= allocations[0][0] <= 67, allocations
        else:
            assert allocations == []


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_non_contiguous_inputs(kernel_path, gen, dtype):
    # A slice of a wider tensor (a strided 2-D view), a transpose (last-dim stride != 1) and a permute that no
    # 2-D view can describe; the upstream gradient is an expanded (stride 0) tensor.
    wide = random_tensor((67, 200), dtype, gen)[:, 5:128]
    transposed = random_tensor((64, 67), dtype, gen).t()
    permuted = random_tensor((3, 64, 5), dtype, gen).permute(0, 2, 1)
    for x in (wide, transposed, permuted):
        assert not x.is_contiguous()
        x.requires_grad_(True)
        hidden = x.shape[-1]
        weight = random_tensor((hidden,), dtype, gen).requires_grad_(True)
        grad = random_tensor((hidden,), dtype, gen).expand(x.shape)

        out, dx, dw = run(x, weight, grad)
        out64, dx64, dw64 = float64_reference(x, weight, grad, 1e-6)

        assert relative_error(out, out64) < TOLERANCE[dtype]
        assert relative_error(dx, dx64) < TOLERANCE[dtype]
        assert relative_error(dw, dw64) < TOLERANCE[dtype]


def test_saves_input_weight_and_rstd_only(kernel_path, gen):
    x = random_tensor((1, 67, 123), torch.float16, gen).requires_grad_(True)
    weight = random_tensor((123,), torch.float16, gen).requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = RMSNormFunction.apply(x, weight, 1e-6)

    assert len(saved) == 3
    assert saved[0] is x and saved[1] is weight
    # One fp32 per row, shaped [..., 1] so that the reference broadcasts it over x without a view.
    assert saved[2].shape == (1, 67, 1) and saved[2].dtype == torch.float32
    assert all(t.data_ptr() != out.data_ptr() for t in saved)


def test_empty_rows(kernel_path):
    x = torch.zeros((0, 64), device=KERNEL_DEVICE, requires_grad=True)
    weight = torch.ones(64, device=KERNEL_DEVICE, requires_grad=True)
    out = rms_norm(x, weight)
    out.backward(torch.zeros_like(out))
    assert out.shape == (0, 64)
    assert x.grad.shape == (0, 64)
    assert torch.equal(weight.grad, torch.zeros(64, device=KERNEL_DEVICE))


def test_hidden_beyond_one_block_takes_reference(gen, monkeypatch):
    assert dispatch.use_triton(torch.empty(0, device=KERNEL_DEVICE))

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a Triton kernel was launched for a row wider than MAX_FUSED_HIDDEN")

    monkeypatch.setattr(rms_norm_module, "MAX_FUSED_HIDDEN", 64)
    monkeypatch.setattr(rms_norm_module, "_rms_norm_fwd_kernel", NoLaunch())
    monkeypatch.setattr(rms_norm_module, "_rms_norm_bwd_kernel", NoLaunch())
    x = random_tensor((3, 123), torch.float32, gen).requires_grad_(True)
    weight = random_tensor((123,), torch.float32, gen).requires_grad_(True)
    grad = random_tensor((3, 123), torch.float32, gen)

    out, dx, dw = run(x, weight, grad)
    out64, dx64, dw64 = float64_reference(x, weight, grad, 1e-6)

    assert relative_error(out, out64) < TOLERANCE[torch.float32]
    assert relative_error(dx, dx64) < TOLERANCE[torch.float32]
    assert relative_error(dw, dw64) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("x_shape", "weight_shape", "message"),
    [
        ((2, 5, 64), (63,), r"rms_norm.*\[64\].*weight has shape \[63\].*x has shape \[2, 5, 64\]"),
        ((5, 64), (1, 64), r"rms_norm.*weight has shape \[1, 64\].*x has shape \[5, 64\]"),
        ((), (64,), r"rms_norm.*weight has shape \[64\].*x has shape \[\]"),
    ],
    ids=["wrong-size", "two-dim-weight", "scalar-x"],
)
def test_shape_errors(kernel_path, x_shape, weight_shape, message):
    x = torch.ones(x_shape, device=KERNEL_DEVICE)
    weight = torch.ones(weight_shape, device=KERNEL_DEVICE)
    with pytest.raises(ShapeContractError, match=message):
        rms_norm(x, weight)


# Gemma's variant: scale by (1 + weight) and round once, after the fp32 multiply (Gemma3RMSNorm).
GEMMA = {"offset": 1.0, "cast_before_weight": False}
# bf16 runs through the interpreter here too (no dot in this kernel); its fp32 -> bf16 cast truncates instead of
# rounding to nearest, an error of under one bf16 ulp that the bf16 bound absorbs.
GEMMA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gemma_float64(x, weight, grad, eps):
    """Gemma's formula, x̂ · (1 + w), computed in float64 throughout, with its gradients by autograd."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    out64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w64)
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64), grad.double())
    return out64.detach(), dx64, dw64


def gemma_module(hidden, weight_dtype, gen, eps=1e-6):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    module = Gemma3RMSNorm(hidden, eps=eps).to(device=KERNEL_DEVICE, dtype=weight_dtype)
    with torch.no_grad():
        # Gemma stores scale - 1 and initialises it to zero; random values exercise the (1 + w) product.
        module.weight.copy_(random_tensor((hidden,), weight_dtype, gen, scale=0.5))
    return module


@pytest.mark.parametrize("shape", [(2, 67, 123), (1, 64), (5, 576)], ids=lambda s: "x".join(map(str, s)))
def test_gemma3_rms_norm_parity(kernel_path, gen, shape):
    """Output, dX and dW against transformers' Gemma3RMSNorm itself, in fp32."""
    hidden = shape[-1]
    module = gemma_module(hidden, torch.float32, gen)
    x = random_tensor(shape, torch.float32, gen).requires_grad_(True)
    grad = random_tensor(shape, torch.float32, gen)
    expected = module(x)
    expected_dx, expected_dw = torch.autograd.grad(expected, (x, module.weight), grad)

    weight = module.weight.detach().clone().requires_grad_(True)
    out = rms_norm(x, weight, 1e-6, **GEMMA)
    dx, dw = torch.autograd.grad(out, (x, weight), grad)

    assert (out.dtype, dx.dtype, dw.dtype) == (torch.float32,) * 3
    if kernel_path == "reference":
        assert torch.equal(out, expected)  # op for op the upstream forward
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert relative_error(dx, expected_dx) < TOLERANCE[torch.float32]
    assert relative_error(dw, expected_dw) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", GEMMA_DTYPES, ids=str)
def test_gemma_reference_is_bit_identical_to_upstream(gen, dtype):
    module = gemma_module(123, dtype, gen)
    x = random_tensor((3, 67, 123), dtype, gen)
    expected = module(x)
    assert expected.dtype == dtype
    assert torch.equal(rms_norm_reference(x, module.weight, 1e-6, **GEMMA), expected)


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(dtype, dtype) for dtype in GEMMA_DTYPES] + [(torch.float16, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["fp32", "fp16", "bf16", "fp16-input-fp32-weight", "bf16-input-fp32-weight"],
)
@pytest.mark.parametrize("shape", [(1, 67, 123), (67, 576)], ids=lambda s: "x".join(map(str, s)))
def test_gemma_matches_float64(kernel_path, gen, shape, dtype, weight_dtype):
    hidden = shape[-1]
    x = random_tensor(shape, dtype, gen).requires_grad_(True)
    weight = random_tensor((hidden,), weight_dtype, gen, scale=0.5).requires_grad_(True)
    grad = random_tensor(shape, dtype, gen)

    out, dx, dw = run(x, weight, grad, **GEMMA)
    out64, dx64, dw64 = gemma_float64(x, weight, grad, 1e-6)

    # Gemma rounds once, to the input's dtype (type_as(x)), whatever the weight's dtype.
    assert (out.dtype, dx.dtype, dw.dtype) == (dtype, dtype, weight_dtype)
    assert out.shape == x.shape and dx.shape == x.shape and dw.shape == weight.shape
    assert relative_error(out, out64) < TOLERANCE[dtype]
    assert relative_error(dx, dx64) < TOLERANCE[dtype]
    assert relative_error(dw, dw64) < TOLERANCE[dtype]


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_gemma_only_required_gradients(kernel_path, gen, frozen):
    x = random_tensor((2, 9, 123), torch.float32, gen).requires_grad_(frozen != "x")
    weight = random_tensor((123,), torch.float32, gen).requires_grad_(frozen != "weight")
    grad = random_tensor((2, 9, 123), torch.float32, gen)
    _, dx, dw = run(x, weight, grad, **GEMMA)
    _, dx64, dw64 = gemma_float64(x, weight, grad, 1e-6)
    if frozen == "weight":
        assert dw is None and relative_error(dx, dx64) < TOLERANCE[torch.float32]
    else:
        assert dx is None and relative_error(dw, dw64) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_default_variant_is_llama_unchanged(kernel_path, gen, dtype):
    """The new keywords at their defaults are the Llama norm, bit for bit; Gemma's is a different function."""
    x = random_tensor((67, 123), dtype, gen).requires_grad_(True)
    weight = random_tensor((123,), dtype, gen).requires_grad_(True)
    grad = random_tensor((67, 123), dtype, gen)

    plain = run(x, weight, grad)
    explicit = run(x, weight, grad, offset=0.0, cast_before_weight=True)
    three_args = RMSNormFunction.apply(x, weight, 1e-6)  # the Function's old signature still works
    for a, b in zip(plain, explicit, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(three_args, plain[0])
    assert relative_error(run(x, weight, grad, **GEMMA)[0], plain[0]) > 0.1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offset": float("nan")}, r"rms_norm: offset must be a finite number, got nan; pass 0\.0 .* or 1\.0"),
        ({"offset": "1"}, r"rms_norm: offset must be a finite number, got '1'"),
        ({"cast_before_weight": None}, r"rms_norm: cast_before_weight must be True or False, got None"),
    ],
    ids=["nan-offset", "str-offset", "none-cast"],
)
def test_bad_variant_raises(kernel_path, kwargs, message):
    x = torch.ones((2, 64), device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=message):
        rms_norm(x, torch.ones(64, device=KERNEL_DEVICE), **kwargs)


def test_fp32_llama_norm_on_the_cpu_is_one_fused_call_bit_identical(gen, monkeypatch):
    # torch's fused RMSNorm forward (one call instead of six) where it is bit for bit Llama's: fp32 x and weight.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if rms_norm_module._FUSED_RMS_NORM is None:
        pytest.skip("this torch has no torch._fused_rms_norm (added in 2.8): the six-op reference runs")
    calls = []
    fused = rms_norm_module._FUSED_RMS_NORM
    monkeypatch.setattr(rms_norm_module, "_FUSED_RMS_NORM", lambda *args: calls.append(1) or fused(*args))
    monkeypatch.setattr(rms_norm_module, "_PLANS", {})
    module = LlamaRMSNorm(123, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(random_tensor((123,), torch.float32, gen))
    with dispatch.force_reference():
        for dtype in (torch.float32, torch.float16):
            x = random_tensor((2, 67, 123), dtype, gen)
            assert torch.equal(rms_norm(x, module.weight.to(dtype), 1e-6), module.to(dtype)(x))
            module.float()
    assert len(calls) == 1  # fp16 keeps the reference's rounding


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-residual"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_backward_folds_the_residual_gradient_bitwise(kernel_path, gen, dtype, strided):
    """The decoder-layer node hands the residual stream's gradient to the norm's backward kernel: dX comes out as the
    separate `dx.add_(residual)` would make it, bit for bit, on each path."""
    from fastft.kernels.rms_norm import _backward, _forward

    x = random_tensor((37, 96), dtype, gen)
    weight = random_tensor((96,), dtype, gen)
    dy = random_tensor((37, 96), dtype, gen)
    residual = random_tensor((96, 37), dtype, gen).t() if strided else random_tensor((37, 96), dtype, gen)
    _, rstd = _forward(x, weight, 1e-6, 0.0, True)

    expected, expected_dw = _backward(dy, x, weight, rstd, 0.0, True, True, True)
    expected = expected.add_(residual)
    folded, dw = _backward(dy, x, weight, rstd, 0.0, True, True, True, residual)

    assert torch.equal(folded, expected) and torch.equal(dw, expected_dw)
    assert not torch.equal(folded, _backward(dy, x, weight, rstd, 0.0, True, True, False)[0])
