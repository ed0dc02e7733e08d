"""LoRA-MoE experts (kernels/lora_moe_experts.py): output and every gradient (x, the router weights, each expert's LoRA
A and B) against a float64 per-expert loop written out here, through the Triton kernels (the interpreter on CPU) and
the torch reference, in fp32 and fp16; experts without tokens; odd shapes; the expert-sorted routing itself."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, TOLERANCE, random_tensor, relative_error

from fastft.kernels.lora_moe_experts import LoRAMoEExperts
from fastft.kernels.lora_projection import LoRAWeights
from fastft.kernels.moe_route import block_table, route

# The kernels round gate | up, H and the LoRA products to fp16 on the way (stock does too, at other places), so fp16
# gets a wider bound than a single GEMM's.
MOE_TOLERANCE = {**TOLERANCE, torch.float16: 5e-3}


@dataclass
class Case:
    """One MoE layer's tensors; the base weights in the layout the kernels take (views of the stored ones)."""

    x: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    adapters: list[torch.Tensor | None]
    scales: tuple[float, float]
    biases: tuple[torch.Tensor | None, torch.Tensor | None]
    activation: str
    interleaved: bool
    limit: float

    def experts(self) -> LoRAMoEExperts:
        a1, b1, a2, b2 = self.adapters
        return LoRAMoEExperts(
            LoRAWeights(self.gate_up, a1, b1, self.scales[0], bias=self.biases[0]),
            LoRAWeights(self.down, a2, b2, self.scales[1], bias=self.biases[1]),
            self.activation,
            interleaved=self.interleaved,
            alpha=1.702,
            limit=self.limit,
        )

    def leaves(self) -> list[torch.Tensor]:
        return [self.x, self.weights, *[a for a in self.adapters if a is not None]]


def make_case(
    gen: torch.Generator,
    dtype: torch.dtype,
    *,
    experts: int = 6,
    hidden: int = 32,
    inter: int = 48,
    rank: int = 8,
    tokens: int = 24,
    top_k: int = 2,
    gpt_oss: bool = False,
    lora: tuple[bool, bool] = (True, True),
    unused: tuple[int, ...] = (),
) -> Case:
    if gpt_oss:
        # gpt-oss stores [E, H, 2I] with gate / up columns interleaved, and down as [E, I, H]: passed as views.
        gate_up = random_tensor((experts, hidden, 2 * inter), dtype, gen, hidden**-0.5).transpose(1, 2)
        down = random_tensor((experts, inter, hidden), dtype, gen, inter**-0.5).transpose(1, 2)
        biases = (random_tensor((experts, 2 * inter), dtype, gen, 0.5), random_tensor((experts, hidden), dtype, gen))
    else:
        gate_up = random_tensor((experts, 2 * inter, hidden), dtype, gen, hidden**-0.5)
        down = random_tensor((experts, hidden, inter), dtype, gen, inter**-0.5)
        biases = (None, None)
    adapters: list[torch.Tensor | None] = []
    for has, (out_f, in_f) in zip(lora, ((2 * inter, hidden), (hidden, inter)), strict=True):
        if has:
            # B non-zero (peft starts it at zero, which would hide every dA error).
            adapters += [
                random_tensor((experts, rank, in_f), dtype, gen, in_f**-0.5).requires_grad_(),
                random_tensor((experts, out_f, rank), dtype, gen, 0.3).requires_grad_(),
            ]
        else:
            adapters += [None, None]
    logits = torch.randn((tokens, experts), generator=gen, dtype=torch.float64)
    logits[:, list(unused)] = -torch.inf
    probs, index = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return Case(
        x=random_tensor((tokens, hidden), dtype, gen).requires_grad_(),
        index=index.to(KERNEL_DEVICE),
        weights=probs.to(dtype).to(KERNEL_DEVICE).requires_grad_(),
        gate_up=gate_up,
        down=down,
        adapters=adapters,
        scales=(2.0, 0.5),
        biases=biases,
        activation="gpt_oss" if gpt_oss else "silu",
        interleaved=gpt_oss,
        # fp32: a low limit, so both clamps are hit by unit-scale inputs. fp16: gpt-oss's own 7.0; a gate rounded to
        # the other side of the limit than its float64 value flips its whole gradient, which no bound covers.
        limit=1.0 if gpt_oss and dtype == torch.float32 else 7.0,
    )


def reference(case: Case, leaves: list[torch.Tensor]) -> torch.Tensor:
    """The experts as the stock layer computes them (a loop over experts), in float64, over ``leaves``."""
    x, weights, *adapters_in = leaves
    it = iter(adapters_in)
    adapters = [next(it) if a is not None else None for a in case.adapters]
    a1, b1, a2, b2 = adapters
    s1, s2 = case.scales
    w1, w2 = case.gate_up.double(), case.down.double()
    bias1, bias2 = (b.double() if b is not None else None for b in case.biases)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(case.index == e)
        if token.numel() == 0:
            continue
        xe = x[token]
        gate_up = xe @ w1[e].T
        if a1 is not None:
            gate_up = gate_up + s1 * (xe @ a1[e].T) @ b1[e].T
        if bias1 is not None:
            gate_up = gate_up + bias1[e]
        if case.interleaved:
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if case.activation == "gpt_oss":
            gate = gate.clamp(max=case.limit)
            up = up.clamp(min=-case.limit, max=case.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * 1.702)
        else:
            h = F.silu(gate) * up
        y = h @ w2[e].T
        if a2 is not None:
            y = y + s2 * (h @ a2[e].T) @ b2[e].T
        if bias2 is not None:
            y = y + bias2[e]
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


