"""A whole pre-norm decoder layer with LoRA as one autograd node: norm, q / k / v with RoPE, attention, o, residual,
norm, gated MLP, residual.

Run as separate nodes (:func:`~fastft.kernels.rms_norm`, :func:`~fastft.kernels.lora_qkv_rope`, the attention, the
o group, two residual adds, :class:`~fastft.kernels.LoRAMLP`), a layer costs the autograd engine nine nodes in
backward, each with its own Python call, saved-tensor unpacking and gradient routing, and costs the forward as many
``Function.apply`` calls. On a GPU that host time is time the GPU waits. Here the forward is one straight-line
function over the same kernel math (:func:`~fastft.kernels.lora_qkv_rope.qkv_rope_forward`,
:meth:`LoRAGroup.forward_math <fastft.kernels.lora_group.LoRAGroup.forward_math>`,
:func:`~fastft.kernels.lora_mlp.mlp_forward`, the RMSNorm kernel) and the backward one straight-line function over
their backward math, so a layer is one node, and the numbers are the separate nodes' own, bit for bit.

The attention itself stays the caller's (eager, sdpa, flash, a sliding window, dropout): ``attend(q, k, v)`` runs in
the forward with autograd on over q, k and v alone, and the backward differentiates that small graph. Saved: what the
separate nodes save (x, the normed inputs of each group, the small X Aᵀ's, the gate / up pre-activations, the
attention's own saved tensors), nothing more.

With grad mode off (checkpointing's forward, a replay) the same forward runs and keeps nothing.

From a layer's second call under a GEMM plan key, a layer whose plan fixes every choice runs the same operators as a
straight-line program instead of this general math (:mod:`fastft.kernels.lora_layer_program`): same node, same saved
tensors, same bits, without the per-call decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from fastft.kernels.custom_ops import below_autograd, direct_apply
from fastft.kernels.layer_attention import Attend, attention_backward, graph_backward, run_attention
from fastft.kernels.lora_group import LoRAGroup
from fastft.kernels.lora_layer_program import program_for, programs_of
from fastft.kernels.lora_math import cast_groups
from fastft.kernels.lora_mlp import LoRAMLP, mlp_backward, mlp_forward
from fastft.kernels.lora_projection import autocast_off
from fastft.kernels.lora_qkv_rope import qkv_rope_backward, qkv_rope_forward
from fastft.kernels.rms_norm import _backward as rms_norm_backward
from fastft.kernels.rms_norm import _forward as rms_norm_forward


class DecoderLayerSpec:
    """What one layer's node needs besides its tensors: the three fused groups, the norms' epsilons and head_dim.

    Built once per layer plan (the groups are checked when they are made), immutable after.

    Args:
        qkv: The q | k | v group (three projections).
        o: The o group.
        mlp: The gated MLP.
        input_eps: ``input_layernorm``'s epsilon.
        post_eps: ``post_attention_layernorm``'s epsilon.
        head_dim: The attention's head_dim.
    """

    __slots__ = (
        "_adapters",
        "frozen",
        "head_dim",
        "input_eps",
        "lora_cuts",
        "mlp",
        "o",
        "post_eps",
        "programs",
        "qkv",
        "sizes",
    )

    def __init__(self, qkv: LoRAGroup, o: LoRAGroup, mlp: LoRAMLP, input_eps: float, post_eps: float, head_dim: int):
        self.qkv, self.o, self.mlp = qkv, o, mlp
        self.input_eps, self.post_eps, self.head_dim = float(input_eps), float(post_eps), int(head_dim)
        # How many adapter tensors each part takes, in adapters() order.
        self.sizes = (len(qkv._adapters), len(o._adapters), len(mlp._adapters))
        # Where each group's A's and B's sit among them: (start of the A's, start of the B's, count) per group.
        gate_up, down = mlp.gate_up._lora_count, mlp.down._lora_count
        start, cuts = 0, []
        for count in (qkv._lora_count, o._lora_count):
            cuts.append((start, start + count, count))
            start += 2 * count
        cuts.append((start, start + gate_up + down, gate_up))
        cuts.append((start + gate_up, start + 2 * gate_up + down, down))
        self.lora_cuts = tuple(cuts)
        # Every base weight and bias: the node gives them no gradient.
        self.frozen = qkv._frozen + o._frozen + mlp.gate_up._frozen + mlp.down._frozen
        # The groups' adapter tuples are fixed when they are made: joined once, not on every call.
        self._adapters = qkv._adapters + o._adapters + mlp._adapters
        # Straight-line programs of this layer per plan key (lora_layer_program), or None where none can serve it.
        self.programs = programs_of(self)

    def adapters(self) -> tuple[torch.Tensor, ...]:
        """Every A and B of the layer: the q / k / v group's, o's, then the MLP's (each part as it orders them)."""
        return self._adapters

    def lora_groups(self, adapters: Sequence[torch.Tensor]) -> list[tuple[Sequence[Any], Sequence[Any]]]:
        """``(A's, B's)`` of the q / k / v, o, gate / up and down groups, from :meth:`adapters`' tuple."""
        return [(adapters[a : a + n], adapters[b : b + n]) for a, b, n in self.lora_cuts]

    def split(self, adapters: Sequence[torch.Tensor]) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any]]:
        qkv, o, _ = self.sizes
        return adapters[:qkv], adapters[qkv : qkv + o], adapters[qkv + o :]


