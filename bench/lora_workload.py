"""The workloads of ``bench/lora.py``: one fused LoRA group (qkv, o, mlp of a Llama shape; moe, a Qwen3-MoE
layer's experts with LoRA on every expert) built once over the parameters peft made, and the forward + backward step
each system (cublas, triton, auto, peft, grouped_mm, floor) runs on it.

Loaded by ``bench/lora.py`` from this file (the bench folder is kept off ``sys.path``: its ``kernels.py`` would shadow
the PyPI package).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fastft.kernels import gemm_tuner
from fastft.kernels.gemm_tuner import NF4_DEQUANT_ENV
from fastft.kernels.lora_mlp import lora_mlp
from fastft.kernels.lora_o import lora_o
from fastft.kernels.lora_projection import LoRAWeights
from fastft.kernels.lora_qkv import lora_qkv

GROUPS = ("qkv", "o", "mlp", "moe")
NF4_IN_KERNEL = "nf4_in_kernel"
# Per fastft system: the GEMM mode forced for the call and FASTFT_NF4_DEQUANT (None: unset, so the tuner lets the
# buffer and the in-kernel decode compete, as a user's default run does).
SYSTEM_MODES: dict[str, tuple[str, str | None]] = {
    "cublas": ("cublas", None),
    "triton": ("triton", "buffer"),
    "auto": ("auto", None),
    NF4_IN_KERNEL: ("triton", "kernel"),
}


@dataclass(frozen=True)
class Shape:
    """The projections of one decoder layer and the tokens of one micro-batch; ``experts`` (0: a dense model),
    ``top_k`` and ``moe_intermediate`` describe its MoE experts."""

    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    rank: int
    tokens: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0


SHAPES = {
    # 32 heads / 8 kv heads of 128: q 4096 wide, k and v 1024.
    "llama-3-8b": Shape(hidden=4096, q_out=4096, kv_out=1024, intermediate=14336, rank=16, tokens=8192),
    # 32 heads / 8 kv heads of 64: q 2048 wide, k and v 512.
    "llama-3.2-1b": Shape(hidden=2048, q_out=2048, kv_out=512, intermediate=8192, rank=16, tokens=8192),
    # Qwen3-30B-A3B's layer: 32 heads / 4 kv heads of 128 (q 4096 wide, k and v 512), 128 experts of 768, top-8;
    # 8192 tokens route 65536 rows, 512 a expert on average.
    # No dense MLP (intermediate 0): every layer of it is sparse.
    "qwen3-30b-a3b": Shape(
        hidden=2048,
        q_out=4096,
        kv_out=512,
        intermediate=0,
        rank=16,
        tokens=8192,
        experts=128,
        top_k=8,
        moe_intermediate=768,
    ),  # fmt: skip
    # GQA and 8 experts, top-2, at a size the CPU harness check (and the test suite) can afford.
    "tiny": Shape(
        hidden=128,
        q_out=128,
        kv_out=64,
        intermediate=256,
        rank=16,
        tokens=256,
        experts=8,
        top_k=2,
        moe_intermediate=64,
    ),  # fmt: skip
}


def projections_of(shape: Shape, group: str) -> list[tuple[str, int, int]]:
    """``(name, out_features, in_features)`` of each projection of ``group``, in the fused function's order."""
    if group == "qkv":
        return [
            ("q_proj", shape.q_out, shape.hidden),
            ("k_proj", shape.kv_out, shape.hidden),
            ("v_proj", shape.kv_out, shape.hidden),
        ]
    if group == "o":
        return [("o_proj", shape.hidden, shape.q_out)]
    if group == "mlp":
        return [
            ("gate_proj", shape.intermediate, shape.hidden),
            ("up_proj", shape.intermediate, shape.hidden),
            ("down_proj", shape.hidden, shape.intermediate),
        ]
    if group == "moe":
        return [(role, *_MOE_DIMS[role](shape)) for role in _MOE_ROLES]
    raise ValueError(f"unknown group {group!r}; choose from {GROUPS}")


def base_flops(shape: Shape, group: str) -> int:
    """FLOPs of the group's base GEMMs: ``X Wᵀ`` forward and ``dY W`` backward, per projection (for ``moe`` over
    the routed rows, tokens x top-k: each token's experts only)."""
    rows = shape.tokens * (shape.top_k if group == "moe" else 1)
    return sum(2 * 2 * rows * out * inp for _, out, inp in projections_of(shape, group))


