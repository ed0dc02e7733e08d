"""The math of the grouped-expert LoRA MLP, and its custom ops.

For token ``t`` routed to experts ``e_1..e_k`` with router weights ``w_1..w_k`` (row ``m`` = one (token, expert) pair):

    GU_m  = x_t W1_eᵀ + b1_e + s1 (x_t A1_eᵀ) B1_eᵀ            [2I]  gate | up, in W1's row order
    H_m   = act(gate_m, up_m)                                  [I]
    Y_m   = H_m W2_eᵀ + b2_e + s2 (H_m A2_eᵀ) B2_eᵀ            [H]
    out_t = Σ_j w_j Y_{m(t, j)}

Forward (over the expert-sorted rows of :mod:`fastft.kernels.moe_route`): ``XA1 = X A1ᵀ`` and ``GU`` (two grouped GEMMs
that read x's tokens in place), ``H`` (:mod:`fastft.kernels.moe_gate_act`), ``HA2 = H A2ᵀ`` and ``Y`` with the router
weight in its epilogue, stored straight to (token, slot) order and summed over the k slots. It keeps x, the router
weights, the routing's order and offsets, ``XA1 [N, r1]``, ``GU [N, 2I]`` and ``HA2 [N, r2]``; ``H`` is recomputed in
backward, and ``Y`` is never kept: the router weight's gradient ``<dout_t, Y_m>`` is
``<dH_u, H> + <dout_t, b2_e>`` with ``dH_u = dout_t W2_e + s2 (dout_t B2_e) A2_e``, which the backward forms anyway.

Backward, with ``G = dout`` read through the token gather and ``dH = w · dH_u``:

    GB2 = G B2_e;   dH_u = G W2_e + s2 GB2 A2_e;   dw = <dH_u, H> + <G, b2_e>
    dA2_e = s2 Σ (w GB2)ᵀ H;   dB2_e = s2 Σ Gᵀ (w HA2);   dGU = act'(GU) · dH (over GU's own buffer)
    DB1 = dGU B1_e;   dx_t = Σ_j (dGU W1_e + s1 DB1 A1_e)_{m(t, j)};   dA1_e = s1 Σ DB1ᵀ x;   dB1_e = s1 Σ dGUᵀ XA1

Schemas (``layout`` = [gate_up has LoRA, down has LoRA, gate_up has a bias, down has a bias, gate | up interleaved];
``lora_a`` / ``lora_b`` / ``biases`` hold only what the layout says is there, gate_up's first)::

    fastft::lora_moe_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up_proj,
                             Tensor down_proj, Tensor[] lora_a, Tensor[] lora_b, Tensor[] biases, bool[] layout,
                             float[] scales, str activation, float alpha, float limit) -> Tensor[]
        # [out [..., H], order [N], offsets [E + 1], XA1 [N, r1], GU [N, 2I], HA2 [N, r2]] (r 0 without LoRA)
    fastft::lora_moe_experts_backward(Tensor grad, Tensor x, Tensor top_k_weights, Tensor order, Tensor offsets,
                                      Tensor xa_gate_up, Tensor gate_up, Tensor xa_down, Tensor gate_up_proj,
                                      Tensor down_proj, Tensor[] lora_a, Tensor[] lora_b, Tensor[] biases,
                                      bool[] layout, float[] scales, str activation, float alpha, float limit,
                                      bool[] needs) -> Tensor[]
        # [dx, d top_k_weights, dA..., dB...] ([0] where needs says no; needs = [x, weights, gate_up, down])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fastft.kernels.custom_ops import define, register_autograd
from fastft.kernels.moe_gate_act import ACTIVATIONS, act_backward_, act_forward
from fastft.kernels.moe_grouped_gemm import grouped_gemm
from fastft.kernels.moe_grouped_outer import grouped_outer
from fastft.kernels.moe_route import MoERouting, route


@dataclass(frozen=True)
class Config:
    """What the math needs besides tensors: the activation and its constants, the gate | up order, the scales."""

    activation: str
    interleaved: bool
    alpha: float
    limit: float
    gate_up_scale: float
    down_scale: float

    @property
    def act(self) -> int:
        return ACTIVATIONS[self.activation]


class Weights(NamedTuple):
    """The frozen tensors and the adapters of one call, adapters already in x's dtype (None where absent)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    a1: torch.Tensor | None
    b1: torch.Tensor | None
    a2: torch.Tensor | None
    b2: torch.Tensor | None


