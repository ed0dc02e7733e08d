"""GeGLU kernel (Gemma's ``gelu_pytorch_tanh(gate) * up``): output and both gradients against float64, in-place
backward and its loud failures, and the fused LoRA-MLP with ``activation="gelu_tanh"`` against an unfused float64
expression."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.geglu import GeGLUFunction, geglu, geglu_backward_, geglu_forward, geglu_reference
from fastft.kernels.lora_mlp import LoRAMLPFunction, lora_mlp
from fastft.kernels.lora_projection import LoRAWeights, function_inputs

SHAPES = [(1, 1, 123), (2, 67, 128), (67, 1000), (3, 5, 4096 // 4)]
INPLACE_ERROR = "modified by an inplace operation"
# gate values spread over GELU's curved region (about [-4, 4]) and its flat tails.
GATE_SCALE = 2.0


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def float64_geglu(gate, up, dh):
    """Output and (d_gate, d_up) by float64 autograd from the same, already rounded, inputs."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    h = gelu_tanh(g) * u
    h.backward(dh.double())
    return h.detach(), g.grad, u.grad


def intermediates(gate0, up0):
    """Leaves, and non-leaf copies of them: what gate_proj / up_proj hand the MLP, the case written in place."""
    gate_leaf = gate0.clone().requires_grad_()
    up_leaf = up0.clone().requires_grad_()
    return gate_leaf, up_leaf, gate_leaf.clone(), up_leaf.clone()


def inputs(shape, dtype, gen):
    return random_tensor(shape, dtype, gen, scale=GATE_SCALE), random_tensor(shape, dtype, gen)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_output_and_gradients_match_float64(kernel_path, gen, shape, dtype):
    gate0, up0 = inputs(shape, dtype, gen)
    dh = random_tensor(shape, dtype, gen)
    gate_leaf, up_leaf, gate, up = intermediates(gate0, up0)
    gate_version, up_version = gate._version, up._version

    h = geglu(gate, up)
    h.backward(dh)

    h64, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    assert h.dtype == dtype and h.shape == torch.Size(shape)
    assert type(h.grad_fn).__name__ == "GeGLUFunctionBackward"
    assert relative_error(h, h64) < TOLERANCE[dtype]
    assert relative_error(gate_leaf.grad, dgate64) < TOLERANCE[dtype]
    assert relative_error(up_leaf.grad, dup64) < TOLERANCE[dtype]
    # The intermediates' buffers now hold their gradients, and autograd knows they were written.
    assert torch.equal(gate.detach(), gate_leaf.grad)
    assert torch.equal(up.detach(), up_leaf.grad)
    assert gate._version > gate_version and up._version > up_version


def test_extreme_gates_stay_finite(kernel_path, gen):
    # Far in the tails GELU is 0 (g very negative) or g, with slope 0 or 1: never a NaN, an inf or an overflow.
    gate0 = torch.tensor([-60000.0, -300.0, -20.0, -9.0, 0.0, 9.0, 20.0, 300.0, 60000.0], device=KERNEL_DEVICE)
    up0 = torch.ones_like(gate0)
    dh = torch.ones_like(gate0)
    gate_leaf, up_leaf, gate, up = intermediates(gate0, up0)
    with warnings.catch_warnings():
        # The kernels take exp(-|2 z|) only: under the interpreter numpy would warn on an exp overflowing to inf.
        warnings.simplefilter("error", RuntimeWarning)
        h = geglu(gate, up)
        h.backward(dh)
    h64, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    for actual, expected in ((h, h64), (gate_leaf.grad, dgate64), (up_leaf.grad, dup64)):
        assert torch.isfinite(actual).all()
        assert torch.allclose(actual.double(), expected, rtol=1e-6, atol=1e-6)


