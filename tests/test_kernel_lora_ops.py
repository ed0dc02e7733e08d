"""LoRAGroup and LoRAMLP (checked once, applied per call) and their custom ops: the same outputs and gradients as the
public functions and as float64, the same errors at construction, opcheck on every op, and torch.compile without a
graph break, dense and NF4."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, CastCounter, random_tensor, relative_error
from test_kernel_lora import (
    HIDDEN,
    INTERMEDIATE,
    KV_OUT,
    NO_BIAS,
    Q_OUT,
    QWEN2_BIAS,
    Reference,
    activations,
    make_projection,
    mlp_projections,
    nbytes,
    qkv_projections,
    run_and_compare,
    saved_during,
)

from fastft.bench.operators import OperatorMode
from fastft.kernels import (
    LoRAGroup,
    LoRAMLP,
    LoRAWeights,
    dispatch,
    gemm_tuner,
    lora_gate_up_mlp,
    lora_mlp,
    lora_o,
    lora_packed_qkv,
    lora_qkv,
)
from fastft.kernels.lora_group import lora_group_backward_op, lora_group_op
from fastft.kernels.lora_mlp import LoRAMLPFunction
from fastft.kernels.lora_mlp_math import backward_op as mlp_backward_op
from fastft.kernels.lora_mlp_math import op as mlp_op
from fastft.kernels.lora_projection import function_inputs

WIDTHS = (Q_OUT, KV_OUT, KV_OUT)
QKV_NAMES = ("q_proj", "k_proj", "v_proj")


def qkv_group(projections: Sequence[LoRAWeights]) -> LoRAGroup:
    return LoRAGroup("lora_qkv", QKV_NAMES, projections, "qkv")


def mlp_group(projections: Sequence[LoRAWeights], activation: str = "silu") -> LoRAMLP:
    *gate_up, down = projections
    if len(gate_up) == 2:
        first = LoRAGroup("lora_mlp", ("gate_proj", "up_proj"), gate_up, "gate_up")
    else:
        first = LoRAGroup("lora_gate_up_mlp", ("gate_up_proj",), gate_up, "gate_up")
    return LoRAMLP(first, LoRAGroup("lora_mlp", ("down_proj",), [down], "down"), activation)


def silu_mlp64(ref: Reference, x64: torch.Tensor) -> torch.Tensor:
    if len(ref.weights) == 3:
        hidden = F.silu(ref.project(0, x64)) * ref.project(1, x64)
    else:
        gate, up = ref.project(0, x64).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    return ref.project(len(ref.weights) - 1, hidden)


class Kind:
    """One way to use the fused projections: its projections, the group built over them, the public function, and
    the float64 expression (over :class:`Reference`)."""

    def __init__(self, in_features, projections, group, function, reference):
        self.in_features, self.projections, self.group, self.function, self.reference = (
            in_features,
            projections,
            group,
            function,
            reference,
        )


def _packed_qkv(dtype, gen, nf4, biases):
    return [make_projection(sum(WIDTHS), HIDDEN, dtype, gen, (6, 1.5), nf4=nf4, bias=biases[0])]


def _gate_up(dtype, gen, nf4, biases):
    return [
        make_projection(2 * INTERMEDIATE, HIDDEN, dtype, gen, (3, 0.5), nf4=nf4, bias=biases[0]),
        make_projection(HIDDEN, INTERMEDIATE, dtype, gen, (2, 2.0), nf4=nf4, bias=biases[2]),
    ]


KINDS = {
    # GQA widths, a different rank per projection.
    "qkv": Kind(
        HIDDEN,
        lambda dtype, gen, nf4, biases: qkv_projections(
            dtype, gen, [(8, 2.0), (1, 0.5), (4, 1.5)], nf4=(nf4,) * 3, biases=biases
        ),
        lambda ps: qkv_group(ps),
        lora_qkv,
        lambda ref: [ref.project(i, ref.x) for i in range(3)],
    ),
    # k without an adapter between two with one.
    "qkv-no-k-adapter": Kind(
        HIDDEN,
        lambda dtype, gen, nf4, biases: qkv_projections(
            dtype, gen, [(4, 0.25), None, (2, 3.0)], nf4=(nf4,) * 3, biases=biases
        ),
        lambda ps: qkv_group(ps),
        lora_qkv,
        lambda ref: [ref.project(i, ref.x) for i in range(3)],
    ),
    "o": Kind(
        Q_OUT,
        lambda dtype, gen, nf4, biases: [make_projection(HIDDEN, Q_OUT, dtype, gen, (5, 2.0), nf4=nf4, bias=biases[0])],
        lambda ps: LoRAGroup("lora_o", ("o_proj",), ps, "o"),
        lora_o,
        lambda ref: [ref.project(0, ref.x)],
    ),
    "packed-qkv": Kind(
        HIDDEN,
        _packed_qkv,
        lambda ps: LoRAGroup("lora_packed_qkv", ("qkv_proj",), ps, "qkv", split=WIDTHS),
        lambda x, qkv: lora_packed_qkv(x, qkv, WIDTHS),
        lambda ref: list(ref.project(0, ref.x).split(list(WIDTHS), dim=-1)),
    ),
    "mlp": Kind(
        HIDDEN,
        lambda dtype, gen, nf4, biases: mlp_projections(
            dtype, gen, [(4, 2.0), (1, 0.5), (8, 1.25)], nf4=(nf4,) * 3, biases=biases
        ),
        lambda ps: mlp_group(ps),
        lora_mlp,
        lambda ref: [silu_mlp64(ref, ref.x)],
    ),
    "gate-up-mlp": Kind(
        HIDDEN,
        _gate_up,
        lambda ps: mlp_group(ps),
        lora_gate_up_mlp,
        lambda ref: [silu_mlp64(ref, ref.x)],
    ),
}


def as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def outputs_and_grads(
    call: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
    x: torch.Tensor,
    projections: Sequence[LoRAWeights],
    grads: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Every output, then dX, then dA and dB of each projection with an adapter, from fresh gradients."""
    leaves = [t for p in projections for t in (p.lora_a, p.lora_b) if t is not None]
    for t in (x, *leaves):
        t.grad = None
    outputs = as_tuple(call(x))
    torch.autograd.backward(outputs, list(grads))
    return [out.detach().clone() for out in outputs] + [t.grad for t in (x, *leaves)]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("base", ["dense", "params4bit-nested"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_group_matches_float64_and_the_public_function(kernel_path, gen, dtype, kind, base, bias):
    case = KINDS[kind]
    projections = case.projections(dtype, gen, base, QWEN2_BIAS if bias else NO_BIAS)
    group = case.group(projections)
    x = random_tensor((2, 19, case.in_features), dtype, gen).requires_grad_()

    def call(x: torch.Tensor, *_: LoRAWeights) -> tuple[torch.Tensor, ...]:
        # A packed projection's outputs are views of one [..., 120] output (run_and_compare wants contiguous ones).
        return tuple(out.contiguous() for out in as_tuple(group(x))) if kind == "packed-qkv" else group(x)

    outputs = run_and_compare(call, case.reference, x, projections, dtype, gen)

    grads = [random_tensor(out.shape, dtype, gen) for out in outputs]
    fused = outputs_and_grads(group, x, projections, grads)
    expected = outputs_and_grads(lambda t: case.function(t, *projections), x, projections, grads)
    assert len(fused) == len(expected)
    for got, want in zip(fused, expected, strict=True):
        assert got is not None and torch.equal(got, want)


def test_group_saves_x_and_xa_only_and_sees_adapter_updates(gen):
    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(8, 2.0), (1, 0.5), (4, 1.0)], biases=QWEN2_BIAS)
    group = qkv_group(projections)
    x = random_tensor((37, HIDDEN), dtype, gen).requires_grad_()

    outputs, saved = saved_during(lambda: group(x))

    assert nbytes(activations(saved, projections)) == (x.numel() + 37 * 13) * x.element_size()
    assert all(t.data_ptr() != out.data_ptr() for t in saved for out in outputs)
    # An optimizer updates A and B in place: the next call reads the new values, nothing is cached.
    with torch.no_grad():
        projections[1].lora_b.mul_(3.0)
        again = group(x)
    assert torch.equal(again[1], lora_qkv(x, *projections)[1]) and not torch.equal(again[1], outputs[1])


