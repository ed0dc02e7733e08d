"""A fused decoder layer's forward and backward as straight-line code, for a layer whose plan fixes every choice.

:mod:`fastft.kernels.lora_decoder_layer` runs a layer through the general math of its parts: each LoRA group walks
its segment table, asks its memo for the GEMM order, looks for casts, sorts out which gradients are wanted and
gathers its LoRA gradients through a pending object; the MLP and the q / k / v group with RoPE wrap that again. That
generality costs about a quarter of a layer's host time (``bench/layer_bound.py``), paid on every layer of every step.

Most layers need none of it: every projection carrying LoRA, q | k | v and gate | up each under one scale, every
adapter trainable and of one dtype. For such a layer a :class:`LayerProgram` holds what the general code works out per
call (each group's GEMM candidate and order, widths, ranks and scales, whether adapters are cast) and runs the same
operators in the same order, so the layer's numbers are the general node's bit for bit (tests/test_layer_program.py
checks every output and gradient with ``torch.equal``). A dense group without bias on torch's matmul (cuBLAS on a GPU:
what the tuner picks for every group it has measured on an H100) is written out one line per segment; a group with
NF4 bases, biases or the Triton GEMM calls :func:`fastft.kernels.lora_math.run` with its candidate, as the general
node does after its own decisions. The norms, RoPE, the gate kernels and the attention are the same functions the
general node calls.

A program is made once per layer spec, GEMM plan key and autocast dtype, and only after the general node has run once
under that key (the tuner's choice is then in each group's memo). Anything else runs the general node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels import dispatch, gemm_tuner
from fastft.kernels.custom_ops import below_autograd
from fastft.kernels.layer_attention import graph_backward, run_attention
from fastft.kernels.lora_backward import low_rank_term
from fastft.kernels.lora_math import biases_in, cast_groups, dense_bases, run, segment_output, segment_shapes, zero_of
from fastft.kernels.lora_mlp_math import ACTIVATIONS, HIDDEN_BACKWARDS
from fastft.kernels.lora_projection import autocast_off
from fastft.kernels.rms_norm import _backward as rms_norm_backward
from fastft.kernels.rms_norm import _forward as rms_norm_forward
from fastft.kernels.rope import _checked, _compute_dtype, _launch, _reference_tables, _rotate

_linear = torch.nn.functional.linear
_ACCUMULATE = gemm_tuner.CUBLAS_ACCUMULATE.path
_CUBLAS_PATHS = (gemm_tuner.CUBLAS.path, _ACCUMULATE)


class _Group:
    """How a program computes one group's outputs, and its base weights for dX: fixed when the program is made.

    ``inline``: every segment dense, without bias, on torch's matmul: one line per segment here. Otherwise (NF4
    bases, biases, the Triton GEMM) the group runs :func:`fastft.kernels.lora_math.run` with the tuner's candidate,
    the call the general node makes after its own decisions."""

    __slots__ = ("accumulate", "biases", "candidate", "inline", "packed", "quant_states", "shapes", "spec", "weights")

    def __init__(self, group: Any, candidate: Any) -> None:
        spec = group._spec
        self.spec, self.candidate, self.weights = spec, candidate, group._weights
        self.quant_states, self.biases, self.packed = group._quant_states, group._biases, spec.any_packed
        self.shapes = segment_shapes(spec)
        self.accumulate = candidate.path == _ACCUMULATE
        self.inline = candidate.path in _CUBLAS_PATHS and not self.packed and self.biases is None

    def run(self, x2d: torch.Tensor, xa: torch.Tensor, lora_b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs through :func:`lora_math.run` (the group is not ``inline``)."""
        biases = biases_in(self.biases, x2d.dtype)
        return run(self.candidate, self.spec, x2d, self.weights, self.quant_states, xa, lora_b, biases)

    def dense(self, dtype: torch.dtype) -> Sequence[torch.Tensor]:
        """The base weights for dX: NF4 ones dequantised into the shared buffer (as the general backward does)."""
        if self.packed:
            return dense_bases(self.weights, self.quant_states, self.shapes, dtype)
        return self.weights


