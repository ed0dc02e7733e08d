"""LoRAGroup: one to three LoRA projections of the same input (q | k | v, o, gate | up, down, a packed qkv), checked
once and then applied per call with a few microseconds of Python.

A group is built when a patch reads a layer's weights (:mod:`fastft.patches`), and applied on every forward::

    qkv = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), [q, k, v], "qkv")
    q_out, k_out, v_out = qkv(x)

Construction validates everything that does not depend on x (weights, dtypes, biases, A / B shapes, finite scales,
packed widths), raising the errors :func:`~fastft.kernels.lora_projection.check_projection` raises. A call checks
only x's dtype and last dim, and that no base weight or bias requires grad while autograd is on, picks the compute
dtype (autocast's, when on), and applies the group:

- eager: an ``autograd.Function`` (:class:`LoRAGroupFunction`; :class:`~fastft.kernels.lora_qkv.LoRAQKVFunction`
  and friends by the group's function name) whose arguments are x, the group and the trainable A's and B's only,
  so autograd sees and version-checks exactly those. Its forward and backward read the fixed parts (widths, scales,
  base weights, quant_states) from the group and run :mod:`fastft.kernels.lora_math`; the GEMM choice is memoised
  in the group. A custom op's dispatch costs about three times an ``autograd.Function``'s, so eager never takes it.
- ``torch.compile``: the custom op ``fastft::lora_group`` (fake implementation and autograd registered, backward op
  ``fastft::lora_group_backward``) over the same math, with every tensor an argument and each NF4 quant_state
  flattened into tensors and ints (:func:`~fastft.kernels.lora_op_args.flatten_group`), so a compiled decoder layer
  has no graph break.

Schemas (``layout`` has :data:`~fastft.kernels.lora_math.LAYOUT_FIELDS` ints per segment: out, in, rank or -1,
has_bias, NF4 blocksize or 0, nested blocksize or 0; ``nf4`` holds per NF4 segment its absmax, then, when
double-quantised, state2.absmax, state2.code and the offset)::

    fastft::lora_group(Tensor x, Tensor[] weights, Tensor[] lora_a, Tensor[] lora_b, Tensor[] biases,
                       Tensor[] nf4, SymInt[] layout, float[] scales, str group) -> Tensor[]
        # one [..., out_i] per segment, then X Aᵀ [M, Σ r]
    fastft::lora_group_backward(Tensor?[] grads, Tensor x, Tensor xa, Tensor[] weights, Tensor[] lora_a,
                                Tensor[] lora_b, Tensor[] nf4, SymInt[] layout, float[] scales, str group,
                                bool[] needs) -> Tensor[]
        # dX ([0] when needs[0] is False), then dA and dB per LoRA segment ([0] where not needed)

A group is immutable: when the model's adapters, weights or device change, build a new one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels import lora_backward, lora_math, lora_op_args
from fastft.kernels.custom_ops import below_autograd, compiling, define, direct_apply, math_backward, register_autograd
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_projection import (
    FLOAT_DTYPES,
    LoRAWeights,
    autocast_dtype,
    autocast_off,
    check_projection,
    frozen_error,
    is_packed,
    quant_state_of,
    x_dtype_error,
    x_shape_error,
)
from fastft.kernels.traced_reference import group_outputs, traces_reference

# The tuner's group names (gemm_tuner.choices and patch_report show them).
GROUPS = ("qkv", "o", "gate_up", "down")


class LoRAGroupFunction(torch.autograd.Function):
    """Eager autograd node of a :class:`LoRAGroup`: arguments ``(x, group, *A's, *B's)`` (the A's and B's of the
    segments that carry LoRA), outputs one ``[..., out_i]`` per segment. Saves X and the small X Aᵀ (never Y) and the
    A's / B's (for autograd's version check); base weights and quant_states are read from the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: LoRAGroup, *adapters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        ctx.casts = {}
        # x2d (saved) is made above below_autograd(): a saved view of an input shares the input's version counter.
        with below_autograd():
            outputs, xa = group.forward_math(x2d, adapters, ctx.casts)
            if x.dim() != 2:
                lead = x.shape[:-1]
                outputs = [out.view(*lead, out.shape[1]) for out in outputs]
        ctx.group = group
        ctx.x_shape = x.shape
        ctx.save_for_backward(x2d, xa, *adapters)
        return tuple(outputs)

    @staticmethod
    @math_backward
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x2d, xa, *adapters = ctx.saved_tensors
        grad_x, grad_a, grad_b = ctx.group.backward_math(x2d, xa, adapters, grads, ctx.needs_input_grad, 2, ctx.casts)
        if grad_x is not None and len(ctx.x_shape) != 2:
            grad_x = grad_x.view(ctx.x_shape)
        return (grad_x, None, *grad_a, *grad_b)


# function name -> the Function class whose name shows in grad_fn (LoRAQKVFunctionBackward, ...); the kernel files
# register theirs.
FUNCTIONS: dict[str, type[LoRAGroupFunction]] = {}


class LoRAGroup:
    """One to three LoRA projections of the same input, validated once, applied per call.

    Args:
        function: The name errors start with (``"lora_qkv"``, ``"lora_o"``, ``"lora_packed_qkv"``, ``"lora_mlp"``,
            ``"lora_gate_up_mlp"``); it also picks the eager Function class (``LoRAQKVFunction`` for ``"lora_qkv"``).
        names: Each projection's name in errors (``("q_proj", "k_proj", "v_proj")``).
        projections: One :class:`~fastft.kernels.lora_projection.LoRAWeights` per name: a dense or NF4 base, an
            optional frozen bias, an optional adapter.
        group: The tuner's group, one of :data:`GROUPS`.
        split: For a packed projection (Phi-3's qkv_proj), the widths its output is split into.

    Attributes:
        function, names, projections, group, split: As passed (names and projections as tuples).
        shapes: Each projection's base ``(out_features, in_features)`` (read from the quant_state for NF4).
        out_features: Each output's width (the split widths for a packed projection).

    Raises:
        ShapeContractError: A bias, A or B that does not fit its base weight, a packed weight without a usable
            quant_state, or split widths that do not add up to the projection's out_features (named, both shapes).
        TypeError: Weights or biases of an unsupported dtype.
        ValueError: Not 1 to 3 projections, names that do not match them, an unknown group, a non-finite scale, or
            only one of lora_a / lora_b.
    """

    def __init__(
        self,
        function: str,
        names: Sequence[str],
        projections: Sequence[LoRAWeights],
        group: str,
        *,
        split: Sequence[int] | None = None,
    ) -> None:
        names, projections = tuple(names), tuple(projections)
        if not 1 <= len(projections) <= 3:
            raise ValueError(
                f"{function}: a fused LoRA group holds 1 to 3 projections (the GEMM's segments), got "
                f"{len(projections)}; build one group per input and at most three projections each."
            )
        if len(names) != len(projections):
            raise ValueError(
                f"{function}: got {len(names)} names {list(names)} for {len(projections)} projections; pass one "
                "name per projection."
            )
        if group not in GROUPS:
            raise ValueError(f"{function}: group must be one of {', '.join(GROUPS)}, got {group!r}.")
        shapes = [check_projection(f"{function}: {name}", p) for name, p in zip(names, projections, strict=True)]
        if split is not None:
            if len(projections) != 1:
                raise ValueError(
                    f"{function}: split= cuts the output of one packed projection, got {len(projections)} "
                    f"projections {list(names)}; pass the packed projection alone."
                )
            split = tuple(int(width) for width in split)
            packed = shapes[0][0]
            if sum(split) != packed or any(width <= 0 for width in split):
                raise ShapeContractError(
                    f"{function}: {names[0]} has out_features {packed}, but the q / k / v widths {list(split)} add "
                    f"up to {sum(split)}; the widths are heads · head_dim, kv_heads · head_dim, kv_heads · head_dim "
                    "from the config, so the checkpoint's qkv_proj does not fit its config.json."
                )
        in_features = {k for _, k in shapes}
        lora = [p for p in projections if p.lora_a is not None]
        values = {
            "function": function,
            "names": names,
            "projections": projections,
            "group": group,
            "split": split,
            "shapes": tuple(shapes),
            "_spec": lora_math.spec_of(group, projections),
            "_weights": tuple(p.weight for p in projections),
            "_quant_states": tuple(quant_state_of(p) if is_packed(p) else None for p in projections),
            "_biases": None if all(p.bias is None for p in projections) else tuple(p.bias for p in projections),
            "_frozen": tuple(p.weight for p in projections) + tuple(p.bias for p in projections if p.bias is not None),
            "_lora_count": len(lora),
            "_adapters": tuple(p.lora_a for p in lora) + tuple(p.lora_b for p in lora),
            # One in_features for every projection is the rule; a mix fails every call, naming the projection.
            "_in_features": in_features.pop() if len(in_features) == 1 else None,
            "_function": FUNCTIONS.get(function, LoRAGroupFunction),
            "_apply_function": direct_apply(FUNCTIONS.get(function, LoRAGroupFunction)),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{self.function}: a LoRAGroup is immutable (its checks and GEMM choices hold for the weights it was "
            f"built with); build a new one instead of setting {name!r}."
        )

    @property
    def out_features(self) -> tuple[int, ...]:
        """Each projection's out_features (the split widths for a packed projection)."""
        return self.split if self.split is not None else tuple(out for out, _ in self.shapes)

    def check_input(self, x: torch.Tensor) -> None:
        """The per-call checks: x's dtype and last dim, and frozen base weights and biases while autograd is on.

        Raises:
            TypeError: x is not float32 / float16 / bfloat16.
            ShapeContractError: x's last dim is not a projection's in_features (named, with both shapes).
            ValueError: A base weight or bias requires grad while autograd is on (it would get no gradient).
        """
        if x.dtype not in FLOAT_DTYPES:
            raise x_dtype_error(self.function, x)
        if x.shape[-1] != self._in_features:
            for name, (out_features, in_features) in zip(self.names, self.shapes, strict=True):
                if x.shape[-1] != in_features:
                    raise x_shape_error(f"{self.function}: {name}", x, out_features, in_features)
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._frozen):
            for name, projection in zip(self.names, self.projections, strict=True):
                error = frozen_error(f"{self.function}: {name}", projection)
                if error is not None:
                    raise error

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply the group to ``x [..., in]``.

        Under autocast x is cast to its dtype first (what ``F.linear`` computes in), and the group runs with autocast
        off. Gradients flow to x and to every A and B; base weights and biases are frozen.

        Returns:
            One ``[..., out_i]`` per projection (per split width for a packed projection: views of one output), in
            the compute dtype.

        Raises:
            TypeError, ShapeContractError, ValueError: See :meth:`check_input`.
        """
        self.check_input(x)
        dtype = autocast_dtype(x)
        if dtype is None:
            outputs = self._apply(x)
        else:
            with autocast_off(x):
                outputs = self._apply(x.to(dtype))
        if self.split is not None:
            return tuple(outputs[0].split(self.split, dim=-1))
        return outputs

    def _apply(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if compiling():
            traced = group_outputs(self, x) if traces_reference(x) else None
            if traced is not None:
                return traced
            return tuple(_op(x, **self.op_arguments(x.dtype), group=self.group)[:-1])
        return self._apply_function(x, self, *self._adapters)

    def forward_math(
        self, x2d: torch.Tensor, adapters: Sequence[torch.Tensor], casts: dict[str, Any] | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """:func:`lora_math.forward <fastft.kernels.lora_math.forward>` over this group's fixed tensors, for an
        eager node: ``(outputs, xa)`` of ``x2d [M, K]``; ``adapters`` are its A's then its B's."""
        count = self._lora_count
        return lora_math.forward(
            self._spec, x2d, self._weights, self._quant_states, adapters[:count], adapters[count:], self._biases, casts
        )

    def backward_math(
        self,
        x2d: torch.Tensor,
        xa: torch.Tensor | None,
        adapters: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        needs: Sequence[bool],
        first: int,
        casts: dict[str, Any] | None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """:func:`lora_backward.backward_input <fastft.kernels.lora_backward.backward_input>` and its ``finish``,
        ``(dX, [dA], [dB])``, for the node that ran :meth:`forward_math`: ``needs`` is its ``ctx.needs_input_grad``
        (x first) and ``first`` the position of the first A among its inputs."""
        count = self._lora_count
        needs_lora = [needs[first + j] or needs[first + count + j] for j in range(count)]
        grad_x, pending = lora_backward.backward_input(
            self._spec,
            x2d,
            xa,
            self._weights,
            self._quant_states,
            adapters[:count],
            adapters[count:],
            grads,
            needs[0],
            needs_lora,
            casts,
        )
        return (grad_x, *pending.finish(x2d))

    def op_arguments(self, dtype: torch.dtype) -> dict[str, Any]:
        """The group's tensors and layout as the custom op's keyword arguments (see the module docstring)."""
        return lora_op_args.flatten_group(self.projections, dtype)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{name} [{out}, {k}]" + (f" r={p.lora_a.shape[0]}" if p.lora_a is not None else "")
            for name, (out, k), p in zip(self.names, self.shapes, self.projections, strict=True)
        )
        return f"LoRAGroup({self.function}, {self.group}: {parts})"


# The custom ops -----------------------------------------------------------------------------------------------------


def _lora_group(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    group: str,
) -> list[torch.Tensor]:
    spec = lora_op_args.op_spec(group, layout, scales)
    x2d = x.reshape(-1, x.shape[-1])
    outputs, xa = lora_math.forward(
        spec,
        x2d,
        weights,
        lora_op_args.quant_states_from(layout, nf4),
        lora_a,
        lora_b,
        lora_op_args.biases_from(layout, biases),
    )
    lead = x.shape[:-1]
    xa = x2d.new_empty((x2d.shape[0], 0)) if xa is None else xa
    return [out.view(*lead, out.shape[1]) for out in outputs] + [xa]


def _lora_group_fake(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    biases: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    group: str,
) -> list[torch.Tensor]:
    lead = x.shape[:-1]
    parts = lora_op_args.segments(layout)
    rows = math.prod(lead)
    rank = sum(max(part[2], 0) for part in parts)
    return [x.new_empty((*lead, part[0])) for part in parts] + [x.new_empty((rows, rank))]


def _lora_group_backward(
    grads: list[torch.Tensor | None],
    x: torch.Tensor,
    xa: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    group: str,
    needs: list[bool],
) -> list[torch.Tensor]:
    spec = lora_op_args.op_spec(group, layout, scales)
    x2d = x.reshape(-1, x.shape[-1])
    grad_x, pending = lora_backward.backward_input(
        spec,
        x2d,
        xa,
        weights,
        lora_op_args.quant_states_from(layout, nf4),
        lora_a,
        lora_b,
        grads,
        needs[0],
        needs[1:],
    )
    grad_a, grad_b = pending.finish(x2d)
    return lora_op_args.gradient_list(x, grad_x, grad_a, grad_b)


def _lora_group_backward_fake(
    grads: list[torch.Tensor | None],
    x: torch.Tensor,
    xa: torch.Tensor,
    weights: list[torch.Tensor],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    nf4: list[torch.Tensor],
    layout: list[int],
    scales: list[float],
    group: str,
    needs: list[bool],
) -> list[torch.Tensor]:
    return lora_op_args.fake_gradient_list(x, lora_a, lora_b, needs)


_op = define("lora_group", _lora_group, fake=_lora_group_fake)
_backward_op = define("lora_group_backward", _lora_group_backward, fake=_lora_group_backward_fake)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, weights, lora_a, lora_b, biases, nf4, layout, scales, group = inputs
    ctx.counts = (len(weights), len(lora_a), len(biases), len(nf4))
    ctx.static = (list(layout), list(scales), group)
    ctx.mark_non_differentiable(output[-1])
    ctx.save_for_backward(x, output[-1], *weights, *lora_a, *lora_b, *nf4)


def _grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    layout, scales, group = ctx.static
    x, xa, *rest = ctx.saved_tensors
    weights, lora_a, lora_b, nf4 = lora_op_args.saved_lists(rest, ctx.counts)
    needs = lora_op_args.needs_of(ctx)
    # Only a compiled graph (or a direct call of the op) reaches this backward: the eager path is the Function's.
    # So it always calls the backward op, never its implementation, which reads real tensors (the tuner, the
    # shared NF4 buffer) that a tracer's fake ones must not meet.
    result = _backward_op(
        list(grads[:-1]), x, xa, list(weights), list(lora_a), list(lora_b), list(nf4), layout, scales, group, needs
    )
    return lora_op_args.input_gradients(result, needs, ctx.counts, trailing=3)


register_autograd(_op, _setup, _grad)


def lora_group_op() -> Any:
    """The forward custom op ``fastft::lora_group`` (for ``torch.library.opcheck`` and inspection)."""
    return _op


def lora_group_backward_op() -> Any:
    """The backward custom op ``fastft::lora_group_backward``."""
    return _backward_op


__all__ = ["FUNCTIONS", "GROUPS", "LoRAGroup", "LoRAGroupFunction", "lora_group_backward_op", "lora_group_op"]
