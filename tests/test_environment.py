"""fastft.bench.environment: the device in words and as a file-name part."""

from __future__ import annotations

import torch

from fastft.bench.environment import describe_device, device_slug


def test_device_slug_names_results_files():
    assert device_slug(describe_device(torch.device("cpu"), threads=2)) == "cpu"
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("NVIDIA H200 (MIG 1g.18gb)") == "nvidia-h200-mig-1g-18gb"
