"""The grouped-expert GEMM reading per-expert weights through an address table (kernels/moe_expert_table.py, the
``TABLE`` variant of kernels/moe_grouped_gemm.py), as transformers 4.x's per-expert modules store them: every GEMM
against float64, through the Triton kernels (the interpreter on CPU) and the torch reference; the whole LoRA-MoE
experts (forward and every gradient) on tables; the checks made when a table is built and at each call."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, TOLERANCE, random_tensor, relative_error
from test_kernel_moe import MOE_TOLERANCE, Case, check, make_case

from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_moe_experts import LoRAMoEExperts
from fastft.kernels.lora_projection import LoRAWeights
from fastft.kernels.moe_expert_table import ExpertTable
from fastft.kernels.moe_grouped_gemm import grouped_gemm
from fastft.kernels.moe_route import route


def _split(stacked: torch.Tensor, parts: int, transposed: bool = False) -> list[list[torch.Tensor]]:
    """Each expert's rows of ``stacked [E, n, K]`` in ``parts`` separate tensors (own storage, not views of one
    buffer), stored transposed (column-major) when asked."""
    rows = stacked.shape[1] // parts
    out = []
    for p in range(parts):
        chunk = stacked[:, p * rows : (p + 1) * rows]
        if transposed:
            out.append([t.t().contiguous().t() for t in chunk])
        else:
            out.append([t.clone() for t in chunk])
    return out


class TableCase(Case):
    """A :class:`Case` whose experts read per-expert copies of its 3-D weights through address tables."""

    def experts(self) -> LoRAMoEExperts:
        a1, b1, a2, b2 = self.adapters
        gate_up = ExpertTable(_split(self.gate_up.detach(), 2), "t.gate|up")
        down = ExpertTable(_split(self.down.detach(), 1), "t.down")
        return LoRAMoEExperts(
            LoRAWeights(gate_up, a1, b1, self.scales[0]), LoRAWeights(down, a2, b2, self.scales[1]), "silu"
        )


def table_case(gen: torch.Generator, dtype: torch.dtype, **kwargs) -> TableCase:
    return TableCase(**vars(make_case(gen, dtype, **kwargs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_experts_on_tables_against_float64(kernel_path, gen, dtype):
    check(table_case(gen, dtype), dtype, gen)


def test_experts_on_tables_odd_shapes(kernel_path, gen):
    # gate | up's split (I = 20) inside a column block and inside a K step of the backward; H and r not multiples
    # of anything; top-k 3.
    case = table_case(gen, torch.float32, experts=5, hidden=30, inter=20, rank=5, tokens=13, top_k=3)
    check(case, torch.float32, gen)


def test_experts_on_tables_without_tokens_get_exactly_zero_lora_gradients(kernel_path, gen):
    unused = (0, 3)
    case = table_case(gen, torch.float32, experts=5, unused=unused)
    grads = check(case, torch.float32, gen)
    for name in ("A1", "B1", "A2", "B2"):
        for e in range(5):
            norm = grads[name][e].abs().max().item()
            assert (norm == 0.0) if e in unused else (norm > 0.0), (name, e)


@pytest.mark.parametrize("lora", [(False, True), (True, False)], ids=["down only", "gate_up only"])
def test_experts_on_tables_one_projection_without_lora(kernel_path, gen, lora):
    check(table_case(gen, torch.float32, lora=lora), torch.float32, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
def test_table_gemm_against_float64(kernel_path, gen, dtype, parts, transposed, column_major):
    # Y = w · (X W_eᵀ + s (X A_eᵀ) B_eᵀ) over gathered tokens, scattered to (token, slot) order; W_e two parts
    # (gate | up rows; transposed: the split along K, as dX reads it) or one, each expert its own tensor.
    experts, n_part, k_dim, tokens, top_k, rank = 5, 20, 36, 11, 2, 3
    stacked = random_tensor((experts, parts * n_part, k_dim), dtype, gen, k_dim**-0.5)
    table = ExpertTable(_split(stacked, parts, column_major), "t")
    weight = stacked
    if transposed:
        table, weight = table.transpose(1, 2), stacked.transpose(1, 2)
    n, k = weight.shape[1], weight.shape[2]
    logits = torch.randn((tokens, experts), generator=gen)
    index = logits.topk(top_k, dim=-1).indices.to(KERNEL_DEVICE)
    routing = route(index, experts, "t")
    x = random_tensor((tokens, k), dtype, gen)
    xa = random_tensor((routing.rows, rank), dtype, gen)
    lora_b = random_tensor((experts, n, rank), dtype, gen, 0.3)
    row_scale = random_tensor((routing.rows,), dtype, gen)
    out = grouped_gemm(
        x, table, routing, gather=True, xa=xa, lora_b=lora_b, scale=0.5, row_scale=row_scale, scatter=True
    )
    expected = torch.empty((routing.rows, n), dtype=torch.float64)
    w64, x64 = weight.double().cpu(), x.double().cpu()
    token, expert = routing.token.cpu(), routing.expert.cpu()
    for m in range(routing.rows):
        e = int(expert[m])
        row = x64[token[m]] @ w64[e].T + 0.5 * (xa[m].double().cpu() @ lora_b[e].double().cpu().T)
        expected[m] = row * row_scale[m].double().cpu()
    expected = expected[routing.inverse.cpu()]
    assert out.shape == (routing.rows, n) and out.dtype == dtype
    assert relative_error(out.cpu(), expected) <= TOLERANCE[dtype]


def test_a_stale_table_is_refused(gen):
    # model.to / .half() / param.data = ... keep a Parameter but move its storage: the old address would read freed
    # memory, so the call refuses instead.
    case = table_case(gen, torch.float32)
    experts = case.experts()
    moved = experts.gate_up.weight.parts[1][2]
    moved.data = moved.data.clone()
    with pytest.raises(RuntimeError, match=r"t\.gate\|up: expert 2's weight \(part 1\) moved since its address table"):
        experts(case.x, case.index, case.weights)


def test_tables_refuse_mismatched_experts_by_name():
    ok = [torch.zeros(4, 6) for _ in range(3)]
    with pytest.raises(ShapeContractError, match=r"blk: expert 1's weight \(part 0\) is \[4, 7\].*expected \[4, 6\]"):
        ExpertTable([[ok[0], torch.zeros(4, 7), ok[2]]], "blk")
    strided = torch.zeros(6, 4).t()
    with pytest.raises(ShapeContractError, match=r"expert 2's weight \(part 0\) .* strides \(1, 4\).*like expert 0"):
        ExpertTable([[ok[0], ok[1], strided]], "blk")
    with pytest.raises(ShapeContractError, match=r"part 1 holds 2 expert weights, expected 3"):
        ExpertTable([ok, ok[:2]], "blk")
    with pytest.raises(TypeError, match=r"expert 1's weight \(part 0\) is torch.float16"):
        ExpertTable([[ok[0], ok[1].half(), ok[2]]], "blk")
    with pytest.raises(TypeError, match=r"2-D float32 / float16 / bfloat16 tensors"):
        ExpertTable([[torch.zeros(4, 6, dtype=torch.uint8)]], "blk")


def test_table_and_stacked_weights_give_the_same_experts(gen):
    # The same layer on one stacked tensor and on per-expert tables: equal outputs and gradients.
    case = table_case(gen, torch.float32, experts=4)
    plain = Case(**vars(case))
    leaves = case.leaves()
    results = []
    for source in (plain, case):
        out = source.experts()(case.x, case.index, case.weights)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    for a, b in zip(*results, strict=True):
        assert relative_error(b, a) <= MOE_TOLERANCE[torch.float32]
