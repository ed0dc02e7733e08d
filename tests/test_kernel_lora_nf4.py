"""``FASTFT_NF4_DEQUANT=kernel``: the fused LoRA GEMM decoding NF4 tiles inside its K loop (a frozen base bias in
its epilogue), against float64 and against the default reused-buffer path."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DTYPES, random_tensor
from test_kernel_lora import (
    HIDDEN,
    NO_BIAS,
    QWEN2_BIAS,
    make_projection,
    mlp_projections,
    mlp_reference,
    o_reference,
    qkv_projections,
    qkv_reference,
    run_and_compare,
)

from fastft.kernels import dispatch
from fastft.kernels.lora_mlp import lora_mlp
from fastft.kernels.lora_o import lora_o
from fastft.kernels.lora_projection import NF4_DEQUANT_ENV, nf4_dequant_mode
from fastft.kernels.lora_qkv import lora_qkv


@pytest.fixture
def in_kernel(monkeypatch):
    monkeypatch.setenv(NF4_DEQUANT_ENV, "kernel")
    assert nf4_dequant_mode() == "kernel"


@pytest.mark.parametrize("biases", [NO_BIAS, QWEN2_BIAS], ids=["no-bias", "qwen2-bias"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("nf4", ["params4bit-nested", "params4bit-plain", "quantize_4bit"])
def test_qkv_decoded_in_the_kernel_matches_float64(in_kernel, kernel_path, gen, dtype, nf4, biases):
    projections = qkv_projections(dtype, gen, [(4, 2.0), None, (2, 0.5)], nf4=(nf4,) * 3, biases=biases)
    x = random_tensor((2, 19, HIDDEN), dtype, gen).requires_grad_()
    run_and_compare(lora_qkv, qkv_reference, x, projections, dtype, gen)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_o_with_rows_that_straddle_bytes_and_blocks(in_kernel, kernel_path, gen, dtype):
    # in = 45: odd, so a byte holds the last value of one row and the first of the next; 64-value blocks cross rows.
    o = make_projection(30, 45, dtype, gen, (3, 2.0), nf4="params4bit-nested")
    run_and_compare(lora_o, o_reference, random_tensor((37, 45), dtype, gen).requires_grad_(), [o], dtype, gen)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_mlp_decoded_in_the_kernel_matches_float64(in_kernel, kernel_path, gen, dtype):
    mlp = mlp_projections(dtype, gen, [(2, 0.5), (4, 1.0), (1, 3.0)], nf4=("params4bit-nested",) * 3)
    run_and_compare(lora_mlp, mlp_reference, random_tensor((37, HIDDEN), dtype, gen).requires_grad_(), mlp, dtype, gen)


def test_both_decodings_give_the_same_outputs(gen, monkeypatch):
    dtype = torch.float32
    # q unbiased, k and v biased: both kernels mask q's bias off and add the others in the epilogue.
    projections = qkv_projections(
        dtype, gen, [(4, 2.0), (4, 1.0), (2, 0.5)], nf4=("params4bit-nested",) * 3, biases=(False, True, True)
    )
    x = random_tensor((37, HIDDEN), dtype, gen)
    outputs = {}
    for mode in ("buffer", "kernel"):
        monkeypatch.setenv(NF4_DEQUANT_ENV, mode)
        with dispatch.poison_outputs(), torch.no_grad():
            assert dispatch.use_triton(x)
            outputs[mode] = lora_qkv(x, *projections)
    for buffered, decoded in zip(outputs["buffer"], outputs["kernel"], strict=True):
        # The same decoded values and the same tiling: only the order of the fp32 sums could differ.
        assert torch.allclose(buffered, decoded, rtol=1e-6, atol=1e-6)


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(NF4_DEQUANT_ENV, "inline")
    with pytest.raises(ValueError, match="FASTFT_NF4_DEQUANT must be 'buffer' or 'kernel', got 'inline'"):
        nf4_dequant_mode()