class LayerProgram:
    """The fixed choices of one eligible layer under one plan key; :meth:`forward` and :meth:`backward` run it.

    Built by :func:`program_for`, never by hand: it trusts that the spec passed :func:`_eligible`.
    """

    __slots__ = (
        "activation",
        "adapter_dtype",
        "cast",
        "dtype",
        "gate_backward",
        "groups",
        "head_dim",
        "input_eps",
        "post_eps",
        "scales",
        "spec",
        "triton",
        "weight_dtypes",
        "weights",
        "zero",
    )

    def __init__(self, spec: Any, candidates: Sequence[Any], x2d: torch.Tensor, dtype: torch.dtype) -> None:
        qkv, o, mlp = spec.qkv, spec.o, spec.mlp
        self.spec = spec
        self.dtype = dtype
        parts = (qkv, o, mlp.gate_up, mlp.down)
        self.groups = tuple(_Group(group, candidate) for group, candidate in zip(parts, candidates, strict=True))
        self.weights = (*qkv._weights, *o._weights, *mlp.gate_up._weights, *mlp.down._weights)
        self.weight_dtypes = tuple(w.dtype for w in self.weights)
        self.adapter_dtype = spec._adapters[0].dtype
        self.cast = self.adapter_dtype != dtype
        self.scales = (
            qkv._spec.grouped_scale,
            o._spec.scales[0],
            mlp.gate_up._spec.grouped_scale,
            mlp.down._spec.scales[0],
        )
        self.activation = ACTIVATIONS[mlp.activation][0]
        self.gate_backward = HIDDEN_BACKWARDS[mlp.activation]
        self.input_eps, self.post_eps, self.head_dim = spec.input_eps, spec.post_eps, spec.head_dim
        # Which kernels the norms, RoPE and gate take depends on the device only (and the plan key's switches).
        self.triton = dispatch.use_triton(x2d)
        self.zero = zero_of(x2d.device, dtype)

    def holds(self) -> bool:
        """Whether the parameters still have the dtypes the program was made for (its key holds the compute dtype):
        ``model.to()`` swaps parameter data in place, which no plan stamp sees."""
        adapter_dtype = self.adapter_dtype
        return all(w.dtype == d for w, d in zip(self.weights, self.weight_dtypes, strict=True)) and all(
            a.dtype == adapter_dtype for a in self.spec._adapters
        )

    # The forward ----------------------------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        x2d: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Any,
        input_weight: torch.Tensor,
        post_weight: torch.Tensor,
        adapters: Sequence[torch.Tensor],
        dtype: torch.dtype | None,
        ctx: Any,
        output: bool,
    ) -> torch.Tensor:
        """The general node's ``_forward`` for this layer: its output, and with ``ctx`` what the backward reads.

        ``x2d`` is ``x`` as ``[tokens, hidden]``, made by the caller outside :func:`below_autograd` (a saved view of
        the input must share its version counter)."""
        aq, ak, av, bq, bk, bv, ao, bo, ag, au, ad, bg, bu, bd = adapters
        wq, wk, wv, wo, wg, wu, wd = self.weights
        s_qkv, s_o, s_gate_up, s_down = self.scales
        g_qkv, g_o, g_gate_up, g_down = self.groups
        batch, seq, hidden = x.shape
        off = _Off(x, dtype)
        with below_autograd():
            normed, input_rstd = rms_norm_forward(x2d, input_weight, self.input_eps, 0.0, True)
            group_in = normed if dtype is None else normed.to(dtype)
            if self.cast:
                # peft's fp32 adapters over a 16-bit base: every group's cast in one copy, as the general node does.
                casts = ({}, {}, {}, {})
                cast_groups(self.spec.lora_groups(adapters), self.dtype, casts)
                (a_qkv, (bq, bk, bv)), (ao, (bo,)) = (casts[0]["a"], casts[0]["b"]), (casts[1]["a"], casts[1]["b"])
                (a_gate_up, (bg, bu)), (ad, (bd,)) = (casts[2]["a"], casts[2]["b"]), (casts[3]["a"], casts[3]["b"])
            else:
                a_qkv, a_gate_up = torch.cat((aq, ak, av)), torch.cat((ag, au))
            with off:
                xa_qkv = _linear(group_in, a_qkv)
                if g_qkv.inline:
                    xq, xk, xv = torch.split_with_sizes(xa_qkv, g_qkv.spec.lora_rows, 1)
                    acc = g_qkv.accumulate
                    q = segment_output(group_in, wq, xq, bq, s_qkv, acc)
                    k = segment_output(group_in, wk, xk, bk, s_qkv, acc)
                    v = segment_output(group_in, wv, xv, bv, s_qkv, acc)
                else:
                    q, k, v = g_qkv.run(group_in, xa_qkv, (bq, bk, bv))
                head_dim = self.head_dim
                q = q.view(batch, seq, -1, head_dim).transpose(1, 2)
                k = k.view(batch, seq, -1, head_dim).transpose(1, 2)
                v = v.view(batch, seq, -1, head_dim).transpose(1, 2)
                _checked("lora_qkv_rope", q, k, cos, sin, None)
                if self.triton:
                    _launch(q, k, q, k, cos, sin, None, backward=False)
                else:
                    table, factor = _reference_tables(cos, sin, None, _compute_dtype(q.dtype), backward=False)
                    q, k = _rotate(q, table, factor), _rotate(k, table, factor)
        attention, graph = run_attention(attend, q, k, v, ctx is not None)
        with below_autograd():
            attention2d = attention.reshape(batch * seq, -1)
            o_in = attention2d if dtype is None else attention2d.to(dtype)
            with off:
                xa_o = _linear(o_in, ao)
                if g_o.inline:
                    o_out = segment_output(o_in, wo, xa_o, bo, s_o, g_o.accumulate)
                else:
                    (o_out,) = g_o.run(o_in, xa_o, (bo,))
            hidden_states = x2d + o_out
            post_normed, post_rstd = rms_norm_forward(hidden_states, post_weight, self.post_eps, 0.0, True)
            mlp_in = post_normed if dtype is None else post_normed.to(dtype)
            with off:
                xa_gate_up = _linear(mlp_in, a_gate_up)
                if g_gate_up.inline:
                    xg, xu = torch.split_with_sizes(xa_gate_up, g_gate_up.spec.lora_rows, 1)
                    acc = g_gate_up.accumulate
                    gate = segment_output(mlp_in, wg, xg, bg, s_gate_up, acc)
                    up = segment_output(mlp_in, wu, xu, bu, s_gate_up, acc)
                else:
                    gate, up = g_gate_up.run(mlp_in, xa_gate_up, (bg, bu))
                h = self.activation(gate, up)
                xa_down = _linear(h, ad)
                down = None
                if output:
                    if g_down.inline:
                        down = segment_output(h, wd, xa_down, bd, s_down, g_down.accumulate)
                    else:
                        (down,) = g_down.run(h, xa_down, (bd,))
            if output:
                result = hidden_states + down
            else:
                # The backward never reads the output (a checkpointed layer's recompute): no down GEMM, no add.
                dtype_out = torch.promote_types(hidden_states.dtype, mlp_in.dtype)
                result = hidden_states.new_empty(hidden_states.shape, dtype=dtype_out)
        if ctx is not None:
            ctx.program, ctx.spec, ctx.graph, ctx.shape = self, self.spec, graph, (batch, seq, hidden)
            ctx.stacked = (a_qkv, a_gate_up, (bq, bk, bv, ao, bo, ad, bg, bu, bd) if self.cast else None)
            saved = (x2d, input_rstd, group_in, xa_qkv, cos, sin, o_in, xa_o, hidden_states, post_rstd, mlp_in)
            ctx.save_for_backward(*saved, xa_gate_up, gate, up, xa_down, input_weight, post_weight, *adapters)
        return result.view(batch, seq, hidden)

    # The backward ---------------------------------------------------------------------------------------------------

    def backward(self, ctx: Any, grad: torch.Tensor, attention_backward: Any) -> tuple[torch.Tensor | None, ...]:
        """The general node's backward for this layer: the gradients of the node's inputs, in their order."""
        everything = ctx.saved_tensors
        (x2d, input_rstd, group_in, xa_qkv, cos, sin, o_in, xa_o, hidden_states, post_rstd, mlp_in) = everything[:11]
        xa_gate_up, gate, up, xa_down, input_weight, post_weight = everything[11:17]
        aq, ak, av, bq, bk, bv, ao, bo, ag, au, ad, bg, bu, bd = everything[17:]
        a_qkv, a_gate_up, cast = ctx.stacked
        ctx.stacked = None
        if cast is not None:
            bq, bk, bv, ao, bo, ad, bg, bu, bd = cast
        s_qkv, s_o, s_gate_up, s_down = self.scales
        g_qkv, g_o, g_gate_up, g_down = self.groups
        batch, seq, hidden = ctx.shape
        needs = ctx.needs_input_grad
        dtype, zero = self.dtype, self.zero
        with below_autograd():
            grad2d = grad.reshape(-1, hidden)
            # down
            d_hidden, dy, dyb_down = _single_backward(g_down, grad2d, ad, bd, s_down, dtype)
            # the gate: H rewritten, d gate / d up written over the saved gate / up
            h, d_gate, d_up = self.gate_backward(d_hidden, gate, up, True)
            dispatch.mark_overwritten(gate, up)
            del d_hidden
            g_ad = torch.addmm(zero, dyb_down.t(), h, beta=0, alpha=s_down)
            g_bd = torch.addmm(zero, dy.t(), xa_down, beta=0, alpha=s_down)
            del h
            # gate | up
            d_mlp_in, g_a_gate_up, g_b_gate_up = _grouped_backward(
                g_gate_up, mlp_in, xa_gate_up, a_gate_up, (bg, bu), (d_gate, d_up), True, s_gate_up, self.cast, zero
            )
            # The residual stream's gradient joins the norm's in its kernel.
            fold = grad2d.dtype == hidden_states.dtype
            d_h, g_post_weight = rms_norm_backward(
                d_mlp_in, hidden_states, post_weight, post_rstd, 0.0, True, True, needs[7], grad2d if fold else None
            )
            if not fold:
                d_h = d_h + grad2d
            # o
            d_o_in, dy_o, dyb_o = _single_backward(g_o, d_h, ao, bo, s_o, dtype)
            g_ao = torch.addmm(zero, dyb_o.t(), o_in, beta=0, alpha=s_o)
            g_bo = torch.addmm(zero, dy_o.t(), xa_o, beta=0, alpha=s_o)
        leaves = ctx.graph[:3]
        grad_q, grad_k, grad_v = graph_backward(ctx, d_o_in, attention_backward)
        with below_autograd():
            # An input the attention did not use has no gradient: zeros, what its absence contributes.
            grad_q, grad_k, grad_v = (
                torch.zeros_like(leaf) if found is None else found
                for found, leaf in zip((grad_q, grad_k, grad_v), leaves, strict=True)
            )
            # Asked again here, as the general node asks: a CUDA backward runs on autograd's device thread, where a
            # thread's dispatch.force_reference() does not hold.
            if dispatch.use_triton(grad_q):
                # Written as [batch, seq, heads, head_dim]: the [tokens, width] views below are then free.
                rotated = []
                for found in (grad_q, grad_k):
                    b, heads, s, d = found.shape
                    rotated.append(dispatch.empty((b, s, heads, d), dtype=found.dtype, device=found.device))
                rotated = [t.transpose(1, 2) for t in rotated]
                _launch(grad_q, grad_k, rotated[0], rotated[1], cos, sin, None, backward=True)
                grad_q, grad_k = rotated
            else:
                table, factor = _reference_tables(cos, sin, None, _compute_dtype(grad_q.dtype), backward=True)
                grad_q, grad_k = _rotate(grad_q, table, factor), _rotate(grad_k, table, factor)
            tokens = batch * seq
            flat = [g.transpose(1, 2).reshape(tokens, -1) for g in (grad_q, grad_k, grad_v)]
            d_group_in, g_a_qkv, g_b_qkv = _grouped_backward(
                g_qkv, group_in, xa_qkv, a_qkv, (bq, bk, bv), flat, needs[0] or needs[6], s_qkv, self.cast, zero
            )
            grad_x = grad_input_weight = None
            fold = needs[0] and d_h.dtype == x2d.dtype
            if d_group_in is not None:
                grad_x, grad_input_weight = rms_norm_backward(
                    d_group_in, x2d, input_weight, input_rstd, 0.0, True, needs[0], needs[6], d_h if fold else None
                )
            if needs[0]:
                grad_x = (grad_x if fold else grad_x + d_h).view(batch, seq, hidden)
            grads = (*g_a_qkv, *g_b_qkv, g_ao, g_bo, *g_a_gate_up, g_ad, *g_b_gate_up, g_bd)
            if self.cast:
                # Computed in the compute dtype, returned in the parameters': one copy casts them all.
                targets = [torch.empty_like(found, dtype=self.adapter_dtype) for found in grads]
                torch._foreach_copy_(targets, list(grads))
                grads = tuple(targets)
        return (grad_x, None, None, None, None, None, grad_input_weight, g_post_weight, *grads)