def test_group_forward_and_backward_copy_and_detach_nothing(gen):
    class Ops(OperatorMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(8, 2.0), (8, 0.5), (8, 1.0)])
    group = qkv_group(projections)
    x = random_tensor((1, 16, HIDDEN), dtype, gen).requires_grad_()
    group(x)  # the GEMM choice is made (and recorded) on the first call
    with dispatch.force_reference(), Ops() as forward:
        outputs = group(x)
    with dispatch.force_reference(), Ops() as backward:
        torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])
    for ops in (forward.ops, backward.ops):
        assert not {"_to_copy", "clone", "copy_", "contiguous", "mul", "mul_"} & set(ops), ops
    assert "detach" not in forward.ops
    # Only autograd's own accumulation of the 7 leaf gradients (x, 3 A's, 3 B's) may detach.
    assert backward.ops["detach"] <= 7
    assert forward.ops["cat"] == 1 and sum(forward.ops.values()) <= 22, forward.ops


def test_the_gemm_choice_is_made_once_per_key_and_recorded(gen, monkeypatch):
    calls = []
    choose = gemm_tuner.choose

    def counted(group, x, *args, **kwargs):
        calls.append((group, x.shape[0]))
        return choose(group, x, *args, **kwargs)

    monkeypatch.setattr(gemm_tuner, "choose", counted)
    monkeypatch.delenv(gemm_tuner.GEMM_ENV, raising=False)
    # The report names the torch matmul as what it is on the device: the CPU's, or cuBLAS on a GPU.
    matmul = "torch matmul" if KERNEL_DEVICE == "cpu" else "cublas"
    projections = qkv_projections(torch.float32, gen, [(2, 1.0), None, (2, 1.0)])
    group = qkv_group(projections)
    with dispatch.force_reference():
        for tokens in (5, 7, 8):  # one bucket of rows: M <= 8
            group(random_tensor((tokens, HIDDEN), torch.float32, gen))
        assert calls == [("qkv", 5)]
        group(random_tensor((9, HIDDEN), torch.float32, gen))
        assert len(calls) == 2
        gemm_tuner.reset()
        group(random_tensor((9, HIDDEN), torch.float32, gen))
        assert len(calls) == 3 and gemm_tuner.by_group()["qkv"].startswith(f"{matmul} (")
    with gemm_tuner.force("cublas"):
        group(random_tensor((9, HIDDEN), torch.float32, gen))
    assert len(calls) == 4 and gemm_tuner.by_group()["qkv"] == f"{matmul} (FASTFT_GEMM=cublas)"


