"""Fused LoRA projections (q/k/v, o, the SwiGLU MLP): outputs, dX, dA and dB against float64 (NF4 bases: nf4 file).

Every projection is ``Y = X Wᵀ + b + s (X Aᵀ) Bᵀ`` (the frozen bias ``b`` optional: Qwen2's q / k / v carry one);
the float64 reference builds that expression (and ``down(silu(gate) * up)`` for the MLP) from the same rounded inputs
and lets autograd differentiate it, so the hand-written backward is checked against an independent derivation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, TOLERANCE, random_tensor, relative_error

from fastft import ShapeContractError
from fastft.kernels import dequantize_nf4
from fastft.kernels.lora_mlp import LoRAMLPFunction, lora_mlp
from fastft.kernels.lora_o import LoRAOFunction, lora_o
from fastft.kernels.lora_projection import LoRAWeights
from fastft.kernels.lora_qkv import LoRAQKVFunction, lora_qkv

# GQA with hidden != heads · head_dim: 6 heads and 2 kv heads of head_dim 12 over a hidden size of 48.
HIDDEN, Q_OUT, KV_OUT, INTERMEDIATE = 48, 72, 24, 80
# 37 tokens: no multiple of any block; [2, 19, K]: a batch, 38 rows.
LEADS = [(37,), (2, 19)]
# A (rank, scale) per projection; None: no adapter on that projection.
Spec = tuple[int, float] | None
# Whether each projection of a group has a frozen base bias.
NO_BIAS = (False, False, False)
QWEN2_BIAS = (True, True, True)  # Qwen2 / Qwen2.5: q, k and v each carry one


def make_projection(
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    lora: Spec,
    *,
    nf4: str = "dense",
    bias: bool = False,
) -> LoRAWeights:
    """A frozen base (dense, or NF4 from ``Params4bit`` / ``quantize_4bit``), with a frozen bias when asked, and A
    and B leaves that need grad.

    Magnitudes keep every intermediate near 1, so fp16 neither overflows nor loses the low-rank term: W and A
    ~ 1/sqrt(in), B ~ 0.1, the bias ~ 0.5.
    """
    weight = random_tensor((out_features, in_features), dtype, gen, scale=in_features**-0.5)
    quant_state = None
    if nf4 in ("params4bit-nested", "params4bit-plain"):
        weight = bnb.nn.Params4bit(
            weight.cpu(), requires_grad=False, quant_type="nf4", compress_statistics=nf4.endswith("nested")
        ).to(KERNEL_DEVICE)
        assert weight.dtype == torch.uint8 and weight.quant_state is not None
    elif nf4 == "quantize_4bit":
        weight, quant_state = bnb_functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    else:
        assert nf4 == "dense", nf4
    lora_a = lora_b = None
    scale = 1.0
    if lora is not None:
        rank, scale = lora
        lora_a = random_tensor((rank, in_features), dtype, gen, scale=in_features**-0.5).requires_grad_()
        lora_b = random_tensor((out_features, rank), dtype, gen, scale=0.1).requires_grad_()
    base_bias = random_tensor((out_features,), dtype, gen, scale=0.5) if bias else None
    return LoRAWeights(weight, lora_a, lora_b, scale, quant_state, base_bias)


def base_float64(projection: LoRAWeights) -> torch.Tensor:
    """The base weight's exact values in float64; an NF4 weight dequantised to fp32 (its products are fp32-exact)."""
    if projection.weight.dtype == torch.uint8:
        return dequantize_nf4(projection.weight, projection.quant_state, dtype=torch.float32).double()
    return projection.weight.double()


class Reference:
    """float64 leaves for x and every A / B of one case, and the projection expression over them."""

    def __init__(self, x: torch.Tensor, projections: Sequence[LoRAWeights], cast: torch.dtype | None = None):
        # cast: round every input to this dtype first (what autocast hands the kernels).
        def leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
            t = t.detach() if cast is None else t.detach().to(cast)
            return t.double().requires_grad_(requires_grad)

        self.x = leaf(x, x.requires_grad)
        self.weights = [base_float64(p) if cast is None else base_float64(p).to(cast).double() for p in projections]
        self.a = [None if p.lora_a is None else leaf(p.lora_a, True) for p in projections]
        self.b = [None if p.lora_b is None else leaf(p.lora_b, True) for p in projections]
        self.bias = [None if p.bias is None else leaf(p.bias, False) for p in projections]
        self.scales = [float(p.scale) for p in projections]

    def project(self, i: int, x64: torch.Tensor) -> torch.Tensor:
        y = x64 @ self.weights[i].T
        if self.bias[i] is not None:
            y = y + self.bias[i]
        if self.a[i] is not None:
            y = y + self.scales[i] * (x64 @ self.a[i].T) @ self.b[i].T
        return y


