"""The backward math of a fused LoRA group (forward: :mod:`fastft.kernels.lora_math`), shared by the eager autograd
Functions and the custom ops.

For every segment ``i`` with frozen base ``W_i``, LoRA ``A_i``, ``B_i`` and scale ``s_i``, from ``dY_i``::

    dX  = Σ_i dY_i W_i + s_i (dY_i B_i) A_i
    dA_i = s_i (dY_i B_i)ᵀ X
    dB_i = s_i dY_iᵀ (X A_iᵀ)

Every ``dX`` contribution is gathered in one buffer with ``addmm_``; ``dA`` and ``dB`` are one ``addmm`` each with the
scale as its ``alpha`` (``beta=0`` over a cached zero scalar: no separate scaling pass). The order of the ``dX`` sum
follows the forward's GEMM (:mod:`fastft.kernels.gemm_tuner`): the base GEMMs first and the rank-r terms added onto
their sum, or, where the forward ran ``cublas-accumulate``, the rank-r terms first (written, not read back) and the
base GEMMs accumulated onto them.

Where a group's two or more adapters share one scale (q, k, v; gate, up: how peft makes them), their ``dY_i B_i`` are
written side by side into one ``[M, Σ r]`` buffer, so the low-rank part of ``dX`` is one GEMM against the stacked A's
(which the forward kept), of width Σ r instead of r, which the small-rank shapes use better. Where the dA's are cast
afterwards (peft's fp32 adapters over a 16-bit base) every ``dA`` is one GEMM too, its row blocks cast into tensors of
their own: for q, k, v four launches fewer a layer, for gate, up two. Otherwise each ``dA`` stays its own GEMM (over
its columns of the buffer), so that no two gradients share a storage and no two outputs of a custom op alias. A group
whose adapters have different scales, or where some adapter needs no gradient, takes one GEMM per adapter throughout.

LoRA gradients come back in their parameters' dtype: computed in x's dtype, the ones for peft's fp32 adapters over a
16-bit base are cast together by one ``_foreach_copy_`` (one launch on CUDA), by this group or, given
``casts["grads"]``, by the node that runs it for all its groups at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels.lora_math import Spec, dense_bases, segment_shapes, unread_zero

# The one entry of a group whose LoRA gradients are computed grouped (see the module docstring).
_GROUPED = object()


class PendingLoRAGrads:
    """The LoRA gradients of one group's backward that still need the group's input ``X``: ``dA_j = s (dY B)^T X``.

    :func:`backward_input` computes everything that does not need ``X`` (``dX`` and each ``dY B``), so a caller
    whose ``X`` is cheaper to rebuild after ``dX`` is known (the MLP's ``h``, rewritten by the gate's backward
    kernel) can hand it in later; :attr:`needs_x` says whether it is wanted at all.
    """

    __slots__ = ("_entries", "_lora_a", "_lora_b", "_rows", "deferred", "needs_x")

    def __init__(
        self,
        spec: Spec,
        lora_a: Sequence[torch.Tensor],
        lora_b: Sequence[torch.Tensor],
        deferred: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        # Per LoRA segment, in the order backward returns them: (j,) (no gradient wanted), (j, None) (zeros) or
        # (j, dyb, grad, xa_i, scale); or one (_GROUPED, dyb, [grad_j], [xa_j], scale, [dyb_j]) for all of them.
        self._entries: list[tuple[Any, ...]] = []
        self._lora_a, self._lora_b, self._rows = lora_a, lora_b, spec.lora_rows
        # (sources, targets) of the gradient casts a caller does itself, for several groups at once (the casts'
        # "grads"); None: finish does this group's.
        self.deferred = deferred
        self.needs_x = False

    def finish(self, x2d: torch.Tensor | None) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """``([dA_j], [dB_j])`` given the group's input ``x2d`` [M, K] (None only when :attr:`needs_x` is False)."""
        grad_a: list[torch.Tensor | None] = []
        grad_b: list[torch.Tensor | None] = []
        zero = None if x2d is None else unread_zero(x2d)
        # Gradients computed in x's dtype for parameters of another (peft's fp32 adapters): cast together at the end.
        sources, targets = ([], []) if self.deferred is None else self.deferred

        def keep(into: list[torch.Tensor | None], found: torch.Tensor, parameter: torch.Tensor) -> None:
            if found.dtype != parameter.dtype:
                sources.append(found)
                found = torch.empty_like(found, dtype=parameter.dtype)
                targets.append(found)
            into.append(found)

        for entry in self._entries:
            if entry[0] is _GROUPED:
                _, dyb, grads, xas, scale, dyb_parts = entry
                if all(a.dtype != dyb.dtype for a in self._lora_a):
                    # Every dA at once ([Σ r, K]); its row blocks are each cast into a tensor of its own.
                    stacked = torch.addmm(zero, dyb.t(), x2d, beta=0, alpha=scale)
                    for a, da in zip(self._lora_a, torch.split_with_sizes(stacked, self._rows), strict=True):
                        keep(grad_a, da, a)
                else:
                    # Kept as they are computed: one GEMM each, so that no two gradients share a storage (nor two
                    # outputs of a custom op alias).
                    for a, dyb_j in zip(self._lora_a, dyb_parts, strict=True):
                        keep(grad_a, torch.addmm(zero, dyb_j.t(), x2d, beta=0, alpha=scale), a)
                for b, grad, xa_j in zip(self._lora_b, grads, xas, strict=True):
                    keep(grad_b, torch.addmm(zero, grad.t(), xa_j, beta=0, alpha=scale), b)
                continue
            a, b = self._lora_a[entry[0]], self._lora_b[entry[0]]
            if len(entry) == 1:
                grad_a.append(None)
                grad_b.append(None)
            elif len(entry) == 2:
                grad_a.append(torch.zeros_like(a))
                grad_b.append(torch.zeros_like(b))
            else:
                _, dyb, grad, xa_i, scale = entry
                keep(grad_a, torch.addmm(zero, dyb.t(), x2d, beta=0, alpha=scale), a)
                keep(grad_b, torch.addmm(zero, grad.t(), xa_i, beta=0, alpha=scale), b)
        if sources and self.deferred is None:
            torch._foreach_copy_(targets, sources)
        self._entries = []
        return grad_a, grad_b


