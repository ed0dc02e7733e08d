"""NF4 dequantisation (Triton and torch paths) bit-identical to bitsandbytes, and the frozen 4-bit linear."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.nf4 import (
    NF4_CODE,
    NF4LinearFunction,
    dequantize_nf4,
    dequantize_nf4_reference,
    nf4_linear,
)


def _bnb_torch_dequantize(*args, **kwargs):
    """bitsandbytes' pure-torch backend, un-compiled: the oracle for layouts its native CPU kernel gets wrong (below).

    Imported here, not at module level: the name is bitsandbytes 0.50's, and the version lanes collect this file
    with older releases installed (they run only the lane-marked tests).
    """
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    return getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)(*args, **kwargs)


# [out, in, blocksize]: round shapes; in < blocksize; in a multiple of 16 but not of the blocksize (576 / 256);
# odd in (rows straddle bytes, out*in not a multiple of the blocksize); an odd value count (a padding nibble);
# blocksize 32, and 4096 (one short block).
DEQUANT_CASES = [
    (48, 64, 64),
    (48, 64, 128),
    (27, 64, 64),
    (192, 576, 64),
    (192, 576, 256),
    (96, 123, 64),
    (96, 123, 128),
    (7, 9, 64),
    (5, 100, 32),
    (3, 5, 4096),
]


def _quantize(shape, dtype, gen, *, blocksize=64, nested=False, quant_type="nf4"):
    weight = random_tensor(shape, dtype, gen)
    packed, quant_state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type
    )
    return weight, packed, quant_state


def _bnb_native_is_wrong(packed, quant_state) -> bool:
    """bitsandbytes 0.50.2's AVX-512 CPU dequantize_4bit indexes absmax per row.

    That kernel runs when ``in`` is a multiple of 16, and treats every row as starting a new block, which is only
    true when ``in`` is a multiple of the blocksize: otherwise it scales most values by the wrong block (relative
    error 0.2-0.25 against the source weight instead of NF4's ~0.1). Its scalar fallback, pure-torch backend and CUDA
    kernels index the flat weight, which is what quantize_4bit wrote.
    """
    in_features, blocksize = quant_state.shape[1], quant_state.blocksize
    return packed.device.type == "cpu" and in_features % 16 == 0 and in_features % blocksize != 0 and blocksize < 2048


def _bnb_torch_backend(packed, quant_state):
    absmax = quant_state.absmax
    if quant_state.nested:
        absmax = bnb_functional.dequantize_blockwise(quant_state.absmax, quant_state.state2)
        absmax += quant_state.offset
    code = bnb_functional.get_4bit_type("nf4", device=packed.device)
    return _bnb_torch_dequantize(
        packed.reshape(-1), absmax.float(), code, quant_state.blocksize, quant_state.shape, quant_state.dtype
    )


def _bnb_public(packed, quant_state):
    # An odd in sends bitsandbytes to its torch.compile'd backend; compiling it costs seconds per dtype here.
    with torch.compiler.set_stance("force_eager"):
        return bnb_functional.dequantize_4bit(packed, quant_state)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_features, in_features, blocksize", DEQUANT_CASES)
def test_dequantize_bit_identical_to_bitsandbytes(
    kernel_path, gen, out_features, in_features, blocksize, dtype, nested
):
    weight, packed, quant_state = _quantize((out_features, in_features), dtype, gen, blocksize=blocksize, nested=nested)
    assert packed.dtype == torch.uint8 and packed.shape == ((out_features * in_features + 1) // 2, 1)

    dense = dequantize_nf4(packed, quant_state)

    assert dense.shape == (out_features, in_features) and dense.dtype == dtype
    assert not dense.requires_grad
    assert torch.equal(dense, _bnb_torch_backend(packed, quant_state))
    if not _bnb_native_is_wrong(packed, quant_state):
        assert torch.equal(dense, _bnb_public(packed, quant_state))
    # Independent of bitsandbytes: the values are the source weight up to NF4's quantisation error.
    assert relative_error(dense, weight) < 0.2
    assert torch.equal(dequantize_nf4_reference(packed, quant_state), dense)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_dtype_argument_rounds_the_fp32_value_once(kernel_path, gen, out_dtype):
    _, packed, quant_state = _quantize((33, 128), torch.float32, gen, nested=True)
    exact = _bnb_public(packed, quant_state)  # fp32: the product itself

    dense = dequantize_nf4(packed, quant_state, dtype=out_dtype)

    assert dense.dtype == out_dtype
    assert torch.equal(dense, exact.to(out_dtype))
    # bitsandbytes' bf16 output of the same weight is the same single rounding.
    quant_state.dtype = out_dtype
    assert torch.equal(dense, _bnb_public(packed, quant_state))


def test_nf4_code_table_is_bitsandbytes_table():
    table = bnb_functional.get_4bit_type("nf4", device="cpu")
    assert torch.equal(torch.tensor(NF4_CODE, dtype=torch.float32), table)


def test_quant_storage_other_than_uint8(kernel_path, gen):
    weight = random_tensor((40, 64), torch.float16, gen)
    packed, quant_state = bnb_functional.quantize_4bit(weight, quant_type="nf4", quant_storage=torch.bfloat16)
    assert packed.dtype == torch.bfloat16

    assert torch.equal(dequantize_nf4(packed, quant_state), _bnb_public(packed, quant_state))


def _params4bit(weight, *, nested=True):
    return bnb.nn.Params4bit(
        weight, requires_grad=False, quant_type="nf4", compress_statistics=nested, blocksize=64
    ).to(KERNEL_DEVICE)


def test_quant_state_taken_from_params4bit(kernel_path, gen):
    param = _params4bit(random_tensor((24, 128), torch.float32, gen))
    assert param.dtype == torch.uint8 and param.quant_state is not None

    dense = dequantize_nf4(param)

    assert torch.equal(dense, dequantize_nf4(param.data, param.quant_state))
    assert torch.equal(dense, _bnb_public(param.data, param.quant_state))


# nf4_linear: [out, in, blocksize, nested]; the second has an odd in and out*in not a multiple of the blocksize.
LINEAR_CASES = [(48, 64, 64, True), (96, 123, 128, False)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("lead", [(1,), (67,), (2, 3)], ids=["1tok", "67tok", "2x3"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("out_features, in_features, blocksize, nested", LINEAR_CASES)
def test_nf4_linear_against_float64(
    kernel_path, gen, out_features, in_features, blocksize, nested, dtype, lead, with_bias
):
    _, packed, quant_state = _quantize((out_features, in_features), dtype, gen, blocksize=blocksize, nested=nested)
    x = random_tensor((*lead, in_features), dtype, gen).requires_grad_()
    bias = random_tensor((out_features,), dtype, gen).requires_grad_() if with_bias else None
    grad_out = random_tensor((*lead, out_features), dtype, gen)

    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = nf4_linear(x, packed, quant_state, bias)
    out.backward(grad_out)

    # The reference: the exact fp32 weight values, in float64, with the same rounded inputs.
    weight64 = dequantize_nf4_reference(packed, quant_state, dtype=torch.float32).double()
    x64, grad64 = x.detach().double(), grad_out.double()
    out64 = x64 @ weight64.T + (bias.detach().double() if with_bias else 0.0)
    assert out.dtype == dtype and out.shape == (*lead, out_features)
    assert relative_error(out, out64) < TOLERANCE[dtype]
    assert x.grad.dtype == dtype
    assert relative_error(x.grad, grad64 @ weight64) < TOLERANCE[dtype]
    if with_bias:
        assert bias.grad.dtype == dtype
        assert relative_error(bias.grad, grad64.reshape(-1, out_features).sum(0)) < TOLERANCE[dtype]
    # Frozen base: no gradient for the packed bytes, and nothing of the dense weight's size kept for backward.
    assert packed.grad is None
    assert all(not t.is_floating_point() and t.numel() * t.element_size() < out_features * in_features for t in saved)


def test_nf4_linear_gradient_only_where_required(kernel_path, gen):
    _, packed, quant_state = _quantize((32, 64), torch.float32, gen)
    x = random_tensor((5, 64), torch.float32, gen)
    bias = random_tensor((32,), torch.float32, gen).requires_grad_()
    grad_out = random_tensor((5, 32), torch.float32, gen)

    NF4LinearFunction.apply(x, packed, quant_state, bias).backward(grad_out)
    assert x.grad is None
    assert relative_error(bias.grad, grad_out.double().sum(0)) < TOLERANCE[torch.float32]

    x.requires_grad_()
    frozen_bias = bias.detach()
    nf4_linear(x, packed, quant_state, frozen_bias).backward(grad_out)
    weight64 = dequantize_nf4_reference(packed, quant_state).double()
    assert relative_error(x.grad, grad_out.double() @ weight64) < TOLERANCE[torch.float32]
    assert frozen_bias.grad is None


def test_nf4_linear_with_params4bit(kernel_path, gen):
    param = _params4bit(random_tensor((40, 72), torch.float32, gen))
    x = random_tensor((3, 72), torch.float32, gen).requires_grad_()

    grad_out = random_tensor((3, 40), torch.float32, gen)

    out = nf4_linear(x, param)
    out.backward(grad_out)

    weight64 = _bnb_public(param.data, param.quant_state).double()
    assert relative_error(out, x.detach().double() @ weight64.T) < TOLERANCE[torch.float32]
    assert relative_error(x.grad, grad_out.double() @ weight64) < TOLERANCE[torch.float32]
    assert param.grad is None and not param.requires_grad


# Errors ------------------------------------------------------------------------------------------------------------


def test_params4bit_that_lost_its_quant_state_is_refused(gen):
    param = _params4bit(random_tensor((24, 128), torch.float32, gen))
    rebuilt = torch.nn.Parameter(param.data, requires_grad=False)
    assert getattr(rebuilt, "quant_state", None) is None

    with pytest.raises(ShapeContractError, match=r"dequantize_nf4: .*\[1536, 1\] with no quant_state.*nn\.Parameter"):
        dequantize_nf4(rebuilt)
    with pytest.raises(ShapeContractError, match=r"dequantize_nf4_reference: .*no quant_state"):
        dequantize_nf4_reference(param.detach())
    with pytest.raises(ShapeContractError, match=r"nf4_linear: .*no quant_state.*DataParallel"):
        nf4_linear(random_tensor((2, 128), torch.float32, gen), rebuilt)


def test_wrong_packed_byte_count_is_refused(gen):
    _, packed, quant_state = _quantize((48, 64), torch.float32, gen)
    with pytest.raises(
        ShapeContractError,
        match=r"dequantize_nf4: quant_state.shape \[48, 64\] needs 1536 packed bytes.*"
        r"shape \[1535, 1\]",
    ):
        dequantize_nf4(packed[:-1], quant_state)
    # A dense weight is not a packed one.
    with pytest.raises(ShapeContractError, match=r"needs 1536 packed bytes.*torch.float32 tensor of shape \[48, 64\]"):
        dequantize_nf4(random_tensor((48, 64), torch.float32, gen), quant_state)


def test_absmax_of_another_weight_is_refused(gen):
    _, packed, quant_state = _quantize((48, 64), torch.float32, gen)
    _, _, other_state = _quantize((24, 64), torch.float32, gen)
    quant_state.absmax = other_state.absmax
    with pytest.raises(
        ShapeContractError, match=r"absmax must hold one scale per block of 64 values, expected \[48\].*\[24\]"
    ):
        dequantize_nf4(packed, quant_state)


def test_fp4_is_refused(gen):
    _, packed, quant_state = _quantize((48, 64), torch.float32, gen, quant_type="fp4")
    with pytest.raises(ShapeContractError, match=r"dequantize_nf4: expected an NF4 weight.*'fp4'.*FP4 is not"):
        dequantize_nf4(packed, quant_state)


def test_bitsandbytes_cpu_inference_repack_is_refused(gen):
    # What Linear4bit.forward does on an AVX512-BF16 CPU in eval mode with an input that does not require grad.
    _, packed, quant_state = _quantize((64, 64), torch.float32, gen, nested=True)
    repacked, repacked_state = bnb_functional._convert_weight_packed_for_cpu(packed.cpu(), quant_state)
    assert repacked.numel() == packed.numel()  # same byte count: only the flag tells the layouts apart
    with pytest.raises(ShapeContractError, match=r"dequantize_nf4: .*packing_format_for_cpu.*_inverse"):
        dequantize_nf4(repacked, repacked_state)


def test_nf4_linear_wrong_input_width_is_refused(gen):
    _, packed, quant_state = _quantize((48, 64), torch.float32, gen)
    with pytest.raises(
        ShapeContractError,
        match=r"nf4_linear: x must be \[\.\.\., in_features\] = \[\.\.\., 64\].*\[48, 64\].*\[3, 63\]",
    ):
        nf4_linear(random_tensor((3, 63), torch.float32, gen), packed, quant_state)
    with pytest.raises(ShapeContractError, match=r"nf4_linear: bias must be \[out_features\] = \[48\].*\[64\]"):
        nf4_linear(random_tensor((3, 64), torch.float32, gen), packed, quant_state, torch.zeros(64))


def test_unsupported_dtype_is_refused(gen):
    _, packed, quant_state = _quantize((48, 64), torch.float32, gen)
    with pytest.raises(TypeError, match=r"dequantize_nf4: .*float32, float16 or bfloat16, got torch.float64"):
        dequantize_nf4(packed, quant_state, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"nf4_linear: x must be float32.*torch.float64"):
        nf4_linear(torch.ones(2, 64, dtype=torch.float64), packed, quant_state)