@pytest.mark.parametrize("kind", ["mlp", "gate-up-mlp"])
def test_the_legacy_mlp_function_form_still_trains(gen, kind):
    # LoRAMLPFunction.apply(x, projections, activation, W..., A..., B...): the form older callers use.
    case = KINDS[kind]
    projections = case.projections(torch.float32, gen, "dense", NO_BIAS)
    if kind == "mlp":
        projections = _at(projections, 1, lora_a=None, lora_b=None)  # up without an adapter
    x = random_tensor((2, 19, HIDDEN), torch.float32, gen).requires_grad_()
    grads = [random_tensor((2, 19, HIDDEN), torch.float32, gen)]

    def legacy(t: torch.Tensor) -> torch.Tensor:
        return LoRAMLPFunction.apply(t, tuple(projections), "gelu_tanh", *function_inputs(projections))

    got = outputs_and_grads(legacy, x, projections, grads)
    want = outputs_and_grads(lambda t: case.function(t, *projections, activation="gelu_tanh"), x, projections, grads)
    for a, b in zip(got, want, strict=True):
        assert a is not None and torch.equal(a, b)


# Errors ------------------------------------------------------------------------------------------------------------


def _at(projections, index, **changes):
    projections = list(projections)
    projections[index] = replace(projections[index], **changes)
    return projections


def _trainable(projection: LoRAWeights, what: str) -> LoRAWeights:
    return replace(projection, **{what: getattr(projection, what).clone().requires_grad_()})


def _packed_4bit(gen):
    return qkv_projections(torch.float32, gen, [(2, 1.0)] * 3, nf4=("params4bit-nested",) * 3)


# (kind, projections from (dtype, gen, nf4, biases) -> the bad ones, activation). Taken from test_kernel_lora's
# shape-contract tests, plus the checks those leave out.
BAD = {
    "qkv k A [1, 47]": ("qkv", lambda ps, g: _at(ps, 1, lora_a=torch.zeros(1, HIDDEN - 1)), "silu"),
    "qkv v B [24, 3]": ("qkv", lambda ps, g: _at(ps, 2, lora_b=torch.zeros(KV_OUT, 3)), "silu"),
    "qkv k bias [72]": ("qkv", lambda ps, g: _at(ps, 1, bias=torch.zeros(Q_OUT)), "silu"),
    "qkv q bias [1, 72]": ("qkv", lambda ps, g: _at(ps, 0, bias=torch.zeros(1, Q_OUT)), "silu"),
    "qkv v bias int64": ("qkv", lambda ps, g: _at(ps, 2, bias=torch.zeros(KV_OUT, dtype=torch.int64)), "silu"),
    "qkv v bias a list": ("qkv", lambda ps, g: _at(ps, 2, bias=[0.0] * KV_OUT), "silu"),
    "qkv k weight int32": (
        "qkv",
        lambda ps, g: _at(ps, 1, weight=torch.zeros(KV_OUT, HIDDEN, dtype=torch.int32)),
        "silu",
    ),
    "qkv q only lora_a": ("qkv", lambda ps, g: _at(ps, 0, lora_b=None), "silu"),
    "qkv k infinite scale": ("qkv", lambda ps, g: _at(ps, 1, scale=float("inf")), "silu"),
    "qkv nf4 k B [25, 2]": ("qkv", lambda ps, g: _at(_packed_4bit(g), 1, lora_b=torch.zeros(KV_OUT + 1, 2)), "silu"),
    "qkv nf4 lost quant_state": (
        "qkv",
        lambda ps, g: _at(
            _packed_4bit(g), 0, weight=torch.nn.Parameter(_packed_4bit(g)[0].weight.data, requires_grad=False)
        ),
        "silu",
    ),
    "o A [5, 48]": ("o", lambda ps, g: _at(ps, 0, lora_a=torch.zeros(5, HIDDEN)), "silu"),
    "o B [48, 1]": ("o", lambda ps, g: _at(ps, 0, lora_b=torch.zeros(HIDDEN, 1)), "silu"),
    "mlp up A [1, 80]": ("mlp", lambda ps, g: _at(ps, 1, lora_a=torch.zeros(1, INTERMEDIATE)), "silu"),
    "mlp down B [48, 5]": ("mlp", lambda ps, g: _at(ps, 2, lora_b=torch.zeros(HIDDEN, 5)), "silu"),
    "mlp up weight [81, 48]": (
        "mlp",
        lambda ps, g: _at(ps, 1, weight=torch.zeros(INTERMEDIATE + 1, HIDDEN), lora_a=None, lora_b=None),
        "silu",
    ),
    "mlp down weight [48, 81]": (
        "mlp",
        lambda ps, g: _at(ps, 2, weight=torch.zeros(HIDDEN, INTERMEDIATE + 1), lora_a=None, lora_b=None),
        "silu",
    ),
    "mlp activation relu": ("mlp", lambda ps, g: ps, "relu"),
    "gate-up-mlp odd rows": (
        "gate-up-mlp",
        lambda ps, g: _at(ps, 0, weight=torch.zeros(2 * INTERMEDIATE + 1, HIDDEN), lora_a=None, lora_b=None),
        "silu",
    ),
    "gate-up-mlp down reads [.., 81]": (
        "gate-up-mlp",
        lambda ps, g: _at(ps, 1, weight=torch.zeros(HIDDEN, INTERMEDIATE + 1), lora_a=None, lora_b=None),
        "silu",
    ),
    "packed-qkv widths [72, 24, 25]": (
        "packed-qkv",
        lambda ps, g: _at(ps, 0, weight=torch.zeros(121, HIDDEN), lora_a=None, lora_b=None),
        "silu",
    ),
}


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda gen: random_tensor(shape, torch.float64, gen).to(dtype)