def run_and_compare(
    function: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[[Reference], list[torch.Tensor]],
    x: torch.Tensor,
    projections: Sequence[LoRAWeights],
    dtype: torch.dtype,
    gen: torch.Generator,
) -> list[torch.Tensor]:
    """Run ``function(x, *projections)`` forward and backward (random dY) and check Y, dX, every dA and dB."""
    outputs = function(x, *projections)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    grads = [random_tensor(out.shape, dtype, gen) for out in outputs]
    torch.autograd.backward(outputs, grads)

    ref = Reference(x, projections)
    expected = reference(ref)
    # With x frozen, a projection without an adapter has nothing to differentiate in float64.
    live = [(out64, g.double()) for out64, g in zip(expected, grads, strict=True) if out64.requires_grad]
    torch.autograd.backward([out64 for out64, _ in live], [g for _, g in live])

    bound = TOLERANCE[dtype]
    for out, out64 in zip(outputs, expected, strict=True):
        assert out.dtype == dtype and out.shape == out64.shape and out.is_contiguous()
        assert relative_error(out, out64) < bound
    if x.requires_grad:
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        assert relative_error(x.grad, ref.x.grad) < bound
    else:
        assert x.grad is None
    for i, projection in enumerate(projections):
        # The base is frozen: never a gradient, dense or packed, nor for its bias.
        assert projection.weight.grad is None
        assert projection.bias is None or projection.bias.grad is None
        if projection.lora_a is None:
            continue
        assert projection.lora_a.grad.dtype == projection.lora_a.dtype
        assert projection.lora_b.grad.dtype == projection.lora_b.dtype
        assert relative_error(projection.lora_a.grad, ref.a[i].grad) < bound, f"dA of projection {i}"
        assert relative_error(projection.lora_b.grad, ref.b[i].grad) < bound, f"dB of projection {i}"
    return outputs


def qkv_reference(ref: Reference) -> list[torch.Tensor]:
    return [ref.project(i, ref.x) for i in range(3)]


def o_reference(ref: Reference) -> list[torch.Tensor]:
    return [ref.project(0, ref.x)]


def mlp_reference(ref: Reference) -> list[torch.Tensor]:
    hidden = F.silu(ref.project(0, ref.x)) * ref.project(1, ref.x)
    return [ref.project(2, hidden)]


def qkv_projections(
    dtype, gen, specs: Sequence[Spec], nf4: Sequence[str] = ("dense",) * 3, biases: Sequence[bool] = NO_BIAS
) -> list[LoRAWeights]:
    widths = (Q_OUT, KV_OUT, KV_OUT)
    return [
        make_projection(w, HIDDEN, dtype, gen, s, nf4=n, bias=b)
        for w, s, n, b in zip(widths, specs, nf4, biases, strict=True)
    ]