def test_reference_equals_transformers_gelu_pytorch_tanh_fp32(kernel_path, gen):
    from transformers.activations import ACT2FN

    gate = random_tensor((2, 67, 128), torch.float32, gen, scale=3.0)
    up = random_tensor((2, 67, 128), torch.float32, gen)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up

    # The reference is bitwise transformers' expression in fp32; the kernel computes 0.5 (1 + tanh z) as
    # sigmoid(2 z) (measured about 4e-8 relative under the interpreter), so it is held to 1e-7 there; a GPU's
    # approximate exp is given 1e-6 (not measured in this CPU-only CI).
    assert torch.equal(geglu_reference(gate, up), expected)
    out = geglu(gate, up)
    if kernel_path == "reference":
        assert torch.equal(out, expected)
    else:
        assert relative_error(out, expected) < (1e-7 if KERNEL_DEVICE == "cpu" else 1e-6)


def test_reference_equals_transformers_gemma3_mlp_fp32(gen):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

    config = Gemma3TextConfig(hidden_size=48, intermediate_size=80, hidden_activation="gelu_pytorch_tanh")
    torch.manual_seed(0)
    mlp = Gemma3MLP(config).to(KERNEL_DEVICE)
    x = random_tensor((2, 19, 48), torch.float32, gen)
    with torch.no_grad():
        expected = mlp(x)
        ours = mlp.down_proj(geglu_reference(mlp.gate_proj(x), mlp.up_proj(x)))
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_reference_is_differentiable_by_autograd(gen, dtype):
    shape = (3, 37)
    gate0, up0 = inputs(shape, dtype, gen)
    dh = random_tensor(shape, dtype, gen)
    gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    h = geglu_reference(gate, up)
    h.backward(dh)
    h64, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    assert h.dtype == dtype
    assert relative_error(h, h64) < TOLERANCE[dtype]
    assert relative_error(gate.grad, dgate64) < TOLERANCE[dtype]
    assert relative_error(up.grad, dup64) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_forward_and_backward_helpers_on_owned_buffers(kernel_path, gen, dtype):
    shape = (7, 300)
    gate0, up0 = inputs(shape, dtype, gen)
    dh = random_tensor(shape, dtype, gen)
    gate, up = gate0.clone(), up0.clone()

    h = geglu_forward(gate, up)
    assert torch.equal(gate, gate0) and torch.equal(up, up0)  # forward never writes its inputs
    dgate, dup = geglu_backward_(dh, gate, up)

    h64, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    assert dgate.data_ptr() == gate.data_ptr() and dup.data_ptr() == up.data_ptr()
    assert relative_error(h, h64) < TOLERANCE[dtype]
    assert relative_error(dgate, dgate64) < TOLERANCE[dtype]
    assert relative_error(dup, dup64) < TOLERANCE[dtype]


@pytest.mark.parametrize("other_first", [True, False], ids=["other-op-created-first", "other-op-created-after"])
def test_another_node_saving_gate_never_reads_gradients(kernel_path, gen, other_first):
    shape = (5, 33)
    gate0, up0 = inputs(shape, torch.float32, gen)
    dh = random_tensor(shape, torch.float32, gen)
    gate_leaf, up_leaf, gate, up = intermediates(gate0, up0)
    # gate * gate saves gate for its own backward. A node created before geglu runs its backward after geglu has
    # written d_gate over gate: that must raise, not read it.
    if other_first:
        other = gate * gate
        h = geglu(gate, up)
    else:
        h = geglu(gate, up)
        other = gate * gate
    loss = (h * dh).sum() + other.sum()
    if other_first:
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            loss.backward()
        return
    loss.backward()
    g64, u64 = gate0.double().requires_grad_(), up0.double().requires_grad_()
    ((gelu_tanh(g64) * u64 * dh.double()).sum() + (g64 * g64).sum()).backward()
    assert relative_error(gate_leaf.grad, g64.grad) < TOLERANCE[torch.float32]
    assert relative_error(up_leaf.grad, u64.grad) < TOLERANCE[torch.float32]


def test_second_backward_through_retained_graph_fails_loudly(kernel_path, gen):
    shape = (4, 50)
    gate0, up0 = inputs(shape, torch.float32, gen)
    dh = random_tensor(shape, torch.float32, gen)
    _, _, gate, up = intermediates(gate0, up0)
    h = geglu(gate, up)
    h.backward(dh, retain_graph=True)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        h.backward(dh)