# Cases only a call can see: x, and grad mode with a trainable base weight or bias (then inference still runs).
# (kind, projections -> the bad ones, x or None for a good one)
BAD_CALLS = {
    "qkv x [2, 3, 47]": ("qkv", lambda ps, g: ps, _x(2, 3, HIDDEN - 1)),
    "qkv x int64": ("qkv", lambda ps, g: ps, _x(5, HIDDEN, dtype=torch.int64)),
    "qkv v reads 56": (
        "qkv",
        lambda ps, g: _at(ps, 2, weight=torch.zeros(KV_OUT, HIDDEN + 8), lora_a=None, lora_b=None),
        _x(5, HIDDEN),
    ),
    "qkv v weight trains": ("qkv", lambda ps, g: [*ps[:2], _trainable(ps[2], "weight")], None),
    "qkv k bias trains": ("qkv", lambda ps, g: [ps[0], _trainable(ps[1], "bias"), ps[2]], None),
    "o x [5, 48]": ("o", lambda ps, g: ps, _x(5, HIDDEN)),
    "mlp x [5, 47]": ("mlp", lambda ps, g: ps, _x(5, HIDDEN - 1)),
    "mlp down weight trains": ("mlp", lambda ps, g: [*ps[:2], _trainable(ps[2], "weight")], None),
    "gate-up-mlp x float64": ("gate-up-mlp", lambda ps, g: ps, _x(5, HIDDEN, dtype=torch.float64)),
}


def _error(call: Callable[[], object]) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    return caught.value


def _bad_case(kind: str, mutate, gen):
    case = KINDS[kind]
    projections = mutate(case.projections(torch.float32, gen, "dense", QWEN2_BIAS), gen)
    return case, projections


@pytest.mark.parametrize("name", BAD)
def test_construction_raises_what_the_function_raises(gen, name):
    kind, mutate, activation = BAD[name]
    case, projections = _bad_case(kind, mutate, gen)
    x = random_tensor((5, case.in_features), torch.float32, gen)
    extra = {"activation": activation} if kind.endswith("mlp") else {}

    expected = _error(lambda: case.function(x, *projections, **extra))
    if kind.endswith("mlp"):
        got = _error(lambda: mlp_group(projections, activation))
    else:
        got = _error(lambda: case.group(projections))
    assert type(got) is type(expected) and str(got) == str(expected)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_call_raises_what_the_function_raises(gen, name):
    kind, mutate, make_x = BAD_CALLS[name]
    case, projections = _bad_case(kind, mutate, gen)
    x = make_x(gen) if make_x else random_tensor((5, case.in_features), torch.float32, gen)
    group = case.group(projections)  # nothing wrong that construction can see

    expected = _error(lambda: case.function(x, *projections))
    assert type(_error(lambda: group(x))) is type(expected)
    assert str(_error(lambda: group(x))) == str(expected)
    if make_x is None:
        with torch.no_grad():  # inference: a trainable base needs no gradient
            group(x)