def _single_backward(
    group: _Group,
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dX, dY, dY B)`` of a one-projection group (o, down) as :func:`fastft.kernels.lora_backward.backward_input`
    computes them for it, in its order; dY in the compute dtype. The group's dA and dB are then
    ``s (dY B)ᵀ X`` and ``s dYᵀ (X Aᵀ)``."""
    dy = grad if grad.dtype == dtype else grad.to(dtype)
    (weight,) = group.dense(dtype)
    grad_x = None if group.accumulate else torch.mm(dy, weight)
    dyb = torch.mm(dy, b)
    grad_x = low_rank_term(grad_x, dyb, a, scale)
    if group.accumulate:
        grad_x.addmm_(dy, weight)
    return grad_x, dy, dyb


def _grouped_backward(
    group: _Group,
    x2d: torch.Tensor,
    xa: torch.Tensor,
    stacked_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    needs_x: bool,
    scale: float,
    cast: bool,
    zero: torch.Tensor,
) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """``(dX or None, [dA], [dB])`` of a group of two or three adapters under one scale, as
    :func:`fastft.kernels.lora_backward.backward_input` and ``finish`` compute them for it, in their order."""
    dtype = x2d.dtype
    grads = [g if g.dtype == dtype else g.to(dtype) for g in grads]
    accumulate = group.accumulate and needs_x
    ranks = group.spec.lora_rows
    grad_x = None
    weights: Sequence[torch.Tensor] = ()
    if needs_x:
        weights = group.dense(dtype)
        if not accumulate:
            for grad, weight in zip(grads, weights, strict=True):
                grad_x = torch.mm(grad, weight) if grad_x is None else grad_x.addmm_(grad, weight)
    dyb = torch.empty((x2d.shape[0], xa.shape[1]), dtype=dtype, device=x2d.device)
    dyb_parts = torch.split_with_sizes(dyb, ranks, dim=1)
    for grad, b, part in zip(grads, lora_b, dyb_parts, strict=True):
        torch.mm(grad, b, out=part)
    xas = torch.split_with_sizes(xa, ranks, dim=1)
    if needs_x:
        grad_x = low_rank_term(grad_x, dyb, stacked_a, scale)
        if accumulate:
            for grad, weight in zip(grads, weights, strict=True):
                grad_x.addmm_(grad, weight)
    del weights
    if cast:
        # Every dA at once; its row blocks are cast into tensors of their own afterwards.
        grad_a = list(torch.split_with_sizes(torch.addmm(zero, dyb.t(), x2d, beta=0, alpha=scale), ranks))
    else:
        grad_a = [torch.addmm(zero, part.t(), x2d, beta=0, alpha=scale) for part in dyb_parts]
    grad_b = [torch.addmm(zero, grad.t(), xa_j, beta=0, alpha=scale) for grad, xa_j in zip(grads, xas, strict=True)]
    return grad_x, grad_a, grad_b


class _Off:
    """Autocast off around the groups when the caller runs under autocast (``dtype`` set), else nothing."""

    __slots__ = ("context",)

    def __init__(self, x: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.context = None if dtype is None else autocast_off(x)

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def _eligible(spec: Any) -> bool:
    """Whether the layer is of the shape a program serves (see the module docstring); fixed for the spec's life."""
    qkv, o, mlp = spec.qkv, spec.o, spec.mlp
    groups = (qkv, o, mlp.gate_up, mlp.down)
    shape = tuple(len(group.projections) for group in groups)
    if shape != (3, 1, 2, 1) or qkv.split is not None or mlp.activation not in HIDDEN_BACKWARDS:
        return False
    if any(group._lora_count != len(group.projections) for group in groups):
        return False
    if qkv._spec.grouped_scale is None or mlp.gate_up._spec.grouped_scale is None:
        return False
    adapters = spec._adapters
    return all(a.requires_grad and a.dtype == adapters[0].dtype for a in adapters)


