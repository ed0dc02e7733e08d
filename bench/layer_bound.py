"""One fused decoder layer against the same operators written as straight-line code: how much of the layer's host
time is fastft's Python (CPU, ``bench/host.py``'s model).

    python bench/layer_bound.py [--rounds 30] [--calls 100] [--out bench/results/layer-bound-cpu.json]

``bench/host.py``'s operator floor says what a step's operators cost with no Python around them at all. This says
what one layer's operators cost with the least Python a hand-written layer needs: the straight-line layer computes
what fastft's node (``fastft.kernels.lora_decoder_layer``) computes for that model (fp32, LoRA on all seven
projections, SDPA without a mask, the torch reference a CPU runs), one line per operator, with the same aten
operators in the same order but for the attention: it calls the attention kernel and its backward directly, where
the node builds an autograd graph through transformers' attention function (which serves every attention
implementation) and walks it back. Both get the same input and output gradient; the record holds the largest
difference of the outputs and of every gradient (zero: the same bits), the operators each dispatches, and the
time per call of a forward and of a forward + backward over alternating rounds, and the median of the rounds' own
ratios. The straight line's operators pass through autograd's dispatch keys (grad mode is off inside a Function's
forward and backward, but the keys stay), which the node's skip (``below_autograd``): that part favours the node.

What the difference means: it is the time the node spends deciding, per call, what a plan made for this layer
could decide once (dtypes, casts, the tuner's GEMM order, which gradients are wanted, the groups' layout), and
walking its general code to get there. It is not a target for this model's layer alone: the same node serves
every family, dtype, device and adapter layout, and a straight-line layer would have to be written (or generated)
per plan to serve them. It measures what that would save on this layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, bench/ heads sys.path, and its kernels.py would shadow the PyPI package `kernels`.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import contextlib
import importlib
import importlib.util
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
# bench/host.py's model, its build and its step: loaded by path, as host.py loads its own neighbours.
_HOST_SPEC = importlib.util.spec_from_file_location("_fastft_bench_host", BENCH / "host.py")
HOST = importlib.util.module_from_spec(_HOST_SPEC)
_HOST_SPEC.loader.exec_module(HOST)
RESULTS = BENCH / "results"
DEFAULTS = {"rounds": 30, "calls": 100}
QUICK = {"rounds": 2, "calls": 3}
KINDS = ("forward", "forward_backward")
_ATEN = torch.ops.aten


class Layer:
    """The straight-line layer over one patched Llama decoder layer's own weights (read once, here)."""

    def __init__(self, layer: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.projections = [getattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self.projections += [getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
        self.bases = [p.base_layer.weight for p in self.projections]
        self.scale = float(self.projections[0].scaling["default"])
        if any(float(p.scaling["default"]) != self.scale for p in self.projections):
            raise SystemExit("bench/layer_bound.py: the straight-line layer takes one LoRA scale for all projections")
        self.ranks = [p.lora_A["default"].weight.shape[0] for p in self.projections]
        self.norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        self.eps = (layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
        self.heads = (attention.config.num_attention_heads, attention.config.num_key_value_heads, attention.head_dim)
        self.softmax_scale = attention.scaling
        half = self.heads[2] // 2
        sign = torch.cat((-torch.ones(half, dtype=sin.dtype), torch.ones(half, dtype=sin.dtype)))
        # x·cos + roll(x, half)·(sign·sin) forward; backward the same with the factor rolled (rope.py's tables).
        self.cos, self.factor = cos.unsqueeze(1), sin.unsqueeze(1) * sign
        self.factor_back = self.factor.roll(half, -1)
        # A then B of each projection, q, k, v, o, gate, up, down: the function's inputs after x (read once, as the
        # node's plan reads them once).
        self.adapters = [t for p in self.projections for t in (p.lora_A["default"].weight, p.lora_B["default"].weight)]
        self.zero = torch.zeros((), dtype=sin.dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return _Straight.apply(x, self, *self.adapters)


class _Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Layer, *adapters: torch.Tensor) -> torch.Tensor:
        (aq, bq, ak, bk, av, bv, ao, bo, ag, bg, au, bu, ad, bd) = adapters
        wq, wk, wv, wo, wg, wu, wd = layer.bases
        s, (heads, kv_heads, head_dim), half = layer.scale, layer.heads, layer.heads[2] // 2
        batch, seq, hidden = x.shape
        x2d = x.view(-1, hidden)
        n1, rstd1 = _ATEN._fused_rms_norm(x2d, [hidden], layer.norms[0], layer.eps[0])
        a_qkv = torch.cat((aq, ak, av))
        xa = F.linear(n1, a_qkv)
        xq, xk, xv = torch.split_with_sizes(xa, layer.ranks[:3], 1)
        q = F.linear(n1, wq).addmm_(xq, bq.t(), alpha=s).view(batch, seq, heads, head_dim).transpose(1, 2)
        k = F.linear(n1, wk).addmm_(xk, bk.t(), alpha=s).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        v = F.linear(n1, wv).addmm_(xv, bv.t(), alpha=s).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        q = q * layer.cos + q.roll(half, -1) * layer.factor
        k = k * layer.cos + k.roll(half, -1) * layer.factor
        att, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=layer.softmax_scale)
        att2d = att.transpose(1, 2).reshape(batch * seq, -1)
        xo = F.linear(att2d, ao)
        h = x2d + F.linear(att2d, wo).addmm_(xo, bo.t(), alpha=s)
        n2, rstd2 = _ATEN._fused_rms_norm(h, [hidden], layer.norms[1], layer.eps[1])
        a_gu = torch.cat((ag, au))
        x_gu = F.linear(n2, a_gu)
        xg, xu = torch.split_with_sizes(x_gu, layer.ranks[4:6], 1)
        gate = F.linear(n2, wg).addmm_(xg, bg.t(), alpha=s)
        up = F.linear(n2, wu).addmm_(xu, bu.t(), alpha=s)
        act = F.silu(gate) * up
        xd = F.linear(act, ad)
        out = h + F.linear(act, wd).addmm_(xd, bd.t(), alpha=s)
        ctx.layer = layer
        saved = (x2d, rstd1, n1, xa, a_qkv, q, k, v, att, lse, att2d, xo, h, rstd2, n2, x_gu, a_gu, gate, up, xd)
        ctx.save_for_backward(*saved, *adapters)
        return out.view(batch, seq, hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer = ctx.layer
        (x2d, rstd1, n1, xa, a_qkv, q, k, v, att, lse, att2d, xo, h, rstd2, n2, x_gu, a_gu, gate, up, xd, *adapters) = (
            ctx.saved_tensors
        )
        (aq, bq, ak, bk, av, bv, ao, bo, ag, bg, au, bu, ad, bd) = adapters
        wq, wk, wv, wo, wg, wu, wd = layer.bases
        s, (heads, _, head_dim), half = layer.scale, layer.heads, layer.heads[2] // 2
        zero = layer.zero
        batch, seq, hidden = grad.shape
        tokens = batch * seq
        dy = grad.reshape(-1, hidden)
        # down, then the gate
        d_act = torch.mm(dy, wd)
        dyb_d = torch.mm(dy, bd)
        d_act.addmm_(dyb_d, ad, alpha=s)
        activated = F.silu(gate)
        act = activated * up
        d_up = d_act * activated
        d_gate = _ATEN.silu_backward(d_act * up, gate)
        g_ad = torch.addmm(zero, dyb_d.t(), act, beta=0, alpha=s)
        g_bd = torch.addmm(zero, dy.t(), xd, beta=0, alpha=s)
        # gate | up
        d_n2 = torch.mm(d_gate, wg).addmm_(d_up, wu)
        dyb = torch.empty((tokens, x_gu.shape[1]), dtype=grad.dtype)
        dyb_g, dyb_u = torch.split_with_sizes(dyb, layer.ranks[4:6], 1)
        torch.mm(d_gate, bg, out=dyb_g)
        torch.mm(d_up, bu, out=dyb_u)
        xg, xu = torch.split_with_sizes(x_gu, layer.ranks[4:6], 1)
        d_n2.addmm_(dyb, a_gu, alpha=s)
        g_ag = torch.addmm(zero, dyb_g.t(), n2, beta=0, alpha=s)
        g_au = torch.addmm(zero, dyb_u.t(), n2, beta=0, alpha=s)
        g_bg = torch.addmm(zero, d_gate.t(), xg, beta=0, alpha=s)
        g_bu = torch.addmm(zero, d_up.t(), xu, beta=0, alpha=s)
        # post-attention norm, the residual stream's gradient added
        d_h = _norm_backward(d_n2, h, rstd2, layer.norms[1]).add_(dy)
        # o
        d_att = torch.mm(d_h, wo)
        dyb_o = torch.mm(d_h, bo)
        d_att.addmm_(dyb_o, ao, alpha=s)
        g_ao = torch.addmm(zero, dyb_o.t(), att2d, beta=0, alpha=s)
        g_bo = torch.addmm(zero, d_h.t(), xo, beta=0, alpha=s)
        # attention, RoPE back
        d_att4 = d_att.view(batch, seq, heads, head_dim).transpose(1, 2)
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            d_att4, q, k, v, att, lse, 0.0, True, scale=layer.softmax_scale
        )
        dq = dq * layer.cos + dq.roll(half, -1) * layer.factor_back
        dk = dk * layer.cos + dk.roll(half, -1) * layer.factor_back
        dq, dk, dv = (g.transpose(1, 2).reshape(tokens, -1) for g in (dq, dk, dv))
        # q | k | v
        d_n1 = torch.mm(dq, wq).addmm_(dk, wk).addmm_(dv, wv)
        dyb = torch.empty((tokens, xa.shape[1]), dtype=grad.dtype)
        dyb_q, dyb_k, dyb_v = torch.split_with_sizes(dyb, layer.ranks[:3], 1)
        torch.mm(dq, bq, out=dyb_q)
        torch.mm(dk, bk, out=dyb_k)
        torch.mm(dv, bv, out=dyb_v)
        xq, xk, xv = torch.split_with_sizes(xa, layer.ranks[:3], 1)
        d_n1.addmm_(dyb, a_qkv, alpha=s)
        g_a = [torch.addmm(zero, d.t(), n1, beta=0, alpha=s) for d in (dyb_q, dyb_k, dyb_v)]
        g_b = [torch.addmm(zero, d.t(), xp, beta=0, alpha=s) for d, xp in ((dq, xq), (dk, xk), (dv, xv))]
        # input norm, the residual again
        dx = _norm_backward(d_n1, x2d, rstd1, layer.norms[0]).add_(d_h)
        grads = (g_a[0], g_b[0], g_a[1], g_b[1], g_a[2], g_b[2], g_ao, g_bo, g_ag, g_bg, g_au, g_bu, g_ad, g_bd)
        return (dx.view(batch, seq, hidden), None, *grads)


def _norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # RMSNorm's dX in fp32, the node's operators in its order (rms_norm.py's reference backward).
    x_hat = x * rstd
    dn = grad * weight
    return torch.addcmul(dn, x_hat, (dn * x_hat).mean(-1, keepdim=True), value=-1.0) * rstd


def _clear(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.grad = None


def _captured_node(model: torch.nn.Module, runner: Any) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """fastft's node for the first decoder layer (its direct apply) and the arguments one training step gave it."""
    nodes = importlib.import_module("fastft.kernels.lora_decoder_layer")
    node, found = nodes._apply, []

    def grab(*args: Any) -> torch.Tensor:
        if not found:
            found.append(args)
        return node(*args)

    nodes._apply = grab
    try:
        runner.step()
    finally:
        nodes._apply = node
    if not found:
        raise SystemExit("bench/layer_bound.py: the step never reached fastft's fused decoder-layer node")
    return node, found[0]


def _gradients(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor, params: list) -> list:
    _clear([x, *params])
    out = run(x)
    out.backward(grad)
    found = [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in params)]
    _clear([x, *params])
    return found


def measure(rounds: int, calls: int) -> dict[str, Any]:
    """Build bench/host.py's model with one layer, check the two layers agree, time them alternately."""
    with tempfile.TemporaryDirectory() as folder:
        HOST.write_model(Path(folder), 1)
        model = HOST.build("fastft", Path(folder), "cpu", torch.float32, False)
        runner = HOST.Runner(model, "cpu")
        for _ in range(3):
            runner.step()
        node, args = _captured_node(model, runner)
    x0, cos, sin, dtype = args[0], args[2], args[3], args[5]
    if dtype is not None:
        raise SystemExit("bench/layer_bound.py: the straight-line layer runs without autocast")
    layer = Layer(model.get_base_model().model.layers[0], cos, sin)
    params = layer.adapters
    x = x0.detach().clone().requires_grad_()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)

    def fastft_node(inputs: torch.Tensor) -> torch.Tensor:
        return node(inputs, *args[1:])

    runs = {"fastft_node": fastft_node, "straight_line": layer.apply}
    results = {name: _gradients(run, x, grad, params) for name, run in runs.items()}
    differences = [(a - b).abs().max().item() for a, b in zip(*results.values(), strict=True)]
    counts = {}
    for name, run in runs.items():
        with HOST.OpCounter() as counter:
            out = run(x)
            forward_ops = sum(counter.counts.values())
            out.backward(grad)
        counts[name] = {"forward": forward_ops, "forward_backward": sum(counter.counts.values())}
        _clear([x, *params])

    def forward(run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for _ in range(calls):
            run(x)

    tensors = [x, *params]

    def forward_backward(run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for _ in range(calls):
            run(x).backward(grad)
            _clear(tensors)

    times: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in KINDS} for name in runs}
    for kind, loop in (("forward", forward), ("forward_backward", forward_backward)):
        for run in runs.values():
            loop(run)  # warm
        for _ in range(rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                loop(run)
                times[name][kind].append((time.perf_counter() - started) / calls)
    medians = {
        name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in times.items()
    }
    # Each round's own ratio (both timed in the same seconds), as bench/host.py judges its targets: this VM's speed
    # changes from one second to the next.
    paired = {
        kind: statistics.median(
            s / n for s, n in zip(times["straight_line"][kind], times["fastft_node"][kind], strict=True)
        )
        for kind in KINDS
    }
    return {
        "median_s": medians,
        "rounds_s": times,
        "straight_over_node": paired,
        "node_python_share": {kind: 1.0 - ratio for kind, ratio in paired.items()},
        "ops_per_call": counts,
        "largest_difference": {"output": differences[0], "x_grad": differences[1], "lora_grads": max(differences[2:])},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON record (default: results/layer-bound-<device>.json)")
    parser.add_argument("--rounds", type=int, help=f"alternated rounds (default {DEFAULTS['rounds']})")
    parser.add_argument("--calls", type=int, help=f"layer calls per timed round (default {DEFAULTS['calls']})")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 calls: checks the harness")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if torch.cuda.is_available():
        raise SystemExit(
            "bench/layer_bound.py: the CPU's torch reference is measured; run it with CUDA_VISIBLE_DEVICES=''"
        )
    from fastft.environment import cpu_model, describe_device, device_slug, package_versions
    from fastft.kernels import dispatch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        # Under the Triton interpreter (pytest) fastft's CPU path would be the interpreter: force the reference.
        with dispatch.force_reference() if dispatch.INTERPRETED else contextlib.nullcontext():
            result = measure(args.rounds, args.calls)
    finally:
        torch.set_num_threads(threads)
    device = describe_device(torch.device("cpu"))
    record = dict(benchmark="bench/layer_bound.py", command=" ".join(["python bench/layer_bound.py", *(argv or [])]))
    record.update(device=device, cpu_model=cpu_model(), platform=platform.platform(), python=platform.python_version())
    record.update(versions=package_versions(("torch", "transformers", "peft", "fastft")))
    record.update(fastft_source=HOST.fastft_source(), settings=dict(model=HOST.SHAPE, batch=HOST.BATCH, seq=HOST.SEQ))
    record["settings"].update(rank=HOST.RANK, dtype="float32", threads=1, rounds=args.rounds, calls=args.calls)
    record.update(duration_s=time.perf_counter() - started, **result)
    out_path = Path(args.out or RESULTS / f"layer-bound-{device_slug(device)}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    node, straight = result["median_s"]["fastft_node"], result["median_s"]["straight_line"]
    for kind in ("forward", "forward_backward"):
        print(
            f"{kind:17s} fastft node {node[kind] * 1e6:8.1f} us   straight-line {straight[kind] * 1e6:8.1f} us   "
            f"node Python share {result['node_python_share'][kind]:.1%}"
        )
    print(f"largest difference: {result['largest_difference']}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