class _Group(torch.nn.Module):
    """The projections peft wraps, and what the layer does between them (SwiGLU for the MLP), nothing else."""

    def __init__(self, group: str, layers: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.group = group
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.group == "qkv":
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.group == "o":
            return (self.o_proj(x),)
        # LlamaMLP: down(silu(gate(x)) * up(x)).
        return (self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)),)


def fastft_forward(group: str, x: torch.Tensor, weights: list[LoRAWeights]) -> tuple[torch.Tensor, ...]:
    """fastft's fused function for ``group``; always a tuple of outputs."""
    if group == "qkv":
        return lora_qkv(x, *weights)
    if group == "o":
        return (lora_o(x, weights[0]),)
    return (lora_mlp(x, *weights),)


@dataclass
class Workload:
    """One shape, group and weight format, built once: every system's forward and what correctness compares."""

    group: str
    x: torch.Tensor
    # The group's output gradients, shared by fastft and peft.
    upstream: list[torch.Tensor]
    # The floor's: the same values as one [tokens, Σ out] gradient (qkv), or one per base GEMM (mlp).
    floor_upstream: list[torch.Tensor]
    # Leaves whose .grad a step fills (x, and the floor's MLP hidden state).
    leaves: list[torch.Tensor]
    lora_params: dict[str, torch.Tensor]
    # Dense [out, in] base weights in the compute dtype (dequantised for NF4): the floor's and float64 reference's.
    dense: list[torch.Tensor]
    scales: list[float]
    # "fastft" (run under a system's GEMM mode), "peft", "floor".
    forward: dict[str, Callable[[], tuple[torch.Tensor, ...]]]
    # Storages that exist whatever the system does (inputs, weights, upstream gradients): not counted as saved.
    resident: tuple[torch.Tensor, ...]
    # The class peft wrapped the first projection in (its bitsandbytes Linear4bit for NF4, lora.Linear otherwise).
    peft_layer: str
    names: list[str]
    # moe: the router's fixed choice (top_k_index, top_k_weights) every system is called with.
    routing: tuple[torch.Tensor, torch.Tensor] | None = None
    # What the row records about how the systems ran (moe: the stock experts implementations, the floor's GEMM).
    notes: dict[str, Any] = field(default_factory=dict)


def linear(
    weights: str, dense: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, torch.Tensor]:
    """A bias-free base layer holding ``dense`` (``[out, in]``): ``nn.Linear`` or an NF4 ``Linear4bit``, and the
    dense weight the floor multiplies by (for NF4, bitsandbytes' own dequantisation of the packed weight)."""
    out_features, in_features = dense.shape
    if weights != "nf4":
        layer = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(dense)
        layer.weight.requires_grad_(False)
        return layer, layer.weight.detach()
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4"
    )
    # Quantised from the compute dtype, as a bf16 checkpoint loaded with load_in_4bit is (quant_state.dtype = dtype);
    # double quantisation and blocksize 64 are QLoRA's settings.
    layer.weight = bnb.nn.Params4bit(
        dense.to(dtype), requires_grad=False, blocksize=64, compress_statistics=True, quant_type="nf4", module=layer
    )
    layer = layer.to(device)
    packed = layer.weight
    return layer, bnbf.dequantize_4bit(packed.data, packed.quant_state).to(dtype)


