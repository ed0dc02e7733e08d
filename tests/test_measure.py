"""fastft.measure: saved-for-backward bytes, FLOP counts, matmul rate and peak RSS."""

from __future__ import annotations

import math
import subprocess
import sys

import torch

from fastft.measure import SavedTensorBytes, count_flops, matmul_rate


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


def test_peak_rss_sees_a_large_allocation(tmp_path):
    # In a fresh process: the test process's own high-water mark is already above anything allocated here. The
    # baseline is the resident size just before the allocation (the high-water mark may be above it already).
    script = (
        "import torch\n"
        "from fastft.measure import peak_rss_bytes\n"
        "status = open('/proc/self/status').read().split('VmRSS:')[1]\n"
        "resident = int(status.split()[0]) * 1024\n"
        "block = torch.ones(64 << 20)\n"  # 256 MiB, written so every page is resident
        "print(resident, peak_rss_bytes(), block.nbytes)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    resident, peak, allocated = map(int, result.stdout.split())
    assert resident + allocated <= peak <= resident + 2 * allocated