def test_non_contiguous_inputs_are_copied_not_overwritten(kernel_path, gen):
    base_gate = random_tensor((2, 37, 64), torch.float32, gen, scale=GATE_SCALE)
    base_up = random_tensor((2, 64, 37), torch.float32, gen)
    dh = random_tensor((2, 37, 32), torch.float32, gen)
    gate_leaf, up_leaf, gate_base, up_base = intermediates(base_gate, base_up)
    gate = gate_base[..., ::2]  # strided
    up = up_base.transpose(1, 2)[..., 5:37]  # transposed and offset
    gate_before, up_before = gate.detach().clone(), up.detach().clone()

    h = geglu(gate, up)
    h.backward(dh)

    h64, dgate64, dup64 = float64_geglu(gate_before, up_before, dh)
    assert relative_error(h, h64) < TOLERANCE[torch.float32]
    assert relative_error(gate_leaf.grad[..., ::2], dgate64) < TOLERANCE[torch.float32]
    assert relative_error(up_leaf.grad.transpose(1, 2)[..., 5:37], dup64) < TOLERANCE[torch.float32]
    # The private copies took the gradients; the caller's views still hold the activations.
    assert torch.equal(gate.detach(), gate_before) and torch.equal(up.detach(), up_before)


def test_leaf_inputs_keep_their_values(kernel_path, gen):
    shape = (6, 45)
    gate0, up0 = inputs(shape, torch.float32, gen)
    dh = random_tensor(shape, torch.float32, gen)
    gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    geglu(gate, up).backward(dh)

    _, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    # Overwriting a leaf would replace a parameter's values with its gradient.
    assert torch.equal(gate.detach(), gate0) and torch.equal(up.detach(), up0)
    assert relative_error(gate.grad, dgate64) < TOLERANCE[torch.float32]
    assert relative_error(up.grad, dup64) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("frozen", ["gate", "up"])
def test_input_without_gradient_is_not_written(kernel_path, gen, frozen):
    shape = (3, 71)
    gate0, up0 = inputs(shape, torch.float32, gen)
    dh = random_tensor(shape, torch.float32, gen)
    gate_leaf, up_leaf, gate, up = intermediates(gate0, up0)
    if frozen == "gate":
        gate = gate.detach()
    else:
        up = up.detach()
    geglu(gate, up).backward(dh)

    _, dgate64, dup64 = float64_geglu(gate0, up0, dh)
    if frozen == "gate":
        assert torch.equal(gate, gate0) and gate_leaf.grad is None
        assert relative_error(up_leaf.grad, dup64) < TOLERANCE[torch.float32]
    else:
        assert torch.equal(up, up0) and up_leaf.grad is None
        assert relative_error(gate_leaf.grad, dgate64) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_same_tensor_as_gate_and_up(kernel_path, gen, dtype):
    shape = (9, 31)
    t0, dh = random_tensor(shape, dtype, gen, scale=GATE_SCALE), random_tensor(shape, dtype, gen)
    leaf = t0.clone().requires_grad_()
    t = leaf.clone()
    # gate and up share memory, so neither can take a gradient in place without racing the other's reads.
    h = geglu(t, t)
    h.backward(dh)

    t64 = t0.double().requires_grad_()
    h64 = gelu_tanh(t64) * t64
    h64.backward(dh.double())
    assert relative_error(h, h64) < TOLERANCE[dtype]
    assert relative_error(leaf.grad, t64.grad) < TOLERANCE[dtype]
    assert torch.equal(t.detach(), t0)


def test_empty_input(kernel_path):
    gate = torch.zeros((0, 16), device=KERNEL_DEVICE).requires_grad_()
    up = torch.zeros((0, 16), device=KERNEL_DEVICE).requires_grad_()
    h = geglu(gate.clone(), up.clone())
    h.sum().backward()
    assert h.shape == (0, 16) and gate.grad.shape == (0, 16) and up.grad.shape == (0, 16)


