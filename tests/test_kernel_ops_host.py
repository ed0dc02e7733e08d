"""What an eager call of RMSNorm, RoPE, SwiGLU or GeGLU costs the host: the autograd.Function (not the custom-op
dispatcher), shape checks once per signature, a bounded number of aten ops on the CPU reference path (what the host
benchmark counts), and no host sync on the default path."""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from conftest import random_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from fastft.bench.operators import OperatorMode
from fastft.kernels import apply_rope, custom_ops, dispatch, geglu, rms_norm, swiglu
from fastft.kernels.errors import ShapeContractError

rms_norm_module = importlib.import_module("fastft.kernels.rms_norm")
rope_module = importlib.import_module("fastft.kernels.rope")
# RoPE's contract checks and their per-signature cache (split out of rope.py).
rope_checks_module = importlib.import_module("fastft.kernels.rope_checks")


class RawOps(TorchDispatchMode):
    """Every op that reaches the mode as called: below autograd a composite ``to`` arrives whole, even one that only
    returns its input (a dispatch all the same), which OperatorMode would count as nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class OpCounter(OperatorMode, RawOps):
    """Counts every op that reaches the dispatcher below autograd as the host benchmark counts it (a composite as its
    parts)."""

    __torch_dispatch__ = RawOps.__torch_dispatch__


def _activations(gen, *shapes):
    # Non-leaf tensors, as a layer's inputs are (a gate kernel writes its gradients over such buffers).
    return [random_tensor(shape, torch.float32, gen).requires_grad_() * 1.0 for shape in shapes]


def norm_case(gen, frozen_weight=False):
    (x,) = _activations(gen, (1, 16, 64))
    weight = random_tensor((64,), torch.float32, gen).requires_grad_(not frozen_weight)
    return (lambda: (rms_norm(x, weight, 1e-6),)), [x] + ([] if frozen_weight else [weight])


def rope_case(gen):
    # The host benchmark's shapes: q / k as transposes of [batch, seq, heads, head_dim], gathered cos / sin.
    q_rows, k_rows = _activations(gen, (1, 16, 4, 16), (1, 16, 2, 16))
    q, k = q_rows.transpose(1, 2), k_rows.transpose(1, 2)
    cos, sin = random_tensor((1, 16, 16), torch.float32, gen), random_tensor((1, 16, 16), torch.float32, gen)
    return (lambda: apply_rope(q, k, cos, sin)), [q, k]


def gate_case(gen, gate):
    gate_in, up_in = _activations(gen, (16, 128), (16, 128))
    return (lambda: (gate(gate_in, up_in),)), [gate_in, up_in]


# (builder, grad_fn class of the output, aten ops per forward + backward today on the fp32 reference path).
CASES = {
    "rms_norm": (norm_case, "RMSNormFunctionBackward", 14),
    "rms_norm-frozen-weight": (lambda gen: norm_case(gen, frozen_weight=True), "RMSNormFunctionBackward", 12),
    "apply_rope": (rope_case, "RoPEFunctionBackward", 23),
    "swiglu": (lambda gen: gate_case(gen, swiglu), "SwiGLUFunctionBackward", 6),
    "geglu": (lambda gen: gate_case(gen, geglu), "GeGLUFunctionBackward", 6),
}


def _forward_backward(call: Callable[[], tuple], inputs: list[torch.Tensor]) -> tuple[tuple, Counter[str]]:
    """The outputs of one forward and backward, and the aten ops they ran (the upstream gradients' excluded)."""
    with OpCounter() as forward:
        outputs = call()
    grads = [torch.ones_like(out) for out in outputs]
    with OpCounter() as backward:
        torch.autograd.grad(outputs, inputs, grads)
    return outputs, forward.ops + backward.ops


@pytest.mark.parametrize("name", CASES)
def test_eager_calls_take_the_function_and_few_aten_ops(gen, name):
    build, grad_fn, budget = CASES[name]
    call, inputs = build(gen)
    with dispatch.force_reference():
        _forward_backward(call, inputs)  # the first call of this signature: its checks run here, not below
        outputs, ops = _forward_backward(call, inputs)

    assert all(type(out.grad_fn).__name__ == grad_fn for out in outputs)
    # Eager never pays the custom-op dispatcher (about 3x an autograd.Function's cost per call).
    assert not [op for op in ops if op.startswith("fastft.")]
    # Nothing that depends only on shapes and dtypes (torch.promote_types is an aten op), and no host sync.
    assert "aten.promote_types.default" not in ops
    assert "aten._local_scalar_dense.default" not in ops
    # A budget, not a target: a change that adds an op to the hot path has to say why here.
    assert sum(ops.values()) <= budget, ops


@pytest.mark.parametrize("name", CASES)
def test_without_grad_the_forward_runs_without_a_node(gen, monkeypatch, name):
    # Checkpointing's first forward, trl's reference pass: no graph is recorded, so the Function's C++ apply (which
    # would build a node and drop it) is skipped; the values are the recorded call's, the ops the same.
    build, _, _ = CASES[name]
    call, inputs = build(gen)
    contexts = []

    class Counted(custom_ops._Unrecorded):
        def __init__(self, count: int) -> None:
            contexts.append(count)
            super().__init__(count)

    monkeypatch.setattr(custom_ops, "_Unrecorded", Counted)
    with dispatch.force_reference():
        recorded = call()
        assert not contexts
        with torch.no_grad(), OpCounter() as unrecorded_ops:
            unrecorded = call()
        assert len(contexts) == 1  # the forward ran on the context that keeps nothing
        with OpCounter() as recorded_ops:
            call()
    assert all(out.grad_fn is None and not out.requires_grad for out in unrecorded)
    assert all(torch.equal(a, b) for a, b in zip(recorded, unrecorded, strict=True))
    assert unrecorded_ops.ops == recorded_ops.ops


def test_without_grad_an_in_place_forward_still_bumps_versions(gen):
    q, k = (random_tensor(shape, torch.float32, gen) for shape in ((1, 2, 3, 8), (1, 1, 3, 8)))
    cos, sin = random_tensor((1, 3, 8), torch.float32, gen), random_tensor((1, 3, 8), torch.float32, gen)
    versions = q._version, k._version
    with torch.no_grad():
        rotated = apply_rope(q, k, cos, sin, inplace=True)
    assert rotated[0] is q and rotated[1] is k
    assert (q._version, k._version) == (versions[0] + 1, versions[1] + 1)


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_rms_norm_checks_once_per_signature(gen, monkeypatch):
    monkeypatch.setattr(rms_norm_module, "_PLANS", {})
    calls = _counting(monkeypatch, rms_norm_module, "_check_shapes")
    weight = random_tensor((64,), torch.float32, gen)
    for rows in (3, 3, 3, 5, 5):
        rms_norm(random_tensor((rows, 64), torch.float32, gen), weight)
    assert len(calls) == 2
    rms_norm(random_tensor((5, 64), torch.float32, gen), weight, offset=1.0, cast_before_weight=False)
    assert len(calls) == 3  # another variant is another signature


def test_rope_checks_once_per_signature_but_positions_every_call(gen, monkeypatch):
    monkeypatch.setattr(rope_checks_module, "_CHECKED", set())
    calls = _counting(monkeypatch, rope_checks_module, "_check")
    q, k = random_tensor((1, 2, 3, 8), torch.float32, gen), random_tensor((1, 1, 3, 8), torch.float32, gen)
    cos, sin = random_tensor((4, 8), torch.float32, gen), random_tensor((4, 8), torch.float32, gen)
    apply_rope(q, k, cos, sin, position_ids=torch.tensor([[0, 1, 2]]))
    apply_rope(q, k, cos, sin, position_ids=torch.tensor([[1, 2, 3]]))
    assert len(calls) == 1
    # The same signature with positions past the tables: the data check is not cached.
    with pytest.raises(ShapeContractError, match=r"position_ids in \[0, 4\).*from 2 to 4"):
        apply_rope(q, k, cos, sin, position_ids=torch.tensor([[2, 3, 4]]))


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        ({}, {"cast_before_weight": 1}, r"cast_before_weight must be True or False, got 1"),
        ({"offset": 1.0}, {"offset": True}, r"offset must be a finite number, got True"),
        ({}, {"offset": [1.0]}, r"offset must be a finite number, got \[1\.0\]"),
    ],
    ids=["one-is-not-true", "true-is-not-one", "unhashable-offset"],
)
def test_signature_cache_never_lets_a_bad_variant_through(gen, first, second, message):
    # True == 1 and hash(True) == hash(1): a key without the types would hand the bad call a good call's plan.
    x, weight = random_tensor((2, 64), torch.float32, gen), random_tensor((64,), torch.float32, gen)
    rms_norm(x, weight, **first)
    with pytest.raises(ValueError, match=message):
        rms_norm(x, weight, **second)