def mlp_projections(
    dtype, gen, specs: Sequence[Spec], nf4: Sequence[str] = ("dense",) * 3, biases: Sequence[bool] = NO_BIAS
) -> list[LoRAWeights]:
    shapes = ((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
    return [
        make_projection(*shape, dtype, gen, s, nf4=n, bias=b)
        for shape, s, n, b in zip(shapes, specs, nf4, biases, strict=True)
    ]


# Dense bases -------------------------------------------------------------------------------------------------------

# (LoRA per projection, bias per projection).
QKV_CASES = {
    # A different rank per projection, rank 1 among them, scales other than 1.
    "ranks-8-1-4": ([(8, 2.0), (1, 0.5), (4, 1.5)], NO_BIAS),
    # k without an adapter between two with one: its output is the base GEMM only, its rank 0 in the stacked xa.
    "k-without-lora": ([(4, 0.25), None, (2, 3.0)], NO_BIAS),
    # Qwen2: a frozen bias on q, k and v, added in the GEMM epilogue.
    "qwen2-bias": ([(8, 2.0), (1, 0.5), (4, 1.5)], QWEN2_BIAS),
    # A biased launch with q unbiased (its bias loads masked off), k biased without an adapter, v with both.
    "mixed-bias": ([(4, 0.25), None, (2, 3.0)], (False, True, True)),
    # One scale for all three (as peft makes them): backward takes them as one adapter of rank 8 + 1 + 4.
    "one-scale": ([(8, 2.0), (1, 2.0), (4, 2.0)], NO_BIAS),
}


@pytest.mark.parametrize("case", QKV_CASES)
@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_qkv_against_float64(kernel_path, gen, dtype, lead, case):
    specs, biases = QKV_CASES[case]
    projections = qkv_projections(dtype, gen, specs, biases=biases)
    x = random_tensor((*lead, HIDDEN), dtype, gen).requires_grad_()

    q, k, v = run_and_compare(lora_qkv, qkv_reference, x, projections, dtype, gen)

    assert q.shape == (*lead, Q_OUT) and k.shape == v.shape == (*lead, KV_OUT)
    assert type(q.grad_fn).__name__ == "LoRAQKVFunctionBackward"
    assert q.grad_fn is k.grad_fn is v.grad_fn  # one node for the three outputs


# (LoRA, bias). rank 33: wider than the kernel's smallest rank tile (16) and not a power of two.
O_CASES = {
    "rank-1": ((1, 3.0), False),
    "rank-33": ((33, 0.5), False),
    "no-adapter": (None, False),
    "rank-33-bias": ((33, 0.5), True),
    # A bias without LoRA: the kernel variant with the bias epilogue and no low-rank term.
    "no-adapter-bias": (None, True),
}


@pytest.mark.parametrize("case", O_CASES)
@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_o_against_float64(kernel_path, gen, dtype, lead, case):
    # o_proj reads heads · head_dim and writes hidden: [48, 72], not square.
    lora, bias = O_CASES[case]
    projection = make_projection(HIDDEN, Q_OUT, dtype, gen, lora, bias=bias)
    x = random_tensor((*lead, Q_OUT), dtype, gen).requires_grad_()

    (y,) = run_and_compare(lora_o, o_reference, x, [projection], dtype, gen)

    assert y.shape == (*lead, HIDDEN)
    assert type(y.grad_fn).__name__ == "LoRAOFunctionBackward"


MLP_CASES = {
    "ranks-4-1-8": ([(4, 2.0), (1, 0.5), (8, 1.25)], NO_BIAS),
    "up-without-lora": ([(2, 0.75), None, (1, 4.0)], NO_BIAS),
    # Llama's mlp_bias: gate and up biased before the SwiGLU, down after it.
    "mlp-bias": ([(4, 2.0), (1, 0.5), (8, 1.25)], (True, True, True)),
    # gate and up of one scale: their backward is grouped; down's scale differs (a group of its own anyway).
    "gate-up-one-scale": ([(4, 2.0), (1, 2.0), (8, 0.5)], NO_BIAS),
}


@pytest.mark.parametrize("case", MLP_CASES)
@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_lora_mlp_against_float64(kernel_path, gen, dtype, lead, case):
    specs, biases = MLP_CASES[case]
    projections = mlp_projections(dtype, gen, specs, biases=biases)
    x = random_tensor((*lead, HIDDEN), dtype, gen).requires_grad_()

    (y,) = run_and_compare(lora_mlp, mlp_reference, x, projections, dtype, gen)

    assert y.shape == (*lead, HIDDEN)
    assert type(y.grad_fn).__name__ == "LoRAMLPFunctionBackward"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qkv", "o", "mlp"])
def test_input_without_grad_still_trains_lora(kernel_path, gen, dtype, kind):
    # The first layer's input is an embedding output that often needs no gradient: dX is skipped, dA / dB are not.
    if kind == "qkv":
        function, reference = lora_qkv, qkv_reference
        projections = qkv_projections(dtype, gen, [(3, 2.0), (1, 1.0), None])
    elif kind == "o":
        function, reference = lora_o, o_reference
        projections = [make_projection(HIDDEN, Q_OUT, dtype, gen, (5, 0.5))]
    else:
        function, reference = lora_mlp, mlp_reference
        projections = mlp_projections(dtype, gen, [(3, 2.0), None, (1, 0.5)])
    in_features = Q_OUT if kind == "o" else HIDDEN
    x = random_tensor((2, 19, in_features), dtype, gen)

    run_and_compare(function, reference, x, projections, dtype, gen)


def test_fp32_adapters_on_fp16_activations(kernel_path, gen):
    # peft keeps adapters in fp32 over a 16-bit base; without autocast the projection computes in x's dtype and
    # hands each gradient back in its parameter's dtype.
    dtype = torch.float16
    projections = [
        replace(p, lora_a=p.lora_a.detach().float().requires_grad_(), lora_b=p.lora_b.detach().float().requires_grad_())
        for p in mlp_projections(dtype, gen, [(4, 2.0), (2, 0.5), (3, 1.0)])
    ]
    x = random_tensor((2, 19, HIDDEN), dtype, gen).requires_grad_()

    run_and_compare(lora_mlp, mlp_reference, x, projections, dtype, gen)

    assert all(p.lora_a.grad.dtype == p.lora_b.grad.dtype == torch.float32 for p in projections)


def test_output_without_gradient_gives_zero_lora_gradients(kernel_path, gen):
    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(4, 2.0), (2, 1.0), (3, 0.5)])
    x = random_tensor((37, HIDDEN), dtype, gen).requires_grad_()
    dq, dk = random_tensor((37, Q_OUT), dtype, gen), random_tensor((37, KV_OUT), dtype, gen)

    q, k, _ = lora_qkv(x, *projections)
    torch.autograd.backward([q, k], [dq, dk])  # V unused

    ref = Reference(x, projections)
    torch.autograd.backward([ref.project(0, ref.x), ref.project(1, ref.x)], [dq.double(), dk.double()])
    assert relative_error(x.grad, ref.x.grad) < TOLERANCE[dtype]
    for i in (0, 1):
        assert relative_error(projections[i].lora_a.grad, ref.a[i].grad) < TOLERANCE[dtype]
        assert relative_error(projections[i].lora_b.grad, ref.b[i].grad) < TOLERANCE[dtype]
    v = projections[2]
    for grad in (v.lora_a.grad, v.lora_b.grad):
        assert grad is None or not grad.any()


