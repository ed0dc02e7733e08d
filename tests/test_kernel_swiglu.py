"""SwiGLU: gradients through the gate reach the projections that made gate and up, in either layout. What SwiGLU
shares with GeGLU (output and gradients against float64, the in-place backward) is in ``tests/test_kernel_gates.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

from fastft.kernels.swiglu import swiglu


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["separate", "fused-chunk"])
def test_gradients_reach_the_projections(kernel_path, gen, dtype, layout):
    tokens, hidden, inter = 7, 24, 40
    x0 = random_tensor((tokens, hidden), dtype, gen)
    wg0 = random_tensor((hidden, inter), dtype, gen, scale=hidden**-0.5)
    wu0 = random_tensor((hidden, inter), dtype, gen, scale=hidden**-0.5)
    dh = random_tensor((tokens, inter), dtype, gen)

    def mlp(x, wg, wu):
        if layout == "separate":
            return x @ wg, x @ wu
        # One [hidden, 2 * inter] projection split on the last dim: non-contiguous views, copied privately.
        return (x @ torch.cat([wg, wu], dim=1)).chunk(2, dim=-1)

    x, wg, wu = (t.clone().requires_grad_() for t in (x0, wg0, wu0))
    gate, up = mlp(x, wg, wu)
    assert gate.is_contiguous() == (layout == "separate")
    swiglu(gate, up).backward(dh)

    x64, wg64, wu64 = (t.double().requires_grad_() for t in (x0, wg0, wu0))
    gate64, up64 = mlp(x64, wg64, wu64)
    (F.silu(gate64) * up64).backward(dh.double())
    assert relative_error(x.grad, x64.grad) < TOLERANCE[dtype]
    assert relative_error(wg.grad, wg64.grad) < TOLERANCE[dtype]
    assert relative_error(wu.grad, wu64.grad) < TOLERANCE[dtype]
