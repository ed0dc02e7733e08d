"""torch.compile of small functions around RMSNorm, RoPE, SwiGLU and GeGLU: no graph break, each kernel one
custom-op node forward and backward (on the torch-reference path: plain aten ops, or the op where asked), outputs and
gradients equal to eager, and shape errors raised while compiling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import KERNEL_DEVICE, random_tensor, relative_error
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from fastft.kernels import apply_rope, geglu, rms_norm, swiglu
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.geglu import geglu_backward, geglu_backward_
from fastft.kernels.swiglu import swiglu_backward, swiglu_backward_
from fastft.kernels.traced_reference import opaque_reference

BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 2, 5, 32, 4, 2, 16, 40
POSITIONS = [[0, 1, 2, 0, 1], [7, 8, 9, 10, 11]]  # a packed first row: positions restart mid-row


@dataclass(frozen=True)
class Case:
    """A function using one kernel, the names of its op pair, how to make its inputs, and whether the torch-reference
    path traces it as plain torch (tables gathered by position_ids stay in the op, which range-checks the ids)."""

    fn: Callable[..., torch.Tensor]
    op: str
    inputs: Callable[[torch.Generator], tuple]
    traced_on_reference: bool = True


def norm_llama(x, weight):
    return rms_norm(x * 2.0, weight, 1e-5) * 3.0


def norm_gemma(x, weight):
    return rms_norm(x.tanh(), weight, 1e-6, offset=1.0, cast_before_weight=False)


def _project(x, wq, wk):
    q = (x @ wq).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
    k = (x @ wk).view(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2)
    return q, k


def rope_gathered(x, wq, wk, cos, sin):
    q, k = apply_rope(*_project(x, wq, wk), cos, sin)
    return q.sum(1) + 2.0 * k.sum(1)


def rope_inplace(x, wq, wk, cos, sin):
    q, k = apply_rope(*_project(x, wq, wk), cos, sin, inplace=True)
    return q.sum(1) + 2.0 * k.sum(1)


def rope_tables(x, wq, wk, cos, sin):
    position_ids = torch.tensor(POSITIONS, device=x.device)
    q, k = apply_rope(*_project(x, wq, wk), cos, sin, position_ids=position_ids)
    return q.sum(1) + 2.0 * k.sum(1)


def mlp_swiglu(x, wg, wu):
    return swiglu(x @ wg, x @ wu)


def mlp_geglu(x, wg, wu):
    return geglu(x @ wg, x @ wu)


def _leaves(gen, *shapes, frozen=()):
    return tuple(
        random_tensor(shape, torch.float32, gen).requires_grad_(i not in frozen) for i, shape in enumerate(shapes)
    )


def _rope_inputs(gen, table_rows=None):
    x, wq, wk = _leaves(gen, (BATCH, SEQ, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM))
    shape = (table_rows, HEAD_DIM) if table_rows else (1, SEQ, HEAD_DIM)
    return x, wq, wk, random_tensor(shape, torch.float32, gen), random_tensor(shape, torch.float32, gen)


def _mlp_inputs(gen):
    return _leaves(gen, (BATCH, SEQ, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER))


CASES = {
    "rms_norm-llama": Case(norm_llama, "rms_norm", lambda gen: _leaves(gen, (BATCH, SEQ, HIDDEN), (HIDDEN,))),
    # LoRA training: the norm's weight is frozen, so the backward op computes no dW.
    "rms_norm-gemma-frozen-weight": Case(
        norm_gemma, "rms_norm", lambda gen: _leaves(gen, (BATCH, SEQ, HIDDEN), (HIDDEN,), frozen=(1,))
    ),
    "rope-gathered": Case(rope_gathered, "rope", _rope_inputs),
    "rope-inplace": Case(rope_inplace, "rope", _rope_inputs),
    "rope-position_ids": Case(rope_tables, "rope", lambda gen: _rope_inputs(gen, table_rows=12), False),
    "swiglu": Case(mlp_swiglu, "swiglu", _mlp_inputs),
    "geglu": Case(mlp_geglu, "geglu", _mlp_inputs),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own graph; no cached graph or recompile budget carries over from another test.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(fn, inputs):
    out = fn(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    grad_out = torch.linspace(-1.0, 1.0, out.numel(), device=out.device).view(out.shape)
    return out.detach(), torch.autograd.grad(out, wanted, grad_out)


def _graph_targets(fn, inputs) -> tuple[set[str], set[str]]:
    """The call targets of the forward and backward graphs AOTAutograd builds for fn."""
    graphs: list[set[str]] = []

    def record(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return make_boxed_func(gm)

    _run(torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True), inputs)
    forward, backward = graphs
    return forward, backward


@pytest.mark.parametrize("name", CASES)
def test_no_graph_break_and_one_node_each_way(kernel_path, gen, name):
    case = CASES[name]
    inputs = case.inputs(gen)
    explained = torch._dynamo.explain(case.fn)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    forward, backward = _graph_targets(case.fn, inputs)
    if kernel_path == "reference" and case.traced_on_reference:
        # Traced as aten ops the compiler can fuse (fastft.kernels.traced_reference), not as an opaque Python op.
        assert not [target for target in forward | backward if target.startswith("fastft.")], forward | backward
        torch._dynamo.reset()
        with opaque_reference():
            forward, backward = _graph_targets(case.fn, inputs)
    assert f"fastft.{case.op}.default" in forward
    assert f"fastft.{case.op}_backward.default" in backward
    # Nothing of the kernel was traced through: its aten ops stay inside the op.
    assert f"fastft.{case.op}_backward.default" not in forward


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", CASES)
def test_compiled_equals_eager(kernel_path, gen, name, backend):
    case = CASES[name]
    inputs = case.inputs(gen)
    eager_out, eager_grads = _run(case.fn, inputs)
    out, grads = _run(torch.compile(case.fn, backend=backend, fullgraph=True), inputs)
    # Inductor may fuse the elementwise ops around the kernel differently: equal within fp32 rounding.
    assert relative_error(out, eager_out) < 1e-6
    for got, wanted in zip(grads, eager_grads, strict=True):
        assert relative_error(got, wanted) < 1e-6


@pytest.mark.parametrize("gate", [swiglu, geglu], ids=["swiglu", "geglu"])
def test_compiled_gate_backward_writes_nothing_in_place(kernel_path, gen, gate):
    gate_leaf, up_leaf = _leaves(gen, (6, INTER), (6, INTER))

    def backward_through(fn):
        gate_in, up_in = gate_leaf * 1.0, up_leaf * 1.0  # intermediates: the buffers eager overwrites
        before = gate_in.detach().clone(), up_in.detach().clone()
        out = fn(gate_in, up_in)
        grads = torch.autograd.grad(out, (gate_leaf, up_leaf), torch.ones_like(out))
        return grads, torch.equal(gate_in.detach(), before[0]) and torch.equal(up_in.detach(), before[1])

    eager_grads, eager_untouched = backward_through(gate)
    compiled_grads, compiled_untouched = backward_through(torch.compile(gate, backend="aot_eager", fullgraph=True))
    # Eager writes the gradients over its intermediate inputs; a compiled graph's backward op allocates instead.
    assert not eager_untouched and compiled_untouched
    for got, wanted in zip(compiled_grads, eager_grads, strict=True):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize(
    ("in_place", "out_of_place"),
    [(swiglu_backward_, swiglu_backward), (geglu_backward_, geglu_backward)],
    ids=["swiglu", "geglu"],
)
def test_out_of_place_gate_backward_matches_in_place(kernel_path, gen, in_place, out_of_place):
    dh, gate, up = (random_tensor((7, 300), torch.float32, gen, scale=2.0) for _ in range(3))
    gate0, up0 = gate.clone(), up.clone()
    d_gate, d_up = out_of_place(dh, gate, up)
    assert torch.equal(gate, gate0) and torch.equal(up, up0)  # inputs untouched
    written_gate, written_up = in_place(dh, gate, up)
    assert written_gate.data_ptr() == gate.data_ptr() and written_up.data_ptr() == up.data_ptr()
    assert torch.equal(d_gate, written_gate) and torch.equal(d_up, written_up)


def _bad_norm():
    return rms_norm, (torch.ones(2, 8, device=KERNEL_DEVICE), torch.ones(7, device=KERNEL_DEVICE)), r"\[7\]"


def _bad_gate():
    gate, up = torch.ones(2, 8, device=KERNEL_DEVICE), torch.ones(2, 9, device=KERNEL_DEVICE)
    return swiglu, (gate, up), r"gate \[2, 8\] and up \[2, 9\]"


def _bad_positions():
    def rotate(q, k, cos, sin, position_ids):
        return apply_rope(q, k, cos, sin, position_ids=position_ids)

    q, k = torch.ones(1, 2, 3, 8, device=KERNEL_DEVICE), torch.ones(1, 1, 3, 8, device=KERNEL_DEVICE)
    cos = sin = torch.ones(4, 8, device=KERNEL_DEVICE)
    # Data, not shapes: found when the compiled graph runs the op.
    return rotate, (q, k, cos, sin, torch.tensor([[0, 1, 9]], device=KERNEL_DEVICE)), r"from 0 to 9"


@pytest.mark.parametrize("build", [_bad_norm, _bad_gate, _bad_positions], ids=["norm", "gate", "positions"])
def test_compiled_calls_raise_the_eager_errors(build):
    fn, args, message = build()
    with pytest.raises(ShapeContractError, match=message):
        torch.compile(fn, backend="aot_eager")(*args)