def test_strided_rows_are_read_in_place(kernel_path, gen):
    # A column slice of a wider buffer: rows strided, columns contiguous, reshape keeps the view.
    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(2, 1.5), (1, 2.0), (2, 0.5)])
    wide = random_tensor((37, HIDDEN + 16), dtype, gen).requires_grad_()
    x = wide[:, 8 : 8 + HIDDEN]
    x.retain_grad()
    assert not x.is_contiguous()

    run_and_compare(lora_qkv, qkv_reference, x, projections, dtype, gen)

    assert not wide.grad[:, :8].any() and not wide.grad[:, 8 + HIDDEN :].any()


# What forward keeps for backward -----------------------------------------------------------------------------------


def saved_during(function: Callable[[], object]) -> tuple[object, list[torch.Tensor]]:
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, saved


def activations(saved: Sequence[torch.Tensor], projections: Sequence[LoRAWeights]) -> list[torch.Tensor]:
    """The saved tensors that are not a weight or an adapter (those are parameters, kept by the model anyway)."""
    parameters = {t.data_ptr() for p in projections for t in (p.weight, p.lora_a, p.lora_b) if t is not None}
    return [t for t in saved if t.data_ptr() not in parameters]


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("biases", [NO_BIAS, QWEN2_BIAS], ids=["no-bias", "qwen2-bias"])
@pytest.mark.parametrize("nf4", ["dense", "params4bit-nested"])
def test_qkv_saves_x_and_xa_only(kernel_path, gen, nf4, biases):
    # The biases are not saved either: no gradient needs them (activations() does not count them as parameters).
    dtype = torch.float32
    ranks = [(8, 2.0), (1, 0.5), (4, 1.0)]
    projections = qkv_projections(dtype, gen, ranks, nf4=(nf4,) * 3, biases=biases)
    x = random_tensor((37, HIDDEN), dtype, gen).requires_grad_()

    (q, k, v), saved = saved_during(lambda: lora_qkv(x, *projections))

    outputs = (q, k, v)
    for t in saved:
        assert all(t.data_ptr() != out.data_ptr() for out in outputs)
        assert all(t.shape != out.shape for out in outputs)
    element = x.element_size()
    total_rank = sum(r for r, _ in ranks)
    assert nbytes(activations(saved, projections)) == x.numel() * element + 37 * total_rank * element
    q.sum().backward()  # the saved set is enough for backward