def test_groups_are_immutable_and_refuse_a_wrong_size(gen):
    group = qkv_group(qkv_projections(torch.float32, gen, [(2, 1.0)] * 3))
    with pytest.raises(AttributeError, match="lora_qkv: a LoRAGroup is immutable"):
        group.split = (1, 2)
    assert group.out_features == WIDTHS and "q_proj [72, 48] r=2" in repr(group)
    with pytest.raises(ValueError, match=r"lora_qkv: a fused LoRA group holds 1 to 3 projections .* got 6"):
        qkv_group(qkv_projections(torch.float32, gen, [None] * 3) * 2)
    with pytest.raises(ValueError, match=r"lora_qkv: split= cuts the output of one packed projection, got 3"):
        LoRAGroup("lora_qkv", QKV_NAMES, group.projections, "qkv", split=WIDTHS)
    with pytest.raises(ValueError, match="group must be one of qkv, o, gate_up, down, got 'attention'"):
        LoRAGroup("lora_qkv", QKV_NAMES, group.projections, "attention")
    with pytest.raises(ValueError, match="LoRAMLP: down must hold down_proj only, got 3"):
        LoRAMLP(LoRAGroup("lora_mlp", ("gate_proj",), group.projections[:1], "gate_up"), group)


# Custom ops --------------------------------------------------------------------------------------------------------


def _op_calls(kind: str, base: str, gen) -> list[tuple[object, tuple, dict]]:
    """(op, args, kwargs) of the forward op and of its backward op for one kind, small shapes."""
    case = KINDS[kind]
    dtype = torch.float32
    projections = case.projections(dtype, gen, base, QWEN2_BIAS)
    group = case.group(projections)
    x = random_tensor((2, 3, case.in_features), dtype, gen).requires_grad_()
    arguments = group.op_arguments(dtype)
    if isinstance(group, LoRAMLP):
        forward_op, backward_op, kwargs = mlp_op, mlp_backward_op, arguments
    else:
        forward_op, backward_op, kwargs = lora_group_op(), lora_group_backward_op(), {**arguments, "group": group.group}
    with torch.no_grad():
        outputs = forward_op(x, **kwargs)
    count = len(arguments["lora_a"])
    static = {name: arguments[name] for name in ("weights", "lora_a", "lora_b", "nf4", "layout", "scales")}
    static = {
        name: [t.detach() for t in value] if name in ("lora_a", "lora_b") else value for name, value in static.items()
    }
    needs = [True] + [True] * count
    if isinstance(group, LoRAMLP):
        grad = random_tensor(outputs[0].shape, dtype, gen)
        names = {key: kwargs[key] for key in ("activation", "gate_up_group", "down_group")}
        backward_args = (grad, x.detach(), *outputs[1:])
        backward_kwargs = {**static, **names, "needs": needs}
    else:
        grads = [random_tensor(out.shape, dtype, gen) for out in outputs[:-1]]
        backward_args = (grads, x.detach(), outputs[-1])
        backward_kwargs = {**static, "group": group.group, "needs": needs}
    return [(forward_op, (x,), kwargs), (backward_op, backward_args, backward_kwargs)]


@pytest.mark.parametrize("base", ["dense", "params4bit-nested", "params4bit-plain"])
@pytest.mark.parametrize("kind", ["qkv-no-k-adapter", "o", "packed-qkv", "mlp", "gate-up-mlp"])
def test_opcheck(gen, kind, base):
    for op, args, kwargs in _op_calls(kind, base, gen):
        results = torch.library.opcheck(op, args, kwargs)
        assert set(results.values()) == {"SUCCESS"}, results


class Block(torch.nn.Module):
    """What a patched decoder layer calls: the qkv group, o on q, the MLP on the sum."""

    def __init__(self, qkv: LoRAGroup, o: LoRAGroup, mlp: LoRAMLP) -> None:
        super().__init__()
        self.qkv, self.o, self.mlp = qkv, o, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        (y,) = self.o(q)
        return self.mlp(x + y) * (k.mean() + v.square().mean())


def _block(gen, base: str, packed: bool) -> tuple[Block, list[torch.Tensor]]:
    dtype = torch.float32
    if packed:
        # 4 heads and 2 kv heads of 12: q is 48 wide, o reads 48.
        packed_qkv = [make_projection(96, HIDDEN, dtype, gen, (6, 1.5), nf4=base, bias=True)]
        qkv = LoRAGroup("lora_packed_qkv", ("qkv_proj",), packed_qkv, "qkv", split=(48, 24, 24))
        mlp = mlp_group(_gate_up(dtype, gen, base, NO_BIAS))
    else:
        qkv = qkv_group(qkv_projections(dtype, gen, [(4, 2.0), None, (2, 0.5)], nf4=(base,) * 3, biases=QWEN2_BIAS))
        mlp = mlp_group(mlp_projections(dtype, gen, [(2, 1.0), (3, 0.5), (1, 2.0)], nf4=(base,) * 3))
    o = LoRAGroup(
        "lora_o", ("o_proj",), [make_projection(HIDDEN, 48 if packed else Q_OUT, dtype, gen, (3, 1.5), nf4=base)], "o"
    )
    block = Block(qkv, o, mlp)
    leaves = [
        t
        for group in (qkv, o, mlp.gate_up, mlp.down)
        for p in group.projections
        for t in (p.lora_a, p.lora_b)
        if t is not None
    ]
    return block, leaves