def backward_input(
    spec: Spec,
    x_like: torch.Tensor,
    xa: torch.Tensor | None,
    weights: Sequence[torch.Tensor],
    quant_states: Sequence[Any],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    needs_x: bool,
    needs_lora: Sequence[bool],
    casts: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, PendingLoRAGrads]:
    """Backward of one group up to what needs ``X``: ``(dX [M, K] or None, the pending LoRA gradients)``;
    ``pending.finish(X)`` then gives ``([dA_j], [dB_j])`` over the LoRA segments, each in its parameter's dtype (None
    where ``needs_lora[j]`` is False). ``casts``: what this node's forward cast.

    ``grads`` holds per segment ``dY_i`` (``[..., out_i]``) or None for an output that got no gradient; a LoRA
    segment without one gets zero gradients. ``x_like`` stands for ``X`` where only its shape, dtype and device are
    read (``X`` itself, or a tensor of its shape): a caller whose ``X`` is cheaper to rebuild after ``dX`` is known
    hands it to ``finish`` later.
    """
    dtype = x_like.dtype
    flat = []
    for g in grads:
        if g is not None:
            if g.dim() != 2:
                g = g.reshape(-1, g.shape[-1])
            if g.dtype != dtype:
                g = g.to(dtype)
        flat.append(g)
    grad_x = None
    # The forward's order (module docstring); without LoRA there is only the base sum.
    accumulate = needs_x and bool(spec.lora) and casts is not None and casts.get("accumulate", False)
    if needs_x:
        live = [i for i, g in enumerate(flat) if g is not None]
        if spec.any_packed:
            states = [quant_states[i] for i in live]
            dense = dense_bases([weights[i] for i in live], states, segment_shapes(spec, live), dtype)
        else:
            dense = [weights[i] if weights[i].dtype == dtype else weights[i].to(dtype) for i in live]
        if not accumulate:
            grad_x = _base_terms(None, flat, live, dense, x_like)
    pending = PendingLoRAGrads(spec, lora_a, lora_b, None if casts is None else casts.get("grads"))
    if not spec.lora:
        return grad_x, pending

    cast_a = None if casts is None else casts.get("a")
    cast_b = None if casts is None else casts.get("b")
    if cast_a is not None and cast_a.dtype != dtype:
        cast_a = cast_b = None
    if spec.grouped_scale is not None and all(needs_lora) and all(flat[i] is not None for i in spec.lora):
        grad_x = _grouped(spec, pending, flat, xa, lora_a, lora_b, cast_a, cast_b, grad_x, needs_x, dtype)
        return (_base_terms(grad_x, flat, live, dense, x_like) if accumulate else grad_x), pending
    entries = pending._entries
    for i, j, columns, scale in spec.segments:
        if j < 0:
            continue
        a, b, grad, wants = lora_a[j], lora_b[j], flat[i], needs_lora[j]
        if grad is None or not (wants or needs_x):
            entries.append((j, None) if wants else (j,))
            continue
        xa_i = xa if columns is None else xa[:, columns]
        b_in_dtype = b if cast_b is None else cast_b[j]
        # dY B: the factor that dA and the low-rank part of dX share.
        dyb = torch.mm(grad, b_in_dtype if b_in_dtype.dtype == dtype else b_in_dtype.to(dtype))
        if wants:
            entries.append((j, dyb, grad, xa_i, scale))
            pending.needs_x = True
        else:
            entries.append((j,))
        if needs_x:
            if cast_a is not None:
                a = cast_a if columns is None else cast_a[columns]
            grad_x = low_rank_term(grad_x, dyb, a if a.dtype == dtype else a.to(dtype), scale)
    return (_base_terms(grad_x, flat, live, dense, x_like) if accumulate else grad_x), pending