def _forward(
    spec: DecoderLayerSpec,
    x: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    attend: Attend,
    norms: tuple[torch.Tensor, torch.Tensor],
    adapters: Sequence[torch.Tensor],
    dtype: torch.dtype | None,
    ctx: Any,
    output: bool = True,
) -> torch.Tensor:
    """The layer's output; with ``ctx`` (an autograd context) also what the backward needs, saved on it.

    ``dtype``: the autocast dtype (None without autocast). Each part then runs as its own node would: the norms and
    the attention under the caller's autocast, the projection groups with autocast off on inputs cast to ``dtype``.
    With ``output`` False (a recompute for the backward alone, with ``ctx``) the layer stops at the last tensor the
    backward reads and returns an uninitialised tensor of the output's shape.
    """
    (cos, sin), (input_weight, post_weight) = tables, norms
    batch, seq, hidden = x.shape
    # Made above below_autograd(): a saved view of the input must share the input's version counter.
    x2d = x.reshape(-1, hidden)
    program = program_for(spec, x2d, dtype)
    if program is not None:
        # The same operators in the same order, every choice made when the program was.
        return program.forward(x, x2d, cos, sin, attend, input_weight, post_weight, adapters, dtype, ctx, output)
    qkv_adapters, o_adapters, mlp_adapters = spec.split(adapters)
    casts: tuple[Any, ...] = ({}, {}, ({}, {}))

    with below_autograd():
        normed, input_rstd = rms_norm_forward(x2d, input_weight, spec.input_eps, 0.0, True)
        group_in = normed if dtype is None else normed.to(dtype)
        # peft's fp32 adapters over a 16-bit base: all four groups' casts in one copy (a group whose input turns out
        # to be of another dtype casts its own).
        if any(adapter.dtype != group_in.dtype for adapter in adapters):
            cast_groups(spec.lora_groups(adapters), group_in.dtype, (casts[0], casts[1], *casts[2]))
        with _autocast_off(x, dtype):
            query, key, value, xa_qkv = qkv_rope_forward(
                spec.qkv, group_in, batch, seq, cos, sin, spec.head_dim, qkv_adapters, casts[0]
            )
    attention, graph = run_attention(attend, query, key, value, ctx is not None)
    with below_autograd():
        rest = _forward_rest(spec, x, x2d, attention, post_weight, o_adapters, mlp_adapters, casts, dtype, output)
    hidden_states, post_rstd, mlp_in, mlp_saved, o_in, xa_o, out = rest

    if ctx is not None:
        ctx.program, ctx.spec, ctx.graph, ctx.casts, ctx.shape = None, spec, graph, casts, (batch, seq, hidden)
        # Positional, in _Saved's order (a NamedTuple cannot be saved as such, its fields can).
        saved = (x2d, input_rstd, group_in, xa_qkv, cos, sin, o_in, xa_o, hidden_states, post_rstd, mlp_in)
        ctx.save_for_backward(*saved, *mlp_saved, input_weight, post_weight, *adapters)
    return out