def _run(function, x: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for t in (x, *leaves):
        t.grad = None
    out = function(x)
    out.backward(torch.ones_like(out))
    return [out.detach(), x.grad, *[t.grad for t in leaves]]


@pytest.mark.parametrize("packed", [False, True], ids=["qkv-gate-up", "packed"])
@pytest.mark.parametrize("base", ["dense", "params4bit-nested"])
def test_a_compiled_block_has_no_graph_break_and_matches_eager(gen, base, packed):
    block, leaves = _block(gen, base, packed)
    x = random_tensor((2, 7, HIDDEN), torch.float32, gen).requires_grad_()
    expected = _run(block, x, leaves)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert {"fastft.lora_group.default", "fastft.lora_mlp.default"} <= targets, targets

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        for got, want in zip(_run(compiled, x, leaves), expected, strict=True):
            # Inductor may fuse and reorder the elementwise parts: equal within fp32 rounding, not bitwise.
            assert relative_error(got, want) < TOLERANCE[torch.float32]
    torch._dynamo.reset()


@pytest.mark.parametrize("packed", [False, True], ids=["qkv-gate-up", "packed"])
@pytest.mark.parametrize("base", ["dense", "params4bit-nested"])
def test_the_reference_path_traces_a_block_as_aten_ops(gen, base, packed):
    """On the torch-reference path a traced dense group or MLP is plain aten ops the compiler can fuse
    (fastft.kernels.traced_reference); an NF4 base keeps its op. Compiled by inductor, it equals eager."""
    from fastft.kernels import dispatch

    block, leaves = _block(gen, base, packed)
    x = random_tensor((2, 7, HIDDEN), torch.float32, gen).requires_grad_()
    with dispatch.force_reference():
        expected = _run(block, x, leaves)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        targets = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
        fastft_ops = {target for target in targets if target.startswith("fastft.")}
        assert fastft_ops == (set() if base == "dense" else {"fastft.lora_group.default", "fastft.lora_mlp.default"})
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="inductor", fullgraph=True)
        for got, want in zip(_run(compiled, x, leaves), expected, strict=True):
            assert relative_error(got, want) < TOLERANCE[torch.float32]
    torch._dynamo.reset()


def test_one_compiled_graph_serves_every_layer_and_autocast(gen):
    # Regional compilation compiles one decoder layer and runs it for all: a second layer's groups (other weights,
    # same shapes) reuse the graph and read their own weights.
    layers = [_block(gen, "dense", False) for _ in range(2)]
    x = random_tensor((2, 5, HIDDEN), torch.float32, gen).requires_grad_()

    def run(block: Block, t: torch.Tensor) -> torch.Tensor:
        with torch.autocast(KERNEL_DEVICE, dtype=torch.bfloat16):
            return block(t).float()

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for block, leaves in layers:
            got = _run(lambda t, block=block: compiled(block, t), x, leaves)
            want = _run(lambda t, block=block: run(block, t), x, leaves)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
    torch._dynamo.reset()


def _fp32_adapters_over_fp16(gen):
    """``projection(out_features, in_features)``: an fp16 base with rank-4 fp32 adapters (peft's default), scale 2."""
    from fastft.kernels import LoRAWeights

    def projection(out_features, in_features):
        return LoRAWeights(
            random_tensor((out_features, in_features), torch.float16, gen, 0.1),
            random_tensor((4, in_features), torch.float32, gen, 0.1).requires_grad_(True),
            random_tensor((out_features, 4), torch.float32, gen, 0.1).requires_grad_(True),
            2.0,
        )

    return projection


@pytest.mark.parametrize("kind", ["qkv", "mlp"])
def test_backward_reuses_the_adapter_casts_of_its_forward(kind, gen):
    """fp32 adapters over a 16-bit base (peft's default): forward casts each A and B to the compute dtype once and the
    same node's backward reuses those casts (one cast per adapter per step, not two)."""
    from fastft.kernels import LoRAGroup, LoRAMLP, dispatch

    projection = _fp32_adapters_over_fp16(gen)

    if kind == "qkv":
        run = LoRAGroup(
            "lora_qkv", ("q_proj", "k_proj", "v_proj"), [projection(32, 32)] + [projection(16, 32)] * 2, "qkv"
        )
    else:
        run = LoRAMLP.from_projections([projection(48, 32), projection(48, 32), projection(32, 48)])
    adapter_shapes = {(4, 32), (32, 4), (16, 4), (48, 4), (4, 48), (12, 32)}

    x = random_tensor((2, 5, 32), torch.float16, gen).requires_grad_(True)
    with dispatch.force_reference():
        out = run(x)
        loss = sum(o.float().sum() for o in out) if isinstance(out, tuple) else out.float().sum()
        with CastCounter(adapter_shapes) as casts:
            loss.backward()
    assert casts.single == 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kind", ["qkv", "mlp"])