@pytest.mark.parametrize("function", [geglu, geglu_reference, GeGLUFunction.apply], ids=["geglu", "ref", "fn"])
def test_mismatched_shapes_name_both(kernel_path, gen, function):
    gate = random_tensor((2, 3, 40), torch.float32, gen)
    up = random_tensor((2, 3, 41), torch.float32, gen)
    with pytest.raises(ShapeContractError, match=r"gate \[2, 3, 40\] and up \[2, 3, 41\].*gate_proj\(x\) and up_proj"):
        function(gate, up)


def test_mismatched_dtypes_are_refused(kernel_path, gen):
    gate = random_tensor((4, 8), torch.float32, gen)
    up = random_tensor((4, 8), torch.float16, gen)
    with pytest.raises(TypeError, match=r"geglu: .*gate torch.float32 and up torch.float16"):
        geglu(gate, up)


# The fused LoRA-MLP with the GeGLU gate -----------------------------------------------------------------------------

# hidden 48, intermediate 80 (as tests/test_kernel_lora.py); 37 tokens: no multiple of any block.
HIDDEN, INTERMEDIATE = 48, 80
LEADS = [(37,), (2, 19)]
# (rank, scale) of gate, up and down; None: no adapter on that projection.
MLP_CASES = {
    "ranks-4-1-8": [(4, 2.0), (1, 0.5), (8, 1.25)],
    "up-without-lora": [(2, 0.75), None, (1, 4.0)],
}


def make_projection(out_features, in_features, dtype, gen, lora) -> LoRAWeights:
    """A frozen dense base with A and B leaves that need grad; B non-zero (peft's zero B would hide dA errors).

    W and A ~ 1/sqrt(in), B ~ 0.1 keep every intermediate near 1, so fp16 neither overflows nor loses the low-rank
    term.
    """
    weight = random_tensor((out_features, in_features), dtype, gen, scale=in_features**-0.5)
    if lora is None:
        return LoRAWeights(weight)
    rank, scale = lora
    lora_a = random_tensor((rank, in_features), dtype, gen, scale=in_features**-0.5).requires_grad_()
    lora_b = random_tensor((out_features, rank), dtype, gen, scale=0.1).requires_grad_()
    return LoRAWeights(weight, lora_a, lora_b, scale)