def _forward_rest(
    spec: DecoderLayerSpec,
    x: torch.Tensor,
    x2d: torch.Tensor,
    attention: torch.Tensor,
    post_weight: torch.Tensor,
    o_adapters: Sequence[torch.Tensor],
    mlp_adapters: Sequence[torch.Tensor],
    casts: tuple[Any, ...],
    dtype: torch.dtype | None,
    output: bool,
) -> tuple[Any, ...]:
    """The layer after the attention (o, residual, norm, MLP, residual), run inside :func:`below_autograd`."""
    batch, seq, _ = x.shape
    attention2d = attention.reshape(batch * seq, -1)
    o_in = attention2d if dtype is None else attention2d.to(dtype)
    with _autocast_off(x, dtype):
        (o_out,), xa_o = spec.o.forward_math(o_in, o_adapters, casts[1])
    hidden_states = x2d + o_out

    post_normed, post_rstd = rms_norm_forward(hidden_states, post_weight, spec.post_eps, 0.0, True)
    mlp_in = post_normed if dtype is None else post_normed.to(dtype)
    with _autocast_off(x, dtype):
        mlp_out, mlp_saved = mlp_forward(spec.mlp, mlp_in, mlp_adapters, casts[2], output)
    if mlp_out is not None:
        out = hidden_states + mlp_out
    else:
        # The backward never reads the output: a recompute for it skips the down GEMM and the residual add. The MLP
        # writes in its input's dtype, so this is the dtype the add would have given.
        out = hidden_states.new_empty(hidden_states.shape, dtype=torch.promote_types(hidden_states.dtype, mlp_in.dtype))
    return hidden_states, post_rstd, mlp_in, mlp_saved, o_in, xa_o, out.view(batch, seq, out.shape[-1])


def _autocast_off(x: torch.Tensor, dtype: torch.dtype | None) -> Any:
    return _NO_CONTEXT if dtype is None else autocast_off(x)


class _NoContext:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CONTEXT = _NoContext()


class _Saved(NamedTuple):
    """What the node keeps besides the norm weights and the adapters, in the order it saves them."""

    x2d: torch.Tensor
    input_rstd: torch.Tensor
    group_in: torch.Tensor
    xa_qkv: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    o_in: torch.Tensor
    xa_o: torch.Tensor | None
    hidden_states: torch.Tensor
    post_rstd: torch.Tensor
    mlp_in: torch.Tensor
    xa_gate_up: torch.Tensor | None
    gate: torch.Tensor
    up: torch.Tensor
    xa_down: torch.Tensor | None


# x, spec, cos, sin, attend, dtype, input_weight, post_weight: which are tensors (the adapters all are).
_TENSOR_ARGUMENTS = (True, False, True, True, False, False, True, True)


def _node_forward(output: bool) -> Any:
    """The nodes' ``forward``: the layer's output, or (``output`` False) only what the backward reads."""

    def forward(
        ctx: Any,
        x: torch.Tensor,
        spec: DecoderLayerSpec,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        dtype: torch.dtype | None,
        input_weight: torch.Tensor,
        post_weight: torch.Tensor,
        *adapters: torch.Tensor,
    ) -> torch.Tensor:
        # Which arguments are tensors (the node's edges): fastft's checkpointer calls this node by hand.
        ctx.tensor_inputs = _TENSOR_ARGUMENTS + (True,) * len(adapters)
        return _forward(spec, x, (cos, sin), attend, (input_weight, post_weight), adapters, dtype, ctx, output)

    return staticmethod(forward)


