"""The kernel layer's own rules: tensors only, dispatch switches, poisoned allocation, a life without triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fastft.kernels as kernels
from fastft.kernels import dispatch

PUBLIC = [
    "rms_norm",
    "apply_rope",
    "swiglu",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "dequantize_nf4",
    "nf4_linear",
]


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_every_kernel_is_exported_with_a_docstring():
    for name in PUBLIC:
        function = getattr(kernels, name)
        assert callable(function), name
        assert function.__doc__ and "Args:" in function.__doc__, f"{name} needs a Google-style docstring"
        assert name in kernels.__all__


def test_kernel_layer_imports_no_transformers_or_peft(tmp_path):
    result = _python(
        """
        import sys
        import fastft.kernels
        leaked = sorted(name for name in ("transformers", "peft", "trl", "bitsandbytes") if name in sys.modules)
        print("leaked:", leaked)
        assert not leaked, leaked
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dispatch_switches():
    # CPU tensors take Triton only through the interpreter: on in the CPU runs (conftest sets TRITON_INTERPRET=1), off
    # in the compiled GPU runs (bench/gpu_check.sh sets 0). CUDA tensors take it wherever triton is installed.
    probes = {"cpu": torch.empty(0)}
    if torch.cuda.is_available():
        probes["cuda"] = torch.empty(0, device="cuda")
    for device, probe in probes.items():
        takes_triton = dispatch.INTERPRETED if device == "cpu" else dispatch.HAS_TRITON
        assert dispatch.use_triton(probe) == takes_triton, device
        with dispatch.force_reference():
            assert not dispatch.use_triton(probe), device
        assert dispatch.use_triton(probe) == takes_triton, device


def test_disable_switch_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("FASTFT_DISABLE_TRITON", "1")
    assert not dispatch.use_triton(torch.empty(0))


def test_poisoned_allocation_only_inside_the_block():
    with dispatch.poison_outputs():
        floats = dispatch.empty((3, 5), dtype=torch.float16, device="cpu")
        ints = dispatch.empty((4,), dtype=torch.int32, device="cpu")
    assert torch.isnan(floats).all()
    assert (ints == -1).all()
    # outside the block the allocator is plain torch.empty again (no fill pass on the hot path)
    filled = []
    original = torch.Tensor.fill_
    try:
        torch.Tensor.fill_ = lambda self, value: filled.append(value) or original(self, value)
        dispatch.empty((2,), dtype=torch.float32, device="cpu")
    finally:
        torch.Tensor.fill_ = original
    assert filled == []


def test_switches_hold_on_other_threads_while_open():
    # Autograd runs a CUDA backward on a device thread of its own: a block opened on the main thread must reach the
    # kernels that backward calls (the H100 run's "reference" tests went through Triton there while this was
    # thread-local).
    seen = {}

    def probe(key: str) -> None:
        seen[key] = (
            dispatch._forced_reference(),
            bool(torch.isnan(dispatch.empty((2,), dtype=torch.float32, device="cpu")).all()),
        )

    with dispatch.force_reference(), dispatch.poison_outputs():
        with dispatch.force_reference():  # nested blocks: the outer one still holds after the inner one closes
            pass
        worker = threading.Thread(target=probe, args=("inside",))
        worker.start()
        worker.join()
    worker = threading.Thread(target=probe, args=("after",))
    worker.start()
    worker.join()
    assert seen["inside"] == (True, True)
    assert seen["after"][0] is False


def test_mark_overwritten_makes_other_saved_uses_fail():
    x = torch.randn(4, requires_grad=True)
    y = x * 1
    z = y * y  # saves y
    dispatch.mark_overwritten(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_without_triton_every_kernel_imports_and_runs_its_reference(tmp_path):
    result = _python(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError, as on an install without it
        import torch
        import fastft.kernels as k
        from fastft.kernels import dispatch
        assert not dispatch.HAS_TRITON and not dispatch.use_triton(torch.empty(0))
        x = torch.randn(3, 10, requires_grad=True)
        w = torch.randn(10, requires_grad=True)
        k.rms_norm(x, w).sum().backward()
        assert x.grad is not None and w.grad is not None
        print("ok")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