def _base_terms(
    grad_x: torch.Tensor | None,
    flat: Sequence[torch.Tensor | None],
    live: Sequence[int],
    dense: Sequence[torch.Tensor],
    x_like: torch.Tensor,
) -> torch.Tensor:
    # Σ dY_i W_i added onto grad_x (written by the first GEMM where there is none yet); zeros where nothing came.
    for i, weight in zip(live, dense, strict=True):
        grad_x = torch.mm(flat[i], weight) if grad_x is None else grad_x.addmm_(flat[i], weight)
    if grad_x is None:
        grad_x = torch.zeros(x_like.shape, dtype=x_like.dtype, device=x_like.device)
    return grad_x


def low_rank_term(grad_x: torch.Tensor | None, dyb: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    """``s (dY B) A`` added onto ``grad_x``, or written as its first term (``beta = 0`` over the cached zero: nothing
    read)."""
    if grad_x is None:
        return torch.addmm(unread_zero(dyb), dyb, a, beta=0, alpha=scale)
    return grad_x.addmm_(dyb, a, alpha=scale)


def _grouped(
    spec: Spec,
    pending: PendingLoRAGrads,
    flat: Sequence[torch.Tensor | None],
    xa: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    cast_a: torch.Tensor | None,
    cast_b: Sequence[torch.Tensor] | None,
    grad_x: torch.Tensor | None,
    needs_x: bool,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    # Every adapter's dY_j B_j into its columns of one [M, Σ r] buffer (the same columns as X Aᵀ's), then the
    # low-rank part of dX as one GEMM against the stacked A's (added onto grad_x, or its first term); dA waits for X
    # in one entry. Returns grad_x.
    scale = spec.grouped_scale
    first = flat[spec.lora[0]]
    dyb = torch.empty((first.shape[0], xa.shape[1]), dtype=dtype, device=first.device)
    grads = [flat[i] for i in spec.lora]
    # split_with_sizes, not Tensor.split: the same views without Tensor.split's Python wrapper.
    dyb_parts = torch.split_with_sizes(dyb, spec.lora_rows, dim=1)
    for grad, b, out in zip(grads, lora_b if cast_b is None else cast_b, dyb_parts, strict=True):
        torch.mm(grad, b if b.dtype == dtype else b.to(dtype), out=out)
    xas = torch.split_with_sizes(xa, spec.lora_rows, dim=1)
    if needs_x:
        stacked = torch.cat(list(lora_a)) if cast_a is None else cast_a
        grad_x = low_rank_term(grad_x, dyb, stacked if stacked.dtype == dtype else stacked.to(dtype), scale)
    pending._entries.append((_GROUPED, dyb, grads, xas, scale, dyb_parts))
    pending.needs_x = True
    return grad_x


__all__ = ["PendingLoRAGrads", "backward_input", "low_rank_term"]