class LoRADecoderLayerFunction(torch.autograd.Function):
    """Eager node of :func:`lora_decoder_layer`: arguments ``(x, spec, cos, sin, attend, dtype, input_weight,
    post_weight, *adapters)``, output the layer's hidden states."""

    forward = _node_forward(True)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.graph is None:
            raise RuntimeError(
                "fastft lora_decoder_layer: this layer's backward already ran, and spent its attention graph and the "
                "buffers it writes gradients over. A fused layer takes one backward per forward (no retain_graph=True "
                "second pass): run the forward again for another backward, or load with "
                "FastModel.from_pretrained(..., patch=False)."
            )
        if ctx.program is not None:
            return ctx.program.backward(ctx, grad, attention_backward)
        spec: DecoderLayerSpec = ctx.spec
        # Read once: each read of ctx.saved_tensors unpacks (and version-checks) every saved tensor again.
        everything = ctx.saved_tensors
        saved = _Saved(*everything[: len(_Saved._fields)])
        input_weight, post_weight, *adapters = everything[len(_Saved._fields) :]
        qkv_casts, o_casts, mlp_casts = ctx.casts
        batch, seq, hidden = ctx.shape
        needs = ctx.needs_input_grad
        qkv_count, o_count, mlp_count = spec.sizes
        first = 8  # the position of the first adapter among the node's inputs
        # dX of the q / k / v group only where x or the input norm's weight takes a gradient (not in the first layer).
        qkv_needs = (needs[0] or needs[6], *needs[first : first + qkv_count])
        o_needs = (True, *needs[first + qkv_count : first + qkv_count + o_count])
        mlp_flags = needs[first + qkv_count + o_count :]
        half = mlp_count // 2
        mlp_needs = [mlp_flags[j] or mlp_flags[half + j] for j in range(half)]
        qkv_adapters, o_adapters, mlp_adapters = spec.split(adapters)
        # The LoRA gradients of all four groups that need a cast (fp32 adapters) are cast together at the end.
        deferred: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for casts in (qkv_casts, o_casts, *mlp_casts):
            casts["grads"] = deferred

        with below_autograd():
            grad2d = grad.reshape(-1, hidden)
            grad_mlp_in, mlp_a, mlp_b = mlp_backward(
                spec.mlp, saved.mlp_in, saved[11:], mlp_adapters, grad2d, True, mlp_needs, mlp_casts
            )
            # The residual stream's gradient (what reaches h from the layer's output) joins the norm's in its kernel.
            fold = grad2d.dtype == saved.hidden_states.dtype
            grad_hidden, grad_post_weight = rms_norm_backward(
                grad_mlp_in,
                saved.hidden_states,
                post_weight,
                saved.post_rstd,
                0.0,
                True,
                True,
                needs[7],
                grad2d if fold else None,
            )
            if not fold:
                grad_hidden = grad_hidden + grad2d

            grad_o_in, o_a, o_b = spec.o.backward_math(
                saved.o_in, saved.xa_o, o_adapters, [grad_hidden], o_needs, 1, o_casts
            )
        grad_q, grad_k, grad_v = graph_backward(ctx, grad_o_in, attention_backward)
        with below_autograd():
            grad_in, qkv_a, qkv_b = qkv_rope_backward(
                spec.qkv,
                saved.group_in,
                saved.xa_qkv,
                saved.cos,
                saved.sin,
                qkv_adapters,
                (grad_q, grad_k, grad_v),
                qkv_needs,
                1,
                qkv_casts,
            )
            grad_x = grad_input_weight = None
            fold = needs[0] and grad_hidden.dtype == saved.x2d.dtype
            if grad_in is not None:
                grad_x, grad_input_weight = rms_norm_backward(
                    grad_in,
                    saved.x2d,
                    input_weight,
                    saved.input_rstd,
                    0.0,
                    True,
                    needs[0],
                    needs[6],
                    grad_hidden if fold else None,
                )
            if needs[0]:
                grad_x = (grad_x if fold else grad_x + grad_hidden).view(batch, seq, hidden)
            sources, targets = deferred
            if sources:
                torch._foreach_copy_(targets, sources)
                # ctx keeps the lists: a gradient still referenced from here would be cloned by AccumulateGrad.
                sources.clear()
                targets.clear()
        return (
            grad_x,
            None,
            None,
            None,
            None,
            None,
            grad_input_weight,
            grad_post_weight,
            *qkv_a,
            *qkv_b,
            *o_a,
            *o_b,
            *mlp_a,
            *mlp_b,
        )