def build_workload(
    shape: Shape, group: str, weights: str, dtype: torch.dtype, device: torch.device, seed: int
) -> Workload:
    """Random base weights, peft's LoRA model over them, and the fastft and floor steps over the same tensors
    (``moe``: :func:`build_moe_workload`)."""
    if group == "moe":
        return build_moe_workload(shape, weights, dtype, device, seed)
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(seed)
    specs = projections_of(shape, group)
    names = [name for name, _, _ in specs]
    layers, dense = {}, []
    for name, out_features, in_features in specs:
        layer, dense_weight = linear(
            weights, torch.randn(out_features, in_features, generator=gen) * 0.02, dtype, device
        )
        layers[name] = layer
        dense.append(dense_weight.contiguous())
    config = LoraConfig(r=shape.rank, lora_alpha=16, target_modules=names, lora_dropout=0.0, bias="none")
    base = _Group(group, layers)
    # transformers marks a model it loaded in 4 bit; peft reads that mark to wrap Linear4bit in its bitsandbytes LoRA
    # layer (peft.tuners.lora.bnb.Linear4bit), and without it falls back to the generic lora.Linear.
    base.is_loaded_in_4bit = weights == "nf4"
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    model.train()

    lora_params, scales, fused_weights = {}, [], []
    with torch.no_grad():
        for name, out_features, in_features in specs:
            module = getattr(model.base_model.model, name)
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            # peft leaves adapters of a 4-bit base in fp32; keep every system in the compute dtype. B is made
            # non-zero (its default zero would hide every dA error), A unit-scale per input feature.
            a.data = (torch.randn(shape.rank, in_features, generator=gen) / math.sqrt(in_features)).to(device, dtype)
            b.data = (torch.randn(out_features, shape.rank, generator=gen) * 0.02).to(device, dtype)
            lora_params[f"{name}.lora_A"], lora_params[f"{name}.lora_B"] = a, b
            scale = float(module.scaling["default"])
            scales.append(scale)
            fused_weights.append(LoRAWeights(module.base_layer.weight, a, b, scale))

    x = torch.randn(shape.tokens, specs[0][2], generator=gen).to(device, dtype).requires_grad_()
    out_widths = [specs[-1][1]] if group == "mlp" else [out for _, out, _ in specs]
    upstream = [torch.randn(shape.tokens, width, generator=gen).to(device, dtype) for width in out_widths]
    leaves = [x]
    # The floor's operands, concatenated once outside the timed step.
    if group == "mlp":
        w_gate_up = torch.cat(dense[:2], dim=0)
        w_down = dense[2]
        hidden = torch.randn(shape.tokens, shape.intermediate, generator=gen).to(device, dtype).requires_grad_()
        leaves.append(hidden)
        floor_upstream = [
            torch.randn(shape.tokens, 2 * shape.intermediate, generator=gen).to(device, dtype),
            upstream[0],
        ]
        floor_weights: tuple[torch.Tensor, ...] = (w_gate_up, w_down)

        def floor_forward() -> tuple[torch.Tensor, ...]:
            return x @ w_gate_up.t(), hidden @ w_down.t()

    else:
        w_cat = torch.cat(dense, dim=0) if len(dense) > 1 else dense[0]
        floor_upstream = [torch.cat(upstream, dim=1) if len(upstream) > 1 else upstream[0]]
        floor_weights = (w_cat,)

        def floor_forward() -> tuple[torch.Tensor, ...]:
            return (x @ w_cat.t(),)

    forward = {
        "fastft": lambda: fastft_forward(group, x, fused_weights),
        "peft": lambda: model(x),
        "floor": floor_forward,
    }
    resident = (
        *leaves,
        *floor_weights,
        *floor_upstream,
        *dense,
        *upstream,
        *lora_params.values(),
        *model.parameters(),
    )
    first = getattr(model.base_model.model, names[0])
    peft_layer = f"{type(first).__module__}.{type(first).__name__}"
    return Workload(
        group, x, upstream, floor_upstream, leaves, lora_params, dense, scales, forward, resident, peft_layer, names
    )


@contextlib.contextmanager
def gemm_mode(system: str) -> Iterator[None]:
    """Run a fastft system's calls with its GEMM mode forced and ``FASTFT_NF4_DEQUANT`` as it needs (the
    environment is restored after; fastft reads it on every call)."""
    mode, decode = SYSTEM_MODES[system]
    previous = os.environ.get(NF4_DEQUANT_ENV)
    if decode is None:
        os.environ.pop(NF4_DEQUANT_ENV, None)
    else:
        os.environ[NF4_DEQUANT_ENV] = decode
    try:
        with gemm_tuner.force(mode):
            yield
    finally:
        if previous is None:
            os.environ.pop(NF4_DEQUANT_ENV, None)
        else:
            os.environ[NF4_DEQUANT_ENV] = previous


