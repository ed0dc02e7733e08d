"""fastft.measure: saved-for-backward bytes, FLOP counts, matmul rate and peak RSS."""

from __future__ import annotations

import math

import torch

from fastft.measure import (
    SavedTensorBytes,
    count_flops,
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