def test_bad_shapes_raise_on_every_call(gen):
    x = random_tensor((2, 64), torch.float32, gen)
    for _ in range(2):  # a failed check is never remembered as passed
        with pytest.raises(ShapeContractError, match=r"weight has shape \[63\]"):
            rms_norm(x, random_tensor((63,), torch.float32, gen))


def _norm_of_rows(gen, rows: int) -> None:
    rms_norm(random_tensor((rows, 64), torch.float32, gen), random_tensor((64,), torch.float32, gen))


def _rope_of_seq(gen, seq: int) -> None:
    q, k = random_tensor((1, 2, seq, 8), torch.float32, gen), random_tensor((1, 1, seq, 8), torch.float32, gen)
    cos, sin = random_tensor((1, seq, 8), torch.float32, gen), random_tensor((1, seq, 8), torch.float32, gen)
    apply_rope(q, k, cos, sin)


@pytest.mark.parametrize(
    ("module", "cache", "limit", "call"),
    [
        (rms_norm_module, "_PLANS", "_MAX_PLANS", _norm_of_rows),
        (rope_checks_module, "_CHECKED", "_MAX_CHECKED", _rope_of_seq),
    ],
    ids=["rms_norm", "rope"],
)
def test_signature_caches_are_bounded(gen, monkeypatch, module, cache, limit, call):
    monkeypatch.setattr(module, cache, type(getattr(module, cache))())
    monkeypatch.setattr(module, limit, 3)
    for length in range(1, 9):  # a run whose sequence length changes every step
        call(gen, length)
        assert len(getattr(module, cache)) <= 3