def test_o_saves_x_and_xa_only(kernel_path, gen):
    dtype = torch.float32
    o = make_projection(HIDDEN, Q_OUT, dtype, gen, (6, 2.0))
    x = random_tensor((2, 19, Q_OUT), dtype, gen).requires_grad_()

    y, saved = saved_during(lambda: lora_o(x, o))

    assert all(t.data_ptr() != y.data_ptr() for t in saved)
    assert nbytes(activations(saved, [o])) == (x.numel() + 38 * 6) * x.element_size()


def test_mlp_saves_inputs_gate_up_and_xa_not_the_product(kernel_path, gen):
    dtype = torch.float32
    ranks = [(2, 1.0), (3, 0.5), (5, 2.0)]
    projections = mlp_projections(dtype, gen, ranks)
    x = random_tensor((37, HIDDEN), dtype, gen).requires_grad_()

    y, saved = saved_during(lambda: lora_mlp(x, *projections))

    assert all(t.data_ptr() != y.data_ptr() for t in saved)
    wide = [t for t in activations(saved, projections) if t.shape == (37, INTERMEDIATE)]
    assert len(wide) == 2  # gate and up pre-activations; H = silu(gate) * up is recomputed
    element = x.element_size()
    expected = x.numel() + 2 * 37 * INTERMEDIATE + 37 * (2 + 3) + 37 * 5
    assert nbytes(activations(saved, projections)) == expected * element


@pytest.mark.parametrize("down_lora", [(5, 2.0), None], ids=["down-lora", "down-frozen"])
def test_mlp_backward_rebuilds_h_in_the_gate_backward_launch(kernel_path, gen, monkeypatch, down_lora):
    """H is needed again in backward only for down_proj's dA: the gate's backward launch writes it (no second
    forward launch), and only when down has an adapter to train."""
    from fastft.kernels import gate_kernels

    forward_launches, hidden_written = [], []
    launch_forward, launch_backward = gate_kernels.launch_forward, gate_kernels.launch_backward

    def counted_forward(*args, **kwargs):
        forward_launches.append(1)
        return launch_forward(*args, **kwargs)

    def counted_backward(*args, hidden=None, **kwargs):
        hidden_written.append(hidden is not None)
        return launch_backward(*args, hidden=hidden, **kwargs)

    monkeypatch.setattr(gate_kernels, "launch_forward", counted_forward)
    monkeypatch.setattr(gate_kernels, "launch_backward", counted_backward)
    projections = mlp_projections(torch.float32, gen, [(2, 1.0), (3, 0.5), down_lora])
    x = random_tensor((37, HIDDEN), torch.float32, gen).requires_grad_()

    run_and_compare(lora_mlp, mlp_reference, x, projections, torch.float32, gen)

    if kernel_path == "reference":
        assert forward_launches == [] and hidden_written == []
    else:
        assert len(forward_launches) == 1  # the forward's; backward launched none
        assert hidden_written == [down_lora is not None]


def test_function_classes_are_the_graph_nodes(kernel_path, gen):
    dtype = torch.float32
    x = random_tensor((5, HIDDEN), dtype, gen).requires_grad_()
    q, _, _ = lora_qkv(x, *qkv_projections(dtype, gen, [(1, 1.0), None, (2, 1.0)]))
    y = lora_mlp(x, *mlp_projections(dtype, gen, [(1, 1.0), (1, 1.0), (1, 1.0)]))
    o = lora_o(q, make_projection(HIDDEN, Q_OUT, dtype, gen, (1, 1.0)))
    for out, function in ((q, LoRAQKVFunction), (y, LoRAMLPFunction), (o, LoRAOFunction)):
        assert type(out.grad_fn).__name__ == f"{function.__name__}Backward"


# Shape contracts ---------------------------------------------------------------------------------------------------


def _replace(projections, index, **changes):
    projections = list(projections)
    projections[index] = replace(projections[index], **changes)
    return projections