class Saved(NamedTuple):
    """What backward reads besides x, the router weights and :class:`Weights`."""

    order: torch.Tensor
    offsets: torch.Tensor
    xa_gate_up: torch.Tensor | None
    gate_up: torch.Tensor
    xa_down: torch.Tensor | None


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def forward(
    config: Config, x2d: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, weights: Weights
) -> tuple[torch.Tensor, Saved]:
    """``(out [T, H], saved)`` for tokens ``x2d [T, H]`` routed by ``top_k_index`` / ``top_k_weights [T, k]``."""
    tokens, k = top_k_index.shape
    routing = route(top_k_index, weights.gate_up.shape[0], "lora_moe_experts")
    row_weights = top_k_weights.reshape(-1)[routing.order]
    xa1 = None
    if weights.a1 is not None:
        xa1 = grouped_gemm(x2d, weights.a1, routing, gather=True)
    gate_up = grouped_gemm(
        x2d,
        weights.gate_up,
        routing,
        gather=True,
        xa=xa1,
        lora_b=weights.b1,
        scale=config.gate_up_scale,
        bias=weights.gate_up_bias,
    )
    hidden = act_forward(gate_up, config.interleaved, config.act, config.alpha, config.limit)
    xa2 = grouped_gemm(hidden, weights.a2, routing) if weights.a2 is not None else None
    rows = grouped_gemm(
        hidden,
        weights.down,
        routing,
        xa=xa2,
        lora_b=weights.b2,
        scale=config.down_scale,
        bias=weights.down_bias,
        row_scale=row_weights,
        scatter=True,
    )
    del hidden
    out = rows.view(tokens, k, rows.shape[1]).sum(1)
    return out, Saved(routing.order, routing.offsets, xa1, gate_up, xa2)


