"""GeGLU (Gemma's ``gelu_pytorch_tanh(gate) * up``): extreme gates, Gemma 3's MLP, and the fused LoRA-MLP with
``activation="gelu_tanh"`` against an unfused float64 expression. What GeGLU shares with SwiGLU (output and gradients
against float64, the in-place backward) is in ``tests/test_kernel_gates.py``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error
from test_kernel_gates import GATES, float64_gate, intermediates

from fastft.kernels.geglu import geglu, geglu_reference
from fastft.kernels.lora_mlp import LoRAMLPFunction, lora_mlp
from fastft.kernels.lora_projection import LoRAWeights, function_inputs

# gate values spread over GELU's curved region (about [-4, 4]) and its flat tails.
GATE_SCALE = 2.0


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def float64_geglu(gate, up, dh):
    return float64_gate(GATES["geglu"], gate, up, dh)


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