def mlp_projections(dtype, gen, specs) -> list[LoRAWeights]:
    shapes = ((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
    return [make_projection(*shape, dtype, gen, spec) for shape, spec in zip(shapes, specs, strict=True)]


class Unfused:
    """``down(gelu_tanh(gate(x)) * up(x))`` in float64 over leaves for x and every A / B, for autograd."""

    def __init__(self, x: torch.Tensor, projections: Sequence[LoRAWeights]):
        self.x = x.detach().double().requires_grad_(x.requires_grad)
        self.weights = [p.weight.double() for p in projections]
        self.a = [None if p.lora_a is None else p.lora_a.detach().double().requires_grad_() for p in projections]
        self.b = [None if p.lora_b is None else p.lora_b.detach().double().requires_grad_() for p in projections]
        self.scales = [float(p.scale) for p in projections]

    def project(self, i: int, x64: torch.Tensor) -> torch.Tensor:
        y = x64 @ self.weights[i].T
        if self.a[i] is not None:
            y = y + self.scales[i] * (x64 @ self.a[i].T) @ self.b[i].T
        return y

    def mlp(self) -> torch.Tensor:
        return self.project(2, gelu_tanh(self.project(0, self.x)) * self.project(1, self.x))


def check_mlp_parity(x, projections, dtype, gen) -> torch.Tensor:
    y = lora_mlp(x, *projections, activation="gelu_tanh")
    dy = random_tensor(y.shape, dtype, gen)
    y.backward(dy)

    ref = Unfused(x, projections)
    y64 = ref.mlp()
    y64.backward(dy.double())

    bound = TOLERANCE[dtype]
    assert y.dtype == dtype and y.shape == y64.shape and y.is_contiguous()
    assert type(y.grad_fn).__name__ == "LoRAMLPFunctionBackward"
    assert relative_error(y, y64) < bound
    if x.requires_grad:
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        assert relative_error(x.grad, ref.x.grad) < bound
    else:
        assert x.grad is None
    for i, projection in enumerate(projections):
        assert projection.weight.grad is None  # the base is frozen
        if projection.lora_a is None:
            continue
        assert relative_error(projection.lora_a.grad, ref.a[i].grad) < bound, f"dA of projection {i}"
        assert relative_error(projection.lora_b.grad, ref.b[i].grad) < bound, f"dB of projection {i}"
    return y


@pytest.mark.parametrize("case", MLP_CASES)
@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_mlp_gelu_tanh_against_unfused_float64(kernel_path, gen, dtype, lead, case):
    projections = mlp_projections(dtype, gen, MLP_CASES[case])
    x = random_tensor((*lead, HIDDEN), dtype, gen).requires_grad_()

    y = check_mlp_parity(x, projections, dtype, gen)

    assert y.shape == (*lead, HIDDEN)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_mlp_gelu_tanh_input_without_grad_still_trains_lora(kernel_path, gen, dtype):
    # x frozen (an embedding output): dX is skipped, every dA / dB is not; checks the shifted needs_input_grad slots.
    projections = mlp_projections(dtype, gen, [(3, 2.0), None, (1, 0.5)])
    x = random_tensor((2, 19, HIDDEN), dtype, gen)

    check_mlp_parity(x, projections, dtype, gen)


def test_lora_mlp_activation_changes_the_gate_and_silu_stays_the_default(kernel_path, gen):
    dtype = torch.float32
    projections = mlp_projections(dtype, gen, MLP_CASES["ranks-4-1-8"])
    x = random_tensor((37, HIDDEN), dtype, gen)
    with torch.no_grad():
        default = lora_mlp(x, *projections)
        silu = lora_mlp(x, *projections, activation="silu")
        gelu = lora_mlp(x, *projections, activation="gelu_tanh")
        ref = Unfused(x, projections)
        silu64 = ref.project(2, F.silu(ref.project(0, ref.x)) * ref.project(1, ref.x))
    assert torch.equal(default, silu)
    assert relative_error(silu, silu64) < TOLERANCE[dtype]
    assert relative_error(gelu, ref.mlp()) < TOLERANCE[dtype]
    assert relative_error(gelu, silu) > 1e-2


def test_lora_mlp_gelu_tanh_saves_no_more_than_silu(kernel_path, gen):
    # The GeGLU gate keeps the SwiGLU memory plan: X, the gate / up pre-activations and X Aᵀ / H A_downᵀ, not H.
    dtype = torch.float32
    ranks = [(2, 1.0), (3, 0.5), (5, 2.0)]
    projections = mlp_projections(dtype, gen, ranks)
    x = random_tensor((37, HIDDEN), dtype, gen).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = lora_mlp(x, *projections, activation="gelu_tanh")
    parameters = {t.data_ptr() for p in projections for t in (p.weight, p.lora_a, p.lora_b)}
    activations = [t for t in saved if t.data_ptr() not in parameters]
    expected = x.numel() + 2 * 37 * INTERMEDIATE + 37 * (2 + 3) + 37 * 5
    assert sum(t.numel() for t in activations) == expected
    y.sum().backward()


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_pytorch_tanh", "SILU", None])
def test_lora_mlp_refuses_an_unknown_activation(gen, activation):
    projections = mlp_projections(torch.float32, gen, MLP_CASES["ranks-4-1-8"])
    x = random_tensor((5, HIDDEN), torch.float32, gen)
    message = rf"lora_mlp: activation must be one of 'silu', 'gelu_tanh' .*got {activation!r}"
    with pytest.raises(ValueError, match=message):
        lora_mlp(x, *projections, activation=activation)
    # The autograd Function checks it too, before any launch.
    with pytest.raises(ValueError, match=message):
        LoRAMLPFunction.apply(x, tuple(projections), activation, *function_inputs(projections))