def backward(
    config: Config,
    grad: torch.Tensor,
    x2d: torch.Tensor,
    top_k_weights: torch.Tensor,
    saved: Saved,
    weights: Weights,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
    """``(dx [T, H], d top_k_weights [T, k], (dA1, dB1, dA2, dB2))`` in x's dtype; ``needs`` = (x, router weights,
    gate_up adapter, down adapter). Writes the gate | up gradient over ``saved.gate_up``."""
    needs_x, needs_w, needs_gate_up, needs_down = needs
    tokens, k = top_k_weights.shape
    routing = MoERouting.rebuild(saved.order, saved.offsets, k)
    row_weights = top_k_weights.reshape(-1)[routing.order]
    grad = grad.contiguous()
    s1, s2 = config.gate_up_scale, config.down_scale
    lora_down = needs_down and weights.a2 is not None
    gb2 = None
    if weights.b2 is not None:
        gb2 = grouped_gemm(grad, weights.b2.transpose(1, 2), routing, gather=True)
    a2_t = weights.a2.transpose(1, 2) if weights.a2 is not None else None
    dh = grouped_gemm(grad, weights.down.transpose(1, 2), routing, gather=True, xa=gb2, lora_b=a2_t, scale=s2)
    grad_a2 = grad_b2 = None
    if lora_down:
        # dA2 needs H itself; without a down adapter to train, only its per-row sum with dH_u is needed, which the
        # gate's backward kernel forms from the H it recomputes anyway.
        hidden = act_forward(saved.gate_up, config.interleaved, config.act, config.alpha, config.limit)
        grad_a2 = grouped_outer(gb2, hidden, routing, row_scale=row_weights, scale=s2)
        del hidden
        grad_b2 = grouped_outer(grad, saved.xa_down, routing, gather_a=True, row_scale=row_weights, scale=s2)
    del gb2
    per_row = act_backward_(
        dh, row_weights, saved.gate_up, config.interleaved, config.act, config.alpha, config.limit, rowdot=needs_w
    )
    d_gate_up = saved.gate_up
    del dh
    grad_w = None
    if needs_w:
        if weights.down_bias is not None:
            # <dout_t, b2_e> for every (token, expert) pair is a [T, E] product; the rows pick theirs.
            per_token = grad.float() @ weights.down_bias.float().t()
            per_row += per_token[routing.token, routing.expert]
        grad_w = per_row[routing.inverse].view(tokens, k).to(top_k_weights.dtype)
    db1 = None
    if weights.b1 is not None and (needs_x or needs_gate_up):
        db1 = grouped_gemm(d_gate_up, weights.b1.transpose(1, 2), routing)
    grad_x = None
    if needs_x:
        a1_t = weights.a1.transpose(1, 2) if weights.a1 is not None else None
        rows = grouped_gemm(
            d_gate_up, weights.gate_up.transpose(1, 2), routing, xa=db1, lora_b=a1_t, scale=s1, scatter=True
        )
        grad_x = rows.view(tokens, k, rows.shape[1]).sum(1)
        del rows
    grad_a1 = grad_b1 = None
    if needs_gate_up and weights.a1 is not None:
        grad_a1 = grouped_outer(db1, x2d, routing, gather_b=True, scale=s1)
        grad_b1 = grouped_outer(d_gate_up, saved.xa_gate_up, routing, scale=s1)
    return grad_x, grad_w, (grad_a1, grad_b1, grad_a2, grad_b2)


# The custom ops -----------------------------------------------------------------------------------------------------


def _unpack(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    layout: list[bool],
    scales: list[float],
    activation: str,
    alpha: float,
    limit: float,
) -> tuple[Config, Weights]:
    has_lora1, has_lora2, has_bias1, has_bias2, interleaved = layout
    adapters_a, adapters_b, bias_list = list(lora_a), list(lora_b), list(biases)
    a1 = cast(adapters_a.pop(0), x.dtype) if has_lora1 else None
    b1 = cast(adapters_b.pop(0), x.dtype) if has_lora1 else None
    a2 = cast(adapters_a.pop(0), x.dtype) if has_lora2 else None
    b2 = cast(adapters_b.pop(0), x.dtype) if has_lora2 else None
    bias1 = bias_list.pop(0) if has_bias1 else None
    bias2 = bias_list.pop(0) if has_bias2 else None
    config = Config(activation, bool(interleaved), float(alpha), float(limit), float(scales[0]), float(scales[1]))
    return config, Weights(gate_up_proj, down_proj, bias1, bias2, a1, b1, a2, b2)


def _lora_moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    layout: list[bool],
    scales: list[float],
    activation: str,
    alpha: float,
    limit: float,
) -> list[torch.Tensor]:
    config, weights = _unpack(
        x, gate_up_proj, down_proj, lora_a, lora_b, biases, layout, scales, activation, alpha, limit
    )
    x2d = x.reshape(-1, x.shape[-1])
    out, saved = forward(config, x2d, top_k_index, top_k_weights, weights)
    rows = saved.order.shape[0]
    xa1 = saved.xa_gate_up if saved.xa_gate_up is not None else x.new_empty((rows, 0))
    xa2 = saved.xa_down if saved.xa_down is not None else x.new_empty((rows, 0))
    return [out.view(*x.shape[:-1], out.shape[1]), saved.order, saved.offsets, xa1, saved.gate_up, xa2]


def _lora_moe_experts_fake(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    layout: list[bool],
    scales: list[float],
    activation: str,
    alpha: float,
    limit: float,
) -> list[torch.Tensor]:
    rows = top_k_index.numel()
    r1 = lora_a[0].shape[1] if layout[0] else 0
    r2 = lora_a[-1].shape[1] if layout[1] else 0
    return [
        x.new_empty((*x.shape[:-1], down_proj.shape[1])),
        x.new_empty((rows,), dtype=torch.int64),
        x.new_empty((gate_up_proj.shape[0] + 1,), dtype=torch.int64),
        x.new_empty((rows, r1)),
        x.new_empty((rows, gate_up_proj.shape[1])),
        x.new_empty((rows, r2)),
    ]