def program_for(spec: Any, x2d: torch.Tensor, dtype: torch.dtype | None) -> LayerProgram | None:
    """The spec's program for this call, or None where the general node must run.

    Per call this costs a plan key, one dict lookup and the dtype check; the program is made the first time a key
    finds every group's GEMM choice memoised (after the general node ran once under it)."""
    programs = spec.programs
    if programs is None:
        return None
    compute = x2d.dtype if dtype is None else dtype
    # The groups' own memo key: their input is x2d's rows in the compute dtype.
    key = gemm_tuner.plan_key(x2d, compute)
    program = programs.get(key, _MISSING)
    if program is _MISSING:
        program = _make(spec, key, x2d, compute)
        if program is _MISSING:
            return None
        if len(programs) >= _MAX_PROGRAMS:
            # Keys change with the rows' power-of-two bucket and the tuner's generation: a run whose lengths keep
            # changing would otherwise grow the table without end.
            programs.clear()
        programs[key] = program
    if program is None or not program.holds():
        return None
    return program


_MISSING = object()
_MAX_PROGRAMS = 32


def _make(spec: Any, key: tuple, x2d: torch.Tensor, compute: torch.dtype) -> LayerProgram | None | object:
    groups = (spec.qkv, spec.o, spec.mlp.gate_up, spec.mlp.down)
    candidates = [group._spec.plans.get(key) for group in groups]
    if any(candidate is None for candidate in candidates):
        return _MISSING  # not chosen yet: the general node chooses on its first call
    for group in groups:
        # A dense base of another dtype is cast on every call by the general node (what autocast would do).
        dense = (w for w, state in zip(group._weights, group._quant_states, strict=True) if state is None)
        if any(w.dtype != compute for w in dense):
            return None
    return LayerProgram(spec, candidates, x2d, compute)


def programs_of(spec: Any) -> dict[Any, Any] | None:
    """A new spec's program table, or None for a layer no program serves."""
    return {} if _eligible(spec) else None


__all__ = ["LayerProgram", "program_for", "programs_of"]