def test_a_counting_mode_sees_a_composite_op_below_autograd_as_its_parts():
    """Inside below_autograd(), linear / reshape / to reach a dispatch mode whole; an OperatorMode sees the parts
    they run, the same as outside (what keeps the host benchmark's operator counts comparable)."""
    x, weight = torch.randn(4, 8), torch.randn(3, 8, requires_grad=True)

    def calls():
        torch.nn.functional.linear(x, weight)
        x.reshape(2, 16)
        x.to(torch.float64)
        torch.ops.aten.silu_backward(x, x)  # a composite with a CPU kernel of its own: that kernel runs, one op

    with torch.no_grad(), OpCounter() as outside:
        calls()
    with torch.no_grad(), custom_ops.below_autograd(), OpCounter() as inside:
        calls()
    assert inside.ops == outside.ops
    assert {"aten.t.default", "aten.mm.default", "aten.view.default", "aten._to_copy.default"} <= inside.ops.keys()
    assert inside.ops["aten.silu_backward.default"] == 1
    assert not {"aten.linear.default", "aten.reshape.default", "aten.to.dtype"} & inside.ops.keys()


def _flag_inside_backward() -> list[bool]:
    """Whether a math_backward body runs with ADInplaceOrView (and the autograd keys before it) skipped."""
    seen: list[bool] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        @custom_ops.math_backward
        def backward(ctx, grad):
            seen.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView))
            return grad * 2.0

    x = torch.ones(3, requires_grad=True)
    (grad,) = torch.autograd.grad(Probe.apply(x).sum(), [x])
    assert torch.equal(grad, torch.full((3,), 2.0))
    return seen


def test_a_math_backward_runs_below_autograd_and_without_torch_s_guard_as_before(monkeypatch):
    """The guard is torch private API: should a torch drop it, the same math runs through every key."""
    assert _flag_inside_backward() == [True]
    monkeypatch.setattr(custom_ops, "_BELOW", None)
    assert _flag_inside_backward() == [False]


def _kernel_functions() -> list[type]:
    import fastft.kernels  # noqa: F401  (imports every kernel module)

    found, stack = [], list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        if cls.__module__.startswith("fastft.kernels.") and "backward" in cls.__dict__:
            found.append(cls)
    return found


def test_every_kernel_backward_is_straight_line_math_below_autograd():
    """Each kernel Function's backward runs in below_autograd() (math_backward); the fused decoder layer guards its
    two blocks itself, around the attention it differentiates (tests/test_fused_layer.py checks it)."""
    functions = _kernel_functions()
    names = {cls.__name__ for cls in functions}
    assert {"RMSNormFunction", "RoPEFunction", "SwiGLUFunction", "LoRAMLPFunction", "LoRAQKVRoPEFunction"} <= names
    own_blocks = {"LoRADecoderLayerFunction"}
    unguarded = [
        cls.__name__
        for cls in functions
        if cls.__name__ not in own_blocks and not getattr(cls.__dict__["backward"].__func__, "below_autograd", False)
    ]
    assert not unguarded