def test_qkv_shape_errors_name_projection_and_shapes(gen):
    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(4, 1.0), (2, 1.0), (3, 1.0)])
    x = random_tensor((5, HIDDEN), dtype, gen)

    wrong_a = _replace(projections, 1, lora_a=torch.zeros(2, HIDDEN - 1))
    with pytest.raises(
        ShapeContractError,
        match=r"lora_qkv: k_proj: LoRA A must be \[r, in\] = \[r, 48\] for a base weight of shape \[24, 48\], "
        r"got \[2, 47\]",
    ):
        lora_qkv(x, *wrong_a)

    wrong_b = _replace(projections, 2, lora_b=torch.zeros(KV_OUT, 4))
    with pytest.raises(
        ShapeContractError,
        match=r"lora_qkv: v_proj: LoRA B must be \[out, r\] = \[24, 3\] .*\[24, 48\] and A of shape \[3, 48\], "
        r"got \[24, 4\]",
    ):
        lora_qkv(x, *wrong_b)

    with pytest.raises(
        ShapeContractError,
        match=r"lora_qkv: q_proj: x must be \[\.\.\., in_features\] = \[\.\.\., 48\] for a base weight of shape "
        r"\[72, 48\], got x of shape \[2, 3, 47\]",
    ):
        lora_qkv(random_tensor((2, 3, HIDDEN - 1), dtype, gen), *projections)

    wrong_bias = _replace(projections, 1, bias=torch.zeros(Q_OUT))
    with pytest.raises(
        ShapeContractError,
        match=r"lora_qkv: k_proj: the bias must be \[out\] = \[24\] for a base weight of shape \[24, 48\], "
        r"got a bias of shape \[72\]",
    ):
        lora_qkv(x, *wrong_bias)
    with pytest.raises(ShapeContractError, match=r"lora_qkv: q_proj: the bias must be \[out\] = \[72\].*\[1, 72\]"):
        lora_qkv(x, *_replace(projections, 0, bias=torch.zeros(1, Q_OUT)))
    with pytest.raises(TypeError, match=r"lora_qkv: v_proj: the bias must be float32 / float16 / bfloat16"):
        lora_qkv(x, *_replace(projections, 2, bias=torch.zeros(KV_OUT, dtype=torch.int64)))

    # GQA widths are free, but q, k and v must all read the same hidden size.
    wrong_v = _replace(projections, 2, weight=torch.zeros(KV_OUT, HIDDEN + 8), lora_a=None, lora_b=None)
    with pytest.raises(ShapeContractError, match=r"lora_qkv: v_proj: .*\[24, 56\], got x of shape \[5, 48\]"):
        lora_qkv(x, *wrong_v)


def test_o_shape_errors_name_projection_and_shapes(gen):
    dtype = torch.float32
    o = make_projection(HIDDEN, Q_OUT, dtype, gen, (2, 1.0))
    x = random_tensor((5, Q_OUT), dtype, gen)
    (wrong_a,) = _replace([o], 0, lora_a=torch.zeros(2, HIDDEN))
    with pytest.raises(ShapeContractError, match=r"lora_o: o_proj: LoRA A .*\[48, 72\], got \[2, 48\]"):
        lora_o(x, wrong_a)
    (wrong_b,) = _replace([o], 0, lora_b=torch.zeros(HIDDEN, 1))
    with pytest.raises(
        ShapeContractError, match=r"lora_o: o_proj: LoRA B must be \[out, r\] = \[48, 2\].*got \[48, 1\]"
    ):
        lora_o(x, wrong_b)
    # o_proj reads heads · head_dim (72), not hidden (48).
    with pytest.raises(ShapeContractError, match=r"lora_o: o_proj: x must be .*\[48, 72\], got x of shape \[5, 48\]"):
        lora_o(random_tensor((5, HIDDEN), dtype, gen), o)