class LoRADecoderLayerRecompute(LoRADecoderLayerFunction):
    """:class:`LoRADecoderLayerFunction` for a checkpointed layer's recompute, whose output only carries the node to
    the backward: the same saved tensors and backward, but the forward stops at the last tensor the backward reads
    (the down projection's ``H A_downᵀ``), and the output's values are left uninitialised. That skips the largest GEMM
    of the MLP on every recomputed layer of every step."""

    forward = _node_forward(False)


_apply = direct_apply(LoRADecoderLayerFunction)
_apply_recompute = direct_apply(LoRADecoderLayerRecompute)


def lora_decoder_layer(
    spec: DecoderLayerSpec,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
    input_weight: torch.Tensor,
    post_weight: torch.Tensor,
    dtype: torch.dtype | None = None,
    output: bool = True,
) -> torch.Tensor:
    """A Llama-shaped decoder layer (``x + o(attn(rope(qkv(norm(x)))))``, then ``h + mlp(norm(h))``) as one node.

    Args:
        spec: The layer's groups and sizes.
        x: Hidden states ``[batch, seq, hidden]``.
        cos: The rotary table ``[batch or 1, seq, head_dim]`` (no gradient flows to it).
        sin: Same shape as cos.
        attend: ``attend(q, k, v)`` with q, k, v ``[batch, heads or kv_heads, seq, head_dim]`` returns the attention
            output ``[batch, seq, heads · head_dim]`` (differentiable in q, k and v).
        input_weight: ``input_layernorm``'s weight (Llama's RMSNorm); gets a gradient when it requires one.
        post_weight: ``post_attention_layernorm``'s weight.
        dtype: The autocast dtype the caller runs under, or None.
        output: False for a recompute that only runs the node's backward (a checkpointed layer's): the returned
            tensor then has the node as its ``grad_fn`` and the output's shape and dtype, but its values are not
            computed (:class:`LoRADecoderLayerRecompute`).

    Returns:
        The layer's output ``[batch, seq, hidden]``, equal to the separate fused nodes' output, with gradients for
        x, both norm weights (where they require grad) and every A and B.

    Raises:
        RuntimeError: ``output`` is False with grad mode off: with no node to run a backward through, the call would
            compute nothing anyone could read.
    """
    if not output:
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "fastft lora_decoder_layer: output=False called with grad mode off. It builds the layer's node for "
                "a backward and leaves the output's values uncomputed; call it with output=True for the output."
            )
        return _apply_recompute(x, spec, cos, sin, attend, dtype, input_weight, post_weight, *spec.adapters())
    adapters = spec.adapters()
    if not torch.is_grad_enabled():
        # Nothing will be recorded (checkpointing's forward, a replay, evaluation): the same math, nothing kept.
        return _forward(spec, x, (cos, sin), attend, (input_weight, post_weight), adapters, dtype, None)
    return _apply(x, spec, cos, sin, attend, dtype, input_weight, post_weight, *adapters)


__all__ = [
    "DecoderLayerSpec",
    "LoRADecoderLayerFunction",
    "LoRADecoderLayerRecompute",
    "lora_decoder_layer",
]