def check(case: Case, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Run the fused experts and the float64 loop, compare output and every gradient; the fused gradients by name."""
    leaves = case.leaves()
    out = case.experts()(case.x, case.index, case.weights)
    assert out.dtype == dtype and out.shape == case.x.shape
    grad_out = random_tensor(out.shape, dtype, gen)
    grads = torch.autograd.grad(out, leaves, grad_out)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    out64 = reference(case, leaves64)
    grads64 = torch.autograd.grad(out64, leaves64, grad_out.double())
    bound = MOE_TOLERANCE[dtype]
    assert relative_error(out, out64) < bound
    names = ["x", "router weights"] + [
        n for n, a in zip(("A1", "B1", "A2", "B2"), case.adapters, strict=True) if a is not None
    ]
    for name, grad, grad64 in zip(names, grads, grads64, strict=True):
        assert grad.dtype == dtype and grad.shape == grad64.shape, name
        assert relative_error(grad, grad64) < bound, name
    return dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_against_float64(kernel_path, gen, dtype, family):
    check(make_case(gen, dtype, gpt_oss=family == "gpt_oss"), dtype, gen)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_without_tokens_get_exactly_zero_lora_gradients(kernel_path, gen, family):
    unused = (1, 4, 5)
    case = make_case(gen, torch.float32, experts=7, gpt_oss=family == "gpt_oss", unused=unused)
    assert not any(int(e) in unused for e in case.index.flatten())
    grads = check(case, torch.float32, gen)
    for name in ("A1", "B1", "A2", "B2"):
        for e in range(7):
            norm = grads[name][e].abs().max().item()
            assert (norm == 0.0) if e in unused else (norm > 0.0), (name, e)


@pytest.mark.parametrize("lora", [(False, True), (True, False)], ids=["down only", "gate_up only"])
def test_one_projection_without_lora(kernel_path, gen, lora):
    check(make_case(gen, torch.float32, lora=lora), torch.float32, gen)


def test_odd_shapes(kernel_path, gen):
    # Widths and ranks that are not multiples of the tiles or of torch._grouped_mm's 16-byte strides (the reference
    # takes its per-expert loop), top-k 3, a token count that is not a multiple of the row block.
    case = make_case(gen, torch.float32, experts=5, hidden=30, inter=20, rank=5, tokens=13, top_k=3)
    check(case, torch.float32, gen)


def test_leading_dims_and_top_k_equal_to_experts(kernel_path, gen):
    case = make_case(gen, torch.float32, experts=4, tokens=12, top_k=4)
    x3 = case.x.detach().view(3, 4, -1).requires_grad_()
    out = case.experts()(x3, case.index, case.weights)
    flat = case.experts()(case.x, case.index, case.weights)
    assert out.shape == x3.shape
    assert relative_error(out.reshape(flat.shape), flat) < 1e-6
    out.sum().backward()
    assert x3.grad.shape == x3.shape


def test_no_grad_forward_equals_the_recorded_one(kernel_path, gen):
    case = make_case(gen, torch.float32)
    experts = case.experts()
    recorded = experts(case.x, case.index, case.weights)
    with torch.no_grad():
        plain = experts(case.x, case.index, case.weights)
    assert torch.equal(plain, recorded.detach())


def test_a_second_backward_through_the_node_fails_loudly(kernel_path, gen):
    # Backward writes the gate | up gradient over its saved buffer; a retained graph must not read it as activations.
    case = make_case(gen, torch.float32)
    out = case.experts()(case.x, case.index, case.weights).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_routing_sorts_rows_by_expert_and_blocks_never_straddle_experts():
    index = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 3], [2, 0]])
    routing = route(index, num_experts=5)
    flat = index.flatten()
    assert torch.equal(routing.expert, flat[routing.order])
    assert torch.equal(routing.expert, torch.sort(flat, stable=True).values)
    assert routing.offsets.tolist() == [0, 4, 4, 7, 10, 10]  # experts 1 and 4 hold no rows
    assert torch.equal(routing.token, routing.order // 2)
    assert torch.equal(routing.order[routing.inverse], torch.arange(10))
    for block_m in (1, 2, 3, 16):
        experts, starts = block_table(routing, block_m)
        covered = []
        for e, start in zip(experts.tolist(), starts.tolist(), strict=True):
            if e < 0:
                continue
            end = min(start + block_m, routing.offsets[e + 1].item())
            assert routing.offsets[e] <= start < end
            covered += range(start, end)
        assert sorted(covered) == list(range(10))