def test_a_group_casts_its_adapters_with_one_copy_each_way(kind, gen):
    """fp32 adapters over a 16-bit base: a group's forward stacks and casts all its A's and B's with one
    ``_foreach_copy_`` (one launch on CUDA, not a cat and a cast per tensor), and its backward casts all its LoRA
    gradients back to fp32 with one more; the values are exactly those of casting each tensor on its own."""

    from fastft.kernels import LoRAGroup, LoRAMLP, LoRAWeights, dispatch

    projection = _fp32_adapters_over_fp16(gen)

    if kind == "qkv":
        projections = [projection(32, 32), projection(16, 32), projection(16, 32)]
        run = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
        groups = 1
    else:
        projections = [projection(48, 32), projection(48, 32), projection(32, 48)]
        run = LoRAMLP.from_projections(projections)
        groups = 2
    adapters = [t for p in projections for t in (p.lora_a, p.lora_b)]
    # Any cast of an adapter, of the stacked A's (q, k, v: 12 rows; gate, up: 8) or of a LoRA gradient.
    shapes = {tuple(t.shape) for t in adapters} | {(12, 32), (8, 32)}

    x = random_tensor((2, 5, 32), torch.float16, gen).requires_grad_(True)
    with dispatch.force_reference():
        with CastCounter(shapes) as forward:
            out = run(x)
        # An fp16 loss: no cast of its own in the backward counted below.
        loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
        with CastCounter(shapes) as backward:
            grads = torch.autograd.grad(loss, [x, *adapters])
    assert (forward.batched, forward.single) == (groups, 0)
    # No other copy: a gradient the node kept a reference to would be copied again by AccumulateGrad.
    assert (backward.batched, backward.single, backward.copies) == (groups, 0, 0)
    assert all(g.dtype == torch.float32 and g.shape == a.shape for g, a in zip(grads[1:], adapters, strict=True))

    # The same node with every adapter already in fp16 casts nothing; its gradients, cast one by one, are the above.
    half = [
        LoRAWeights(p.weight, p.lora_a.detach().half().requires_grad_(), p.lora_b.detach().half().requires_grad_(), 2.0)
        for p in projections
    ]
    if kind == "qkv":
        twin = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), half, "qkv")
    else:
        twin = LoRAMLP.from_projections(half)
    half_adapters = [t for p in half for t in (p.lora_a, p.lora_b)]
    with dispatch.force_reference():
        out = twin(x)
        loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
        want = torch.autograd.grad(loss, [x, *half_adapters])
    assert torch.equal(grads[0], want[0])
    for got, expected in zip(grads[1:], want[1:], strict=True):
        assert torch.equal(got, expected.float())


def _qkv_group(gen, scales, dtype=torch.float32):
    # dtype: the base's (and x's); the adapters are fp32, as peft keeps them.
    from fastft.kernels import LoRAGroup, LoRAWeights

    projections = [
        LoRAWeights(
            random_tensor((out_features, 32), dtype, gen, 0.1),
            random_tensor((rank, 32), torch.float32, gen, 0.1).requires_grad_(True),
            random_tensor((out_features, rank), torch.float32, gen, 0.1).requires_grad_(True),
            scale,
        )
        for out_features, rank, scale in zip((32, 16, 16), (4, 2, 3), scales, strict=True)
    ]
    return LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv"), projections


