"""The custom ops of RMSNorm, RoPE, SwiGLU and GeGLU: their schemas, and ``torch.library.opcheck`` of each (schema:
no undeclared mutation or aliasing; autograd registration; fake implementation against the real one; AOTAutograd
tracing of forward and backward against eager), on the torch reference and through the Triton interpreter."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import KERNEL_DEVICE, random_tensor

from fastft.kernels.custom_ops import registered_ops

# The package exports functions under the modules' names, so the attribute lookup would find the function.
rms_norm = importlib.import_module("fastft.kernels.rms_norm")
rope = importlib.import_module("fastft.kernels.rope")
swiglu = importlib.import_module("fastft.kernels.swiglu")
geglu = importlib.import_module("fastft.kernels.geglu")

SCHEMAS = {
    "rms_norm": "fastft::rms_norm(Tensor x, Tensor weight, float eps, float offset, bool cast_before_weight) "
    "-> (Tensor, Tensor)",
    "rms_norm_backward": "fastft::rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd, float offset, "
    "bool cast_before_weight, bool needs_dx, bool needs_dw) -> (Tensor, Tensor)",
    "rope": "fastft::rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids) -> (Tensor, Tensor)",
    "rope_backward": "fastft::rope_backward(Tensor? grad_q, Tensor? grad_k, Tensor cos, Tensor sin, "
    "Tensor? position_ids) -> (Tensor, Tensor)",
    **{name: f"fastft::{name}(Tensor gate, Tensor up) -> Tensor" for name in ("swiglu", "geglu")},
    **{
        f"{name}_backward": f"fastft::{name}_backward(Tensor dh, Tensor gate, Tensor up, bool needs_gate, "
        "bool needs_up) -> (Tensor, Tensor)"
        for name in ("swiglu", "geglu")
    },
}


def test_every_small_kernel_registers_a_forward_and_a_backward_op():
    assert set(SCHEMAS) <= {name.split("::")[1] for name in registered_ops()}
    for name, schema in SCHEMAS.items():
        assert str(getattr(torch.ops.fastft, name).default._schema) == schema


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.requires_grad_()


def rms_norm_case(gen, *, layout="contiguous", dtype=torch.float32, weight_dtype=None, offset=0.0, cast=True):
    shape = (3, 5, 24) if layout == "contiguous" else (3, 24, 5)
    x = random_tensor(shape, dtype, gen)
    x = _grad(x if layout == "contiguous" else x.transpose(1, 2))  # a transpose is a leaf view here
    weight = _grad(random_tensor((24,), weight_dtype or dtype, gen))
    return rms_norm.rms_norm_op, (x, weight, 1e-6, offset, cast)


def rms_norm_backward_case(gen, *, needs_dx=True, needs_dw=True, offset=0.0, cast=True):
    x = random_tensor((2, 7, 24), torch.float16, gen)
    weight = random_tensor((24,), torch.float32, gen)
    out, rstd = rms_norm.rms_norm_op(x, weight, 1e-6, offset, cast)
    dy = random_tensor(out.shape, out.dtype, gen)
    return rms_norm.rms_norm_backward_op, (dy, x, weight, rstd, offset, cast, needs_dx, needs_dw)


def _qk(gen, dtype=torch.float32):
    # transformers' layout: transposes of [batch, seq, heads, head_dim].
    q = random_tensor((2, 5, 4, 16), dtype, gen).transpose(1, 2)
    k = random_tensor((2, 5, 2, 16), dtype, gen).transpose(1, 2)
    return q, k


def rope_case(gen, *, tables=False, dtype=torch.float32):
    q, k = (_grad(t) for t in _qk(gen, dtype))
    if not tables:
        cos, sin = random_tensor((1, 5, 16), torch.float32, gen), random_tensor((1, 5, 16), torch.float32, gen)
        return rope.rope_op, (q, k, cos, sin, None)
    cos, sin = random_tensor((12, 16), torch.float32, gen), random_tensor((12, 16), torch.float32, gen)
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [7, 8, 9, 10, 11]], device=KERNEL_DEVICE)
    return rope.rope_op, (q, k, cos, sin, position_ids)


def rope_backward_case(gen, *, present=("q", "k")):
    grad_q, grad_k = _qk(gen)
    cos, sin = random_tensor((2, 5, 16), torch.float32, gen), random_tensor((2, 5, 16), torch.float32, gen)
    grads = (grad_q if "q" in present else None, grad_k if "k" in present else None)
    return rope.rope_backward_op, (*grads, cos, sin, None)


def gate_case(gen, *, module, strided=False, dtype=torch.float32):
    width = 80 if strided else 40
    gate, up = (random_tensor((6, width), dtype, gen, scale=2.0) for _ in range(2))
    if strided:  # every other column: non-contiguous inputs
        gate, up = gate[:, ::2], up[:, ::2]
    ops = module.swiglu_op if module is swiglu else module.geglu_op
    return ops, (_grad(gate), _grad(up))


def gate_backward_case(gen, *, module, needs_gate=True, needs_up=True):
    dh, gate, up = (random_tensor((6, 40), torch.float32, gen, scale=2.0) for _ in range(3))
    op = module.swiglu_backward_op if module is swiglu else module.geglu_backward_op
    return op, (dh, gate, up, needs_gate, needs_up)


def _case(builder, case_id, **kwargs):
    return pytest.param(lambda gen: builder(gen, **kwargs), id=case_id)


CASES = [
    _case(rms_norm_case, "rms_norm-llama"),
    _case(rms_norm_case, "rms_norm-gemma-transposed", layout="transposed", offset=1.0, cast=False),
    _case(rms_norm_case, "rms_norm-fp16-fp32-weight", dtype=torch.float16, weight_dtype=torch.float32),
    _case(rms_norm_backward_case, "rms_norm_backward-dx-dw"),
    _case(rms_norm_backward_case, "rms_norm_backward-dx", needs_dw=False),
    _case(rms_norm_backward_case, "rms_norm_backward-dw-gemma", needs_dx=False, offset=1.0, cast=False),
    _case(rope_case, "rope-gathered"),
    _case(rope_case, "rope-gathered-fp16", dtype=torch.float16),
    _case(rope_case, "rope-tables-position_ids", tables=True),
    _case(rope_backward_case, "rope_backward"),
    _case(rope_backward_case, "rope_backward-k-only", present=("k",)),
    *[
        case
        for module, name in ((swiglu, "swiglu"), (geglu, "geglu"))
        for case in (
            _case(gate_case, name, module=module),
            _case(gate_case, f"{name}-strided-fp16", module=module, strided=True, dtype=torch.float16),
            _case(gate_backward_case, f"{name}_backward", module=module),
            _case(gate_backward_case, f"{name}_backward-up-only", module=module, needs_gate=False),
        )
    ],
]


@pytest.mark.parametrize("build", CASES)
def test_opcheck(kernel_path, gen, build):
    op, args = build(gen)
    # Inside torch.compile's session flag (what torch.compiler.is_compiling() reads), as a real compile would be:
    # opcheck's AOTAutograd test then traces the registered backward through the backward op, as torch.compile
    # does, instead of tracing the eager implementation (which cannot launch a Triton kernel on fake tensors).
    with torch.compiler._compile_session_context():
        torch.library.opcheck(op, args)