def _lora_moe_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    top_k_weights: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    xa_gate_up: torch.Tensor,
    gate_up: torch.Tensor,
    xa_down: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    layout: list[bool],
    scales: list[float],
    activation: str,
    alpha: float,
    limit: float,
    needs: list[bool],
) -> list[torch.Tensor]:
    config, weights = _unpack(
        x, gate_up_proj, down_proj, lora_a, lora_b, biases, layout, scales, activation, alpha, limit
    )
    # A custom op must not write into its inputs: the gate | up gradient goes over a copy.
    saved = Saved(order, offsets, xa_gate_up if layout[0] else None, gate_up.clone(), xa_down if layout[1] else None)
    x2d = x.reshape(-1, x.shape[-1])
    grad_x, grad_w, grads = backward(
        config, grad.reshape(-1, grad.shape[-1]), x2d, top_k_weights, saved, weights, tuple(needs)
    )
    empty = x.new_empty(0)
    # dA and dB of the adapters that are there, in lora_a / lora_b's order (gate_up's, then down's).
    grad_a = [grads[0]] * bool(layout[0]) + [grads[2]] * bool(layout[1])
    grad_b = [grads[1]] * bool(layout[0]) + [grads[3]] * bool(layout[1])
    return [
        empty if grad_x is None else grad_x.view(x.shape),
        empty if grad_w is None else grad_w,
        *[empty if g is None else g.to(a.dtype) for g, a in zip(grad_a, lora_a, strict=True)],
        *[empty if g is None else g.to(b.dtype) for g, b in zip(grad_b, lora_b, strict=True)],
    ]


def _lora_moe_experts_backward_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    top_k_weights: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    xa_gate_up: torch.Tensor,
    gate_up: torch.Tensor,
    xa_down: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    layout: list[bool],
    scales: list[float],
    activation: str,
    alpha: float,
    limit: float,
    needs: list[bool],
) -> list[torch.Tensor]:
    empty = x.new_empty(0)
    needs_x, needs_w, needs_gate_up, needs_down = needs
    wanted = [needs_gate_up] * int(layout[0]) + [needs_down] * int(layout[1])
    adapters_a = [torch.empty_like(a) if w else a.new_empty(0) for a, w in zip(lora_a, wanted, strict=True)]
    adapters_b = [torch.empty_like(b) if w else b.new_empty(0) for b, w in zip(lora_b, wanted, strict=True)]
    return [
        torch.empty_like(x) if needs_x else empty,
        torch.empty_like(top_k_weights) if needs_w else empty,
        *adapters_a,
        *adapters_b,
    ]


op = define("lora_moe_experts", _lora_moe_experts, fake=_lora_moe_experts_fake)
backward_op = define("lora_moe_experts_backward", _lora_moe_experts_backward, fake=_lora_moe_experts_backward_fake)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, _, top_k_weights, gate_up_proj, down_proj, lora_a, lora_b, biases, *static = inputs
    ctx.static = tuple(list(v) if isinstance(v, list | tuple) else v for v in static)
    ctx.counts = (len(lora_a), len(biases))
    _, order, offsets, xa1, gate_up, xa2 = output
    ctx.mark_non_differentiable(order, offsets, xa1, gate_up, xa2)
    ctx.save_for_backward(
        x, top_k_weights, order, offsets, xa1, gate_up, xa2, gate_up_proj, down_proj, *lora_a, *lora_b, *biases
    )


def _grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    layout, scales, activation, alpha, limit = ctx.static
    n_lora, n_biases = ctx.counts
    x, top_k_weights, order, offsets, xa1, gate_up, xa2, gate_up_proj, down_proj, *rest = ctx.saved_tensors
    lora_a, lora_b, biases = rest[:n_lora], rest[n_lora : 2 * n_lora], rest[2 * n_lora :]
    needs_input = ctx.needs_input_grad
    wants_a, wants_b = needs_input[5], needs_input[6]
    wanted = [bool(a or b) for a, b in zip(wants_a, wants_b, strict=True)]
    needs_gate_up = bool(layout[0]) and wanted[0]
    needs_down = bool(layout[1]) and wanted[-1]
    needs = [bool(needs_input[0]), bool(needs_input[2]), needs_gate_up, needs_down]
    result = backward_op(
        grads[0],
        x,
        top_k_weights,
        order,
        offsets,
        xa1,
        gate_up,
        xa2,
        gate_up_proj,
        down_proj,
        list(lora_a),
        list(lora_b),
        list(biases),
        layout,
        scales,
        activation,
        alpha,
        limit,
        needs,
    )
    grad_x = result[0] if needs[0] else None
    grad_w = result[1] if needs[1] else None
    grad_a = [g if w else None for g, w in zip(result[2 : 2 + n_lora], wanted, strict=True)]
    grad_b = [g if w else None for g, w in zip(result[2 + n_lora :], wanted, strict=True)]
    return (grad_x, None, grad_w, None, None, grad_a, grad_b, [None] * n_biases, None, None, None, None, None)


register_autograd(op, _setup, _grad)


__all__ = ["Config", "Saved", "Weights", "backward", "backward_op", "cast", "forward", "op"]