def in_mode(system: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run under ``system``'s GEMM mode (fastft systems); peft and floor run as they are."""
    if system not in SYSTEM_MODES:
        return fn

    def wrapped() -> Any:
        with gemm_mode(system):
            return fn()

    return wrapped


def system_forward(workload: Workload, system: str) -> Callable[[], tuple[torch.Tensor, ...]]:
    if system in SYSTEM_MODES:
        return in_mode(system, workload.forward["fastft"])
    return workload.forward[system]


def clear_grads(workload: Workload) -> None:
    """Drop the gradients of the inputs and every LoRA parameter (so none accumulates, and their memory is free)."""
    for leaf in workload.leaves:
        leaf.grad = None
    for param in workload.lora_params.values():
        param.grad = None


def make_step(workload: Workload, system: str) -> Callable[[], None]:
    """One forward + backward of ``system``; gradients are cleared first so none accumulates across steps."""
    forward = workload.forward["fastft" if system in SYSTEM_MODES else system]
    upstream = workload.floor_upstream if system == "floor" else workload.upstream

    def step() -> None:
        clear_grads(workload)
        outputs = forward()
        torch.autograd.backward(list(outputs), list(upstream))

    return in_mode(system, step)


def _experts_implementations() -> tuple[str, ...]:
    """The experts forwards the installed transformers can run: ``eager`` always, ``grouped_mm`` on 5.x."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ("eager",)
    return ("eager", "grouped_mm") if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else ("eager",)


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _Experts(torch.nn.Module):
    """transformers' Qwen3-MoE experts (the fused 3-D layout peft wraps per parameter), called with the router's
    choice; nothing else of the block, as the dense groups hold only their projections."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.experts(x, index, weights),)


def _routing(shape: Shape, x: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE router's choice over ``x`` from random router weights: top-k of the softmax, renormalised."""
    router = torch.randn(shape.experts, shape.hidden, generator=gen).to(x.device, torch.float32) * 0.02
    probabilities = torch.softmax(x.detach().float() @ router.t(), dim=-1)
    weights, index = torch.topk(probabilities, shape.top_k, dim=-1)
    return index, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


def build_moe_workload(shape: Shape, weights: str, dtype: torch.dtype, device: torch.device, seed: int) -> Workload:
    """Random experts of ``shape`` (transformers' ``Qwen3MoeExperts``), peft's LoRA on every expert over them
    (``target_parameters``), a fixed routing from a random router, and every system's step over the same tensors.

    Systems: ``fastft`` (:class:`~fastft.kernels.lora_moe_experts.LoRAMoEExperts` over views of peft's stacked A / B,
    as the model patch calls it), ``peft`` (transformers' eager loop over the experts that got tokens),
    ``grouped_mm`` (transformers' ``grouped_mm`` experts, where it has them) and ``floor`` (the two base grouped
    GEMMs over the rows sorted by expert, no LoRA, no activation).

    Raises:
        ValueError: NF4 weights (fastft trains MoE experts in 16 / 32 bit only), or a shape without experts.
    """
    if weights == "nf4" or not shape.experts:
        raise ValueError(
            f"bench/lora.py moe group: needs dense expert weights and a shape with experts, got weights={weights!r}, "
            f"experts={shape.experts}; pick --dtypes bf16 / fp32 and a shape with experts (qwen3-30b-a3b, tiny)"
        )
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fastft.kernels.lora_moe_experts import LoRAMoEExperts
    from fastft.patches.moe_experts import expert_views

    gen = torch.Generator().manual_seed(seed)
    hidden, inner, experts, rank = shape.hidden, shape.moe_intermediate, shape.experts, shape.rank
    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inner, num_experts=experts, num_experts_per_tok=shape.top_k
    )
    module = Qwen3MoeExperts(config).to(device, dtype)
    dense = [torch.randn(experts, 2 * inner, hidden, generator=gen), torch.randn(experts, hidden, inner, generator=gen)]
    with torch.no_grad():
        for name, value in zip(("gate_up_proj", "down_proj"), dense, strict=True):
            getattr(module, name).copy_(value * 0.02)
            getattr(module, name).requires_grad_(False)
    dense = [module.gate_up_proj.detach(), module.down_proj.detach()]
    lora = LoraConfig(r=rank, lora_alpha=16, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = get_peft_model(_Experts(module), lora, autocast_adapter_dtype=False)
    model.train()
    wrappers = {m.parameter_name: m for m in model.modules() if getattr(m, "parameter_name", None) in _MOE_ROLES}
    lora_params, scales, stacked = {}, [], []
    with torch.no_grad():
        for role in _MOE_ROLES:
            wrapper, (out_f, in_f) = wrappers[role], _MOE_DIMS[role](shape)
            a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
            # peft stacks the E adapters: A [r·E, in] (expert-major), B [out, r·E] (expert e in columns j·E + e).
            a.data = (torch.randn(rank * experts, in_f, generator=gen) / math.sqrt(in_f)).to(device, dtype)
            b.data = (torch.randn(out_f, rank * experts, generator=gen) * 0.02).to(device, dtype)
            lora_params[f"{role}.lora_A"], lora_params[f"{role}.lora_B"] = a, b
            scales.append(float(wrapper.scaling["default"]))
            stacked.append((a, b))

    def views() -> list[LoRAWeights]:
        # Fresh views of peft's parameters per call, as the model patch takes them: gradients reach peft's tensors.
        return [
            LoRAWeights(w, *expert_views(a, b, experts), s) for w, (a, b), s in zip(dense, stacked, scales, strict=True)
        ]

    fused = LoRAMoEExperts(*views(), "silu", name="bench.moe.experts")
    x = torch.randn(shape.tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    index, route = _routing(shape, x, gen)
    route.requires_grad_()
    upstream = [torch.randn(shape.tokens, hidden, generator=gen).to(device, dtype)]
    # The floor's operands: the rows sorted by expert once, outside the timed step.
    rows = shape.tokens * shape.top_k
    order = torch.argsort(index.reshape(-1), stable=True)
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x_sorted = x.detach()[order // shape.top_k].clone().requires_grad_()
    h_sorted = torch.randn(rows, inner, generator=gen).to(device, dtype).requires_grad_()
    floor_upstream = [
        torch.randn(rows, 2 * inner, generator=gen).to(device, dtype),
        torch.randn(rows, hidden, generator=gen).to(device, dtype),
    ]
    grouped = _grouped_mm()

    def floor_forward() -> tuple[torch.Tensor, ...]:
        if grouped is not None:
            return grouped(x_sorted, dense[0].transpose(-2, -1), offs=offsets), grouped(
                h_sorted, dense[1].transpose(-2, -1), offs=offsets
            )
        bounds = [0, *offsets.tolist()]
        pairs = [(slice(bounds[e], bounds[e + 1]), e) for e in range(experts)]
        return (
            torch.cat([x_sorted[s] @ dense[0][e].t() for s, e in pairs]),
            torch.cat([h_sorted[s] @ dense[1][e].t() for s, e in pairs]),
        )

    def stock(implementation: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        def forward() -> tuple[torch.Tensor, ...]:
            config._experts_implementation = implementation
            return model(x, index, route)

        return forward

    implementations = _experts_implementations()
    forward = {
        "fastft": lambda: (fused(x, index, route, tuple(t for w in views() for t in (w.lora_a, w.lora_b))),),
        "peft": stock("eager"),
        "floor": floor_forward,
    }
    if "grouped_mm" in implementations:
        forward["grouped_mm"] = stock("grouped_mm")
    resident = (x, route, index, offsets, x_sorted, h_sorted, *dense, *upstream, *floor_upstream, *lora_params.values())
    resident += tuple(model.parameters())
    notes = {
        "experts_implementation": {
            "peft": "eager",
            **({"grouped_mm": "grouped_mm"} if "grouped_mm" in forward else {}),
        },
        "floor_gemm": "grouped_mm" if grouped is not None else "per-expert torch.mm",
        "routed_rows": rows,
        "experts_with_tokens": int((counts > 0).sum()),
    }
    wrapper = wrappers["down_proj"]
    return Workload(
        "moe", x, upstream, floor_upstream, [x, route, x_sorted, h_sorted], lora_params, dense, scales, forward,
        resident, f"{type(wrapper).__module__}.{type(wrapper).__name__}", list(_MOE_ROLES),
        routing=(index, route), notes=notes,
    )  # fmt: skip


_MOE_ROLES = ("gate_up_proj", "down_proj")
# (out, in) of each expert's projection.
_MOE_DIMS: dict[str, Callable[[Shape], tuple[int, int]]] = {
    "gate_up_proj": lambda shape: (2 * shape.moe_intermediate, shape.hidden),
    "down_proj": lambda shape: (shape.hidden, shape.moe_intermediate),
}


def moe_float64_results(workload: Workload) -> dict[str, torch.Tensor]:
    """The experts with their LoRA in float64, expert by expert, by autograd: outputs, dX and every LoRA gradient
    (A and B in peft's stacked layout, so they compare with every system's)."""
    index, route = workload.routing
    x = workload.x.detach().double().requires_grad_()
    params = {name: p.detach().double().requires_grad_() for name, p in workload.lora_params.items()}
    weights = route.detach().double()
    experts = workload.dense[0].shape[0]

    def project(rows: torch.Tensor, role: int, expert: int) -> torch.Tensor:
        name = workload.names[role]
        a, b = params[f"{name}.lora_A"], params[f"{name}.lora_B"]
        rank = a.shape[0] // experts
        a_e, b_e = a.view(experts, rank, -1)[expert], b.view(b.shape[0], rank, experts)[:, :, expert]
        weight = workload.dense[role][expert].double()
        return rows @ weight.t() + workload.scales[role] * (rows @ a_e.t()) @ b_e.t()

    output = torch.zeros_like(x)
    for expert in range(experts):
        token, slot = torch.where(index == expert)
        if token.numel() == 0:
            continue
        gate, up = project(x[token], 0, expert).chunk(2, dim=-1)
        out = project(F.silu(gate) * up, 1, expert) * weights[token, slot, None]
        output = output.index_add(0, token, out)
    torch.autograd.backward([output], [workload.upstream[0].double()])
    found = {"output": output.detach(), "grad_x": x.grad}
    for name, param in params.items():
        found[f"grad_{name}"] = param.grad
    return found