def _backward_gemms(group, projections, x):
    """The backward's GEMM calls by aten op, and the gradients of x and of every A and B (None where not wanted)."""
    from fastft.kernels import dispatch

    class Gemms(OperatorMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "mm" in func.__name__:
                self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    adapters = [t for p in projections for t in (p.lora_a, p.lora_b)]
    with dispatch.force_reference():
        q, k, v = group(x)
        loss = (q * 1.5).sum() + (k * 0.5).sum() + v.square().sum()
        with Gemms() as gemms:
            loss.backward()
    return gemms.ops, [x.grad, *(t.grad for t in adapters)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_adapters_of_one_scale_take_one_gemm_for_dx_and_one_for_every_da(gen, dtype):
    """q, k and v with one scale (peft's case): backward writes every dY B into one [M, Σ r] buffer, so the low-rank
    part of dX is one GEMM; over a 16-bit base (the dA's cast to fp32 after) every dA is one GEMM as well. With three
    scales, one GEMM per adapter each. The gradients agree."""
    x = random_tensor((2, 5, 32), dtype, gen)
    found = {}
    for name, scales in {"one": (2.0, 2.0, 2.0), "three": (2.0, 0.5, 1.5)}.items():
        group, projections = _qkv_group(gen, scales, dtype)
        if name == "three":
            # The same tensors as "one", each adapter scaled so that s_i A_i is the same product.
            for new, old in zip(projections, found["one"][2], strict=True):
                new.lora_a.data.copy_(old.lora_a * (2.0 / new.scale))
                new.lora_b.data.copy_(old.lora_b)
                new.weight.copy_(old.weight)
        found[name] = (*_backward_gemms(group, projections, x.clone().requires_grad_(True)), projections)
    one, three = found["one"][0], found["three"][0]
    # dX: the base's mm + 2 addmm_, then the low-rank part: 1 addmm_ grouped, 3 otherwise; dA: 1 addmm grouped (3
    # in fp32, where no cast follows); dB: 3 addmm either way; every dY B its own GEMM (into the buffer if grouped).
    grouped_da = 1 if dtype != torch.float32 else 3
    assert (one["aten.addmm_.default"], one["aten.addmm.default"], one["aten.mm.out"]) == (3, grouped_da + 3, 3), one
    assert (three["aten.addmm_.default"], three["aten.addmm.default"], three["aten.mm.default"]) == (5, 6, 4), three
    grads_one, grads_three = found["one"][1], found["three"][1]
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(grads_one[0], grads_three[0], **tolerance)
    for j, (got, want) in enumerate(zip(grads_one[1:], grads_three[1:], strict=True)):
        # dA of "three" is the gradient of A' = (2 / s) A: dA' = (s / 2) dA.
        factor = found["three"][2][j // 2].scale / 2.0 if j % 2 == 0 else 1.0
        assert got.dtype == torch.float32
        torch.testing.assert_close(got * factor, want, **tolerance)
    if dtype == torch.float32:
        # No two gradients share a storage.
        assert len({g.untyped_storage().data_ptr() for g in grads_one[1:]}) == len(grads_one) - 1


def test_a_frozen_adapter_in_a_group_of_one_scale_takes_the_per_adapter_path(gen):
    """k's A and B frozen: the grouped backward needs every adapter's gradient, so this group computes q's and v's on
    their own; they equal those of the group with k trainable, and k gets none."""
    x = random_tensor((2, 5, 32), torch.float32, gen)
    group, projections = _qkv_group(gen, (2.0, 2.0, 2.0))
    _, trained = _backward_gemms(group, projections, x.clone().requires_grad_(True))
    for t in projections:
        t.lora_a.grad = t.lora_b.grad = None
    projections[1].lora_a.requires_grad_(False)
    projections[1].lora_b.requires_grad_(False)
    ops, frozen = _backward_gemms(group, projections, x.clone().requires_grad_(True))
    assert "aten.mm.out" not in ops and ops["aten.addmm.default"] == 4  # dA and dB of q and v, one GEMM each
    assert frozen[3] is None and frozen[4] is None
    torch.testing.assert_close(frozen[0], trained[0], rtol=1e-5, atol=1e-6)
    for j in (1, 2, 5, 6):
        torch.testing.assert_close(frozen[j], trained[j], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("part", ["qkv", "mlp"])
def test_an_input_changed_in_place_after_the_forward_is_caught_by_the_backward(gen, part):
    """The groups' math runs below autograd's dispatch keys; the saved view of the input is made above them, so
    autograd still sees an in-place change of the input between forward and backward."""
    dtype = torch.float32
    if part == "qkv":
        run = qkv_group(qkv_projections(dtype, gen, [(8, 2.0), (8, 0.5), (8, 1.0)]))
    else:
        run = mlp_group(mlp_projections(dtype, gen, [(2, 1.0), (3, 0.5), (1, 2.0)]))
    x = random_tensor((1, 16, HIDDEN), dtype, gen).requires_grad_() * 1.0
    with dispatch.force_reference():
        outputs = run(x)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        total = sum(out.sum() for out in outputs)
        x.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation|modified inplace"):
            total.backward()


@pytest.mark.parametrize("part", ["qkv", "mlp"])
def test_a_second_backward_gives_the_same_gradients_or_fails_loudly(gen, part):
    """retain_graph=True and a second backward: the MLP's backward wrote its gradients over its saved gate / up (below
    autograd, or by a Triton kernel), so it must refuse; the q / k / v group must give the same gradients again."""
    dtype = torch.float32
    if part == "qkv":
        run = qkv_group(qkv_projections(dtype, gen, [(8, 2.0), (8, 0.5), (8, 1.0)]))
    else:
        run = mlp_group(mlp_projections(dtype, gen, [(2, 1.0), (3, 0.5), (1, 2.0)]))
    x = random_tensor((1, 16, HIDDEN), dtype, gen).requires_grad_()
    with dispatch.force_reference():
        outputs = run(x)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        total = sum(out.sum() for out in outputs)
        (first,) = torch.autograd.grad(total, [x], retain_graph=True)
        if part == "mlp":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(total, [x])
        else:
            (second,) = torch.autograd.grad(total, [x])
            assert torch.equal(first, second)
