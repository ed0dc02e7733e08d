"""tests/interpreter_speed.py: Triton's interpreter patches triton.language once per launch, not once per program, and
the kernels compute what they did (the kernel tests check the numbers; this checks the patching is in place)."""

from __future__ import annotations

import pytest
import torch
from interpreter_speed import install

from fastft.kernels import dispatch
from fastft.kernels.rms_norm import rms_norm, rms_norm_reference


@pytest.mark.parametrize("rows", [4, 32])
def test_a_launch_patches_the_language_a_fixed_number_of_times_whatever_its_grid(rows, monkeypatch):
    from triton.runtime import interpreter

    # conftest installed it under TRITON_INTERPRET=1; a triton whose interpreter it cannot patch fails here, by name.
    assert install() is True
    assert dispatch.use_triton(torch.empty(0))
    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, **k: calls.append(1) or original(*a, **k))
    x, weight = torch.randn(rows, 64), torch.randn(64)
    with torch.no_grad():
        out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6))
    # One program per row, each calling tl.sum (a @triton.jit device function). With the once-per-launch patching a
    # launch patches about ten module namespaces (the kernel's modules, then the device function's), whatever its grid;
    # without it every program patched six more (28 for 4 rows, 196 for 32, measured with triton 3.9).
    assert 0 < len(calls) <= 16, len(calls)