@pytest.mark.parametrize("name", CASES)
def test_a_second_backward_gives_the_same_gradients_or_fails_loudly(gen, name):
    """Below autograd an in-place write bumps no version by itself: a backward that writes over what it saved bumps
    them explicitly, so retain_graph=True and a second backward either repeat the gradients or raise."""
    build, _, _ = CASES[name]
    call, inputs = build(gen)
    with dispatch.force_reference():
        outputs = call()
        grads = [torch.ones_like(out) for out in outputs]
        first = torch.autograd.grad(outputs, inputs, grads, retain_graph=True)
        try:
            second = torch.autograd.grad(outputs, inputs, grads)
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error)
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_kernel_backward_under_torch_checkpoint_recomputes_with_autograd_on(gen):
    """torch.utils.checkpoint (non-reentrant) recomputes the forward when a backward unpacks its saved tensors: that
    unpack happens before the math goes below autograd, so the recompute records (and saves) what the forward did."""
    x = random_tensor((16, 64), torch.float32, gen).requires_grad_()
    w = random_tensor((64, 64), torch.float32, gen).requires_grad_()
    weight = random_tensor((64,), torch.float32, gen).requires_grad_()

    def block(inp):
        return rms_norm(torch.nn.functional.silu(inp @ w), weight, 1e-6)

    with dispatch.force_reference():
        expected = torch.autograd.grad(block(x).sum(), [x, w, weight])
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        actual = torch.autograd.grad(out.sum(), [x, w, weight])
    for a, e in zip(actual, expected, strict=True):
        assert torch.allclose(a, e, rtol=1e-6, atol=1e-6)


GATE_PATHS = {
    "swiglu": (
        importlib.import_module("fastft.kernels.swiglu"),
        "swiglu_forward",
        "swiglu_backward_",
        "swiglu_backward_with_hidden",
        "aten.silu.default",
    ),
    "geglu": (
        importlib.import_module("fastft.kernels.geglu"),
        "geglu_forward",
        "geglu_backward_",
        "geglu_backward_with_hidden",
        "aten.gelu.default",
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", GATE_PATHS)
def test_the_gates_torch_path_casts_only_what_needs_it_and_activates_once_for_h(gen, name, dtype):
    """In fp32 the torch path dispatches no cast at all (a same-dtype ``.to()`` still costs a dispatch); in bf16 it
    still casts. The backward that also returns h forms act(gate) once, for h and d up alike, and matches the forward
    and the plain backward bit for bit."""
    module, forward, backward_, with_hidden, activation = GATE_PATHS[name]
    gate, up, dh = (random_tensor((16, 128), torch.float32, gen).to(dtype) for _ in range(3))
    with dispatch.force_reference(), custom_ops.below_autograd():
        expected_h = getattr(module, forward)(gate.clone(), up.clone())
        expected_dgate, expected_dup = getattr(module, backward_)(dh, gate.clone(), up.clone())
        with RawOps() as seen:
            h, dgate, dup = getattr(module, with_hidden)(dh, gate.clone(), up.clone(), True)
        with RawOps() as forward_seen:
            getattr(module, forward)(gate, up)
    assert torch.equal(h, expected_h) and torch.equal(dgate, expected_dgate) and torch.equal(dup, expected_dup)
    assert seen.ops[activation] == 1 and forward_seen.ops[activation] == 1
    casts = seen.ops["aten.to.dtype"] + forward_seen.ops["aten.to.dtype"]
    assert casts == 0 if dtype == torch.float32 else casts > 0


def test_a_group_takes_its_adapters_columns_of_xa_with_one_split(gen):
    """q | k | v with LoRA on q and v only: one split_with_sizes gives each adapter its columns of X Aᵀ (no slice per
    adapter), and every output is the base GEMM plus its own adapter's term."""
    lora_math = importlib.import_module("fastft.kernels.lora_math")
    spec = lora_math.Spec("qkv", [64, 32, 32], [64, 64, 64], [8, None, 4], [2.0, 1.0, 0.5], [False] * 3)
    x = random_tensor((16, 64), torch.float32, gen)
    weights = [random_tensor((width, 64), torch.float32, gen) for width in (64, 32, 32)]
    lora_a = [random_tensor((rank, 64), torch.float32, gen) for rank in (8, 4)]
    lora_b = [random_tensor((width, rank), torch.float32, gen) for width, rank in ((64, 8), (32, 4))]
    xa = x @ torch.cat(lora_a).t()
    for accumulate in (False, True):
        with custom_ops.below_autograd(), RawOps() as seen:
            q, k, v = lora_math._dense(spec, x, weights, xa, lora_b, None, accumulate)
        assert seen.ops["aten.split_with_sizes.default"] == 1 and seen.ops["aten.slice.Tensor"] == 0
        torch.testing.assert_close(q, x @ weights[0].t() + 2.0 * (x @ lora_a[0].t()) @ lora_b[0].t())
        torch.testing.assert_close(k, x @ weights[1].t())
        torch.testing.assert_close(v, x @ weights[2].t() + 0.5 * (x @ lora_a[1].t()) @ lora_b[1].t())