def test_mlp_shape_errors_name_projection_and_shapes(gen):
    dtype = torch.float32
    projections = mlp_projections(dtype, gen, [(2, 1.0), (3, 1.0), (4, 1.0)])
    x = random_tensor((5, HIDDEN), dtype, gen)

    with pytest.raises(
        ShapeContractError, match=r"lora_mlp: gate_proj: x must be .*\[80, 48\], got x of shape \[5, 47\]"
    ):
        lora_mlp(random_tensor((5, HIDDEN - 1), dtype, gen), *projections)
    wrong_a = _replace(projections, 1, lora_a=torch.zeros(3, INTERMEDIATE))
    with pytest.raises(ShapeContractError, match=r"lora_mlp: up_proj: LoRA A .*\[80, 48\], got \[3, 80\]"):
        lora_mlp(x, *wrong_a)
    wrong_b = _replace(projections, 2, lora_b=torch.zeros(HIDDEN, 5))
    with pytest.raises(
        ShapeContractError, match=r"lora_mlp: down_proj: LoRA B .*= \[48, 4\].*\[48, 80\].*got \[48, 5\]"
    ):
        lora_mlp(x, *wrong_b)
    wrong_up = _replace(projections, 1, weight=torch.zeros(INTERMEDIATE + 1, HIDDEN), lora_a=None, lora_b=None)
    with pytest.raises(ShapeContractError, match=r"lora_mlp: up_proj must be .*\[80, 48\].*got \[81, 48\]"):
        lora_mlp(x, *wrong_up)
    wrong_down = _replace(projections, 2, weight=torch.zeros(HIDDEN, INTERMEDIATE + 1), lora_a=None, lora_b=None)
    with pytest.raises(ShapeContractError, match=r"lora_mlp: down_proj: .*\[48, 81\]"):
        lora_mlp(x, *wrong_down)


def test_nf4_adapter_checked_against_the_logical_shape(gen):
    # A packed weight is [out·in/2, 1] bytes; the adapter is checked against the [out, in] its quant_state holds.
    dtype = torch.float32
    projections = qkv_projections(dtype, gen, [(2, 1.0), (2, 1.0), (2, 1.0)], nf4=("params4bit-nested",) * 3)
    wrong_b = _replace(projections, 1, lora_b=torch.zeros(KV_OUT + 1, 2))
    with pytest.raises(ShapeContractError, match=r"lora_qkv: k_proj: LoRA B .*= \[24, 2\].*\[24, 48\].*\[25, 2\]"):
        lora_qkv(random_tensor((5, HIDDEN), dtype, gen), *wrong_b)
    # A Params4bit rebuilt as a plain Parameter lost its quant_state: refused, never a matmul against the bytes.
    lost = _replace(projections, 0, weight=torch.nn.Parameter(projections[0].weight.data, requires_grad=False))
    lost_message = r"lora_qkv: q_proj: .*packed 4-bit weight of shape \[1728, 1\] needs a quant_state"
    with pytest.raises(ShapeContractError, match=lost_message):
        lora_qkv(random_tensor((5, HIDDEN), dtype, gen), *lost)


def test_a_trainable_base_weight_is_refused_not_silently_frozen(gen):
    projections = qkv_projections(torch.float32, gen, [(2, 1.0), (2, 1.0), (2, 1.0)])
    trainable = _replace(projections, 2, weight=projections[2].weight.clone().requires_grad_())
    x = random_tensor((5, HIDDEN), torch.float32, gen)
    with pytest.raises(ValueError, match="lora_qkv: v_proj: the base weight requires grad"):
        lora_qkv(x, *trainable)
    with torch.no_grad():  # inference needs no gradient, so there the weight may stay trainable
        assert lora_qkv(x, *trainable)[2].shape == (5, KV_OUT)


@pytest.mark.parametrize("kind", ["qkv", "o"])
def test_a_trainable_bias_is_refused_not_silently_frozen(gen, kind):
    dtype = torch.float32
    if kind == "qkv":
        function, names, index = lora_qkv, "lora_qkv: k_proj", 1
        projections = qkv_projections(dtype, gen, [(2, 1.0), (2, 1.0), (2, 1.0)], biases=QWEN2_BIAS)
    else:
        function, names, index = lora_o, "lora_o: o_proj", 0
        projections = [make_projection(HIDDEN, Q_OUT, dtype, gen, (2, 1.0), bias=True)]
    trainable = _replace(projections, index, bias=projections[index].bias.clone().requires_grad_())
    x = random_tensor((5, Q_OUT if kind == "o" else HIDDEN), dtype, gen)
    with pytest.raises(ValueError, match=f"{names}: the bias requires grad.*freeze it"):
        function(x, *trainable)
    with torch.no_grad():  # inference: the bias takes part in the output, and needs no gradient
        out = function(x, *trainable)
    out = out[index] if kind == "qkv" else out
    ref = Reference(x, trainable)
    assert relative_error(out, ref.project(index, ref.x)) < TOLERANCE[dtype]
