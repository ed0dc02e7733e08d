"""The math of a fused LoRA group, shared by the eager autograd Functions and the custom ops.

For every segment ``i`` of a group (q, k, v; gate, up; o; down) with frozen base ``W_i``, optional frozen bias
``b_i``, LoRA ``A_i``, ``B_i`` and scale ``s_i``:

    Y_i = X W_iᵀ + b_i + s_i (X A_iᵀ) B_iᵀ
    dX  = Σ_i dY_i W_i + s_i (dY_i B_i) A_i
    dA_i = s_i (dY_i B_i)ᵀ X
    dB_i = s_i dY_iᵀ (X A_iᵀ)

Forward runs one small GEMM for every segment's ``X Aᵀ`` at once (the A's stacked; where they and the B's need a
cast, one ``_foreach_copy_`` stacks and casts them all: :func:`cast_adapters`), then the base
GEMM with the LoRA term: torch's matmul (cuBLAS; the bias through ``addmm``, the low-rank term added in place with
``addmm_(alpha=s)``, or in the other order the low-rank term first and the base GEMM accumulated onto it) or the fused
Triton kernel of :mod:`fastft.kernels.lora_gemm`, whichever
:func:`fastft.kernels.gemm_tuner.choose` picked. The pick is memoised in the group's :class:`Spec` under
:func:`fastft.kernels.gemm_tuner.plan_key`, so the tuner (which builds a bucket, reads the environment and records the
choice for ``patch_report``) runs only when that key is new. Only ``X`` and the small ``X Aᵀ`` are kept for backward,
never ``Y``; the backward math is :mod:`fastft.kernels.lora_backward`.

The functions take tensors as lists, so the same code serves the eager Function (tensors held by the
:class:`~fastft.kernels.lora_group.LoRAGroup`) and the custom ops (tensors as op arguments, each NF4 quant_state
flattened by :func:`flatten_group` and rebuilt by :func:`quant_states_from`):

- ``weights``: per segment, the dense base ``[out, in]`` or the packed NF4 bytes;
- ``quant_states``: per segment, the NF4 quant_state, or None for a dense base;
- ``lora_a`` / ``lora_b``: the A's and B's of the segments that carry LoRA (``spec.lora``), in segment order;
- ``biases``: per segment (None where absent), or None for a group without any.

Nothing here calls ``detach``: inside an autograd Function (or below a custom op's autograd) grad mode is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastft.kernels import gemm_tuner, targets
from fastft.kernels.compiled import usage
from fastft.kernels.gemm_tuner import Candidate
from fastft.kernels.lora_gemm import last_kernel, lora_gemm_triton
from fastft.kernels.lora_gemm_nf4 import lora_gemm_nf4_triton
from fastft.kernels.lora_projection import LoRAWeights, is_packed, shared_buffer, weight_shape
from fastft.kernels.nf4 import dequantize_nf4

# Per segment in a custom op's ``layout`` argument: out, in, rank (-1: no LoRA), has_bias, blocksize (0: dense),
# blocksize2 (0: not double-quantised).
LAYOUT_FIELDS = 6

# Bound once: linear(x, W[, b]) is mm(x, Wᵀ) (addmm with a bias) for 2-D x, with the transpose done in C++.
_linear = torch.nn.functional.linear
# The candidates that run torch's matmul (cuBLAS on CUDA), in their two orders (gemm_tuner's module docstring).
_ACCUMULATE = gemm_tuner.CUBLAS_ACCUMULATE.path
_CUBLAS_PATHS = (gemm_tuner.CUBLAS.path, _ACCUMULATE)


class Spec:
    """What a group's math needs besides tensors, fixed for the group: the tuner's group name, each segment's width,
    in_features, rank, scale and kind (dense or NF4), and the memo of GEMM choices.

    Attributes:
        group: The tuner's group (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``).
        widths: Each segment's out_features.
        in_features: Each segment's in_features.
        ranks: Each segment's LoRA rank (0 without LoRA).
        scales: Each segment's LoRA scale.
        lora: Indices of the segments with LoRA (their A's and B's are the ``lora_a`` / ``lora_b`` lists).
        packed: Whether each segment's base is NF4.
        plans: ``gemm_tuner.plan_key(x) -> Candidate``, filled by :func:`forward`.
        lora_rows: The LoRA segments' ranks (the row blocks of the stacked A's).
        grouped_scale: The one scale of a group's two or more adapters, or None (one adapter, or several scales).
    """

    __slots__ = (
        "all_packed",
        "any_packed",
        "group",
        "grouped_scale",
        "in_features",
        "lora",
        "lora_rows",
        "packed",
        "plans",
        "ranks",
        "scales",
        "segments",
        "widths",
    )

    def __init__(
        self,
        group: str,
        widths: Sequence[int],
        in_features: Sequence[int],
        ranks: Sequence[int | None],
        scales: Sequence[float],
        packed: Sequence[bool],
    ) -> None:
        self.group = group
        self.widths = tuple(int(w) for w in widths)
        self.in_features = tuple(int(k) for k in in_features)
        self.lora = tuple(i for i, rank in enumerate(ranks) if rank is not None)
        self.ranks = tuple(0 if rank is None else int(rank) for rank in ranks)
        self.scales = tuple(float(s) for s in scales)
        self.packed = tuple(bool(p) for p in packed)
        self.any_packed = any(self.packed)
        self.all_packed = all(self.packed)
        self.plans: dict[tuple, Candidate] = {}
        self.lora_rows = tuple(self.ranks[i] for i in self.lora)
        # Two or more adapters with one scale (q, k, v or gate, up as peft makes them): backward can then treat
        # their stacked dY B like one adapter of rank Σ r (lora_backward), one GEMM where it took one per adapter.
        scales = {self.scales[i] for i in self.lora}
        self.grouped_scale = scales.pop() if len(self.lora) > 1 and len(scales) == 1 else None
        # Per segment (index, its adapter's position or -1, its columns of X Aᵀ, scale): the loops' fixed part.
        starts, start = {}, 0
        for i in self.lora:
            starts[i] = start
            start += self.ranks[i]
        single = len(self.lora) == 1
        self.segments = tuple(
            (
                i,
                self.lora.index(i) if i in starts else -1,
                None if single or i not in starts else slice(starts[i], starts[i] + self.ranks[i]),
                self.scales[i],
            )
            for i in range(len(self.widths))
        )


def spec_of(group: str, projections: Sequence[LoRAWeights]) -> Spec:
    """The :class:`Spec` of already-checked projections."""
    shapes = [weight_shape(p) for p in projections]
    return Spec(
        group,
        [out for out, _ in shapes],
        [k for _, k in shapes],
        [None if p.lora_a is None else p.lora_a.shape[0] for p in projections],
        [float(p.scale) for p in projections],
        [is_packed(p) for p in projections],
    )


_zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def unread_zero(like: torch.Tensor) -> torch.Tensor:
    """The ``input`` of a ``beta=0`` addmm: never read, broadcast to any shape; one per device and dtype."""
    return zero_of(like.device, like.dtype)


def zero_of(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unread_zero` for a device and dtype (for a caller that holds no tensor of them yet)."""
    key = (device, dtype)
    zero = _zeros.get(key)
    if zero is None:
        zero = _zeros[key] = torch.zeros((), device=device, dtype=dtype)
    return zero


def biases_in(biases: Sequence[torch.Tensor | None] | None, dtype: torch.dtype) -> list[torch.Tensor | None] | None:
    """A group's biases in its input's dtype (a bias of another dtype cast, as autocast would), None for none."""
    if biases is None:
        return None
    return [b if b is None or b.dtype == dtype else b.to(dtype) for b in biases]


def dense_bases(
    weights: Sequence[torch.Tensor],
    quant_states: Sequence[Any],
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Every segment's base weight as a dense ``[out, in]`` in ``dtype``: a dense weight of that dtype as it is, one of
    another dtype cast (what autocast would do), NF4 ones dequantised into the shared buffer, side by side."""
    packed_numel = sum(o * k for state, (o, k) in zip(quant_states, shapes, strict=True) if state is not None)
    if not packed_numel:
        return [w if w.dtype == dtype else w.to(dtype) for w in weights]
    buffer = shared_buffer(packed_numel, weights[0].device, dtype)
    dense, start = [], 0
    for weight, state, (out_features, in_features) in zip(weights, quant_states, shapes, strict=True):
        if state is None:
            dense.append(weight if weight.dtype == dtype else weight.to(dtype))
            continue
        size = out_features * in_features
        target = buffer[start : start + size].view(out_features, in_features)
        start += size
        dense.append(dequantize_nf4(weight, state, dtype=dtype, out=target))
    return dense


def segment_shapes(spec: Spec, segments: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``(out, in)`` of every segment of the group, or of ``segments``."""
    indices = range(len(spec.widths)) if segments is None else segments
    return [(spec.widths[i], spec.in_features[i]) for i in indices]


def run(
    candidate: Candidate,
    spec: Spec,
    x2d: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quant_states: Sequence[Any],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
) -> list[torch.Tensor]:
    """The group's outputs through one GEMM candidate; ``lora_b`` the LoRA segments' B's, every tensor already in x's
    dtype."""
    if candidate.path in _CUBLAS_PATHS:
        if spec.any_packed:
            weights = dense_bases(weights, quant_states, segment_shapes(spec), x2d.dtype)
        return _dense(spec, x2d, weights, xa, lora_b, biases, candidate.path == _ACCUMULATE)
    # The Triton kernels take a B per segment (None without LoRA), contiguous B's and biases; contiguous() is free on
    # those that already are.
    lora_b = [None if b is None else b.contiguous() for b in _per_segment(spec, lora_b)]
    biases = None if biases is None else [None if b is None else b.contiguous() for b in biases]
    if candidate.path == "triton-nf4":
        return lora_gemm_nf4_triton(x2d, weights, quant_states, xa, lora_b, spec.scales, candidate.config, biases)
    dense = [w.contiguous() for w in dense_bases(weights, quant_states, segment_shapes(spec), x2d.dtype)]
    return lora_gemm_triton(x2d, dense, xa, lora_b, spec.scales, candidate.config, biases)


def _check(candidate: Candidate, x2d: torch.Tensor) -> list[str]:
    if candidate.path in _CUBLAS_PATHS:
        return []
    capability = targets.capability(x2d.device)
    return usage(last_kernel(), capability, has_dot=True, sixteen_bit=x2d.dtype != torch.float32).problems


def plan(
    spec: Spec,
    x2d: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quant_states: Sequence[Any],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
) -> Candidate:
    """The GEMM candidate for this call (``lora_b``: the LoRA segments' B's): memoised in ``spec.plans``;
    :func:`gemm_tuner.choose` (which may time the candidates on these very tensors, and records the choice) runs only
    for a new :func:`gemm_tuner.plan_key`.

    A memoised choice is not recorded again when a setting returns to an earlier value; after
    :func:`gemm_tuner.reset` (a new generation in the key) every group chooses and records afresh."""
    key = gemm_tuner.plan_key(x2d)
    candidate = spec.plans.get(key)
    if candidate is None:

        def run_one(option: Candidate) -> list[torch.Tensor]:
            return run(option, spec, x2d, weights, quant_states, xa, lora_b, biases)

        def check(option: Candidate) -> list[str]:
            return _check(option, x2d)

        choice = gemm_tuner.choose(spec.group, x2d, spec.widths, spec.ranks, spec.all_packed, run_one, check)
        candidate = spec.plans[key] = choice.candidate
    return candidate


def forward(
    spec: Spec,
    x2d: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quant_states: Sequence[Any],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
    casts: dict[str, Any] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Forward of one group on ``x2d [M, K]``: ``(outputs, xa)``, one new contiguous ``[M, out_i]`` per segment and
    ``xa = X [A_0; A_1; …]ᵀ`` (None without LoRA), everything in x's dtype (adapters and biases cast to it).

    ``casts``: where an eager node keeps the adapters it cast (peft keeps A and B in fp32 over a bf16 base) for its
    own backward, which then casts nothing: one cast per adapter per step instead of one in forward and one again in
    backward. Only between the two halves of one node: across steps an optimizer may write the weights without
    telling autograd (bitsandbytes' 8-bit optimizers do), so no cast outlives its node. Casts already there (a
    node holding several groups cast them all at once: :func:`cast_groups`) are used as they are; ``casts["grads"]``
    (``(sources, targets)`` lists), where present, takes the LoRA gradients' casts for that node to do at once.
    ``casts["accumulate"]`` is set to whether the GEMM ran in the accumulate order, for the same node's backward."""
    dtype = x2d.dtype
    xa, lora_b = forward_xa(spec, x2d, lora_a, lora_b, casts)
    biases = biases_in(biases, dtype)
    candidate = plan(spec, x2d, weights, quant_states, xa, lora_b, biases)
    if casts is not None:
        # The node's backward sums its dX the same way round (lora_backward.backward_input): the order this device
        # measured faster for the forward's output holds for dX, the same kind of sum.
        casts["accumulate"] = candidate.path == _ACCUMULATE
    return run(candidate, spec, x2d, weights, quant_states, xa, lora_b, biases), xa


def forward_xa(
    spec: Spec,
    x2d: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    casts: dict[str, Any] | None = None,
) -> tuple[torch.Tensor | None, Sequence[torch.Tensor]]:
    """The first half of :func:`forward`: ``(xa, the B's in x's dtype)``, ``xa = X [A_0; A_1; …]ᵀ`` (``(None,
    lora_b)`` without LoRA), with ``casts`` filled as :func:`forward` fills them. Alone, it is what a group's
    backward reads besides its input, without the output GEMM: for a recompute whose outputs nothing reads (the last
    group of a checkpointed decoder layer)."""
    if not spec.lora:
        return None, lora_b
    dtype = x2d.dtype
    done = None if casts is None else casts.get("a")
    if done is not None and done.dtype == dtype:
        # Cast ahead by the node that holds this group (cast_groups: one copy for all its groups).
        stacked, lora_b = done, casts["b"]
    else:
        if any(a.dtype != dtype for a in lora_a) or any(b.dtype != dtype for b in lora_b):
            stacked, lora_b = cast_adapters(lora_a, lora_b, dtype)
        else:
            stacked = lora_a[0] if len(lora_a) == 1 else torch.cat(lora_a)
        if casts is not None:
            # For this node's backward (its grouped dX reads the same stack, cast or not).
            casts["a"], casts["b"] = stacked, lora_b
    return _linear(x2d, stacked), lora_b


def cast_adapters(
    lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``([A_0; A_1; …], [B_j])`` in ``dtype``: the A's stacked row-wise into one new tensor, each B of another dtype
    copied into a new one (a B already in ``dtype`` is used as it is).

    One ``_foreach_copy_`` does every cast of the group: on CUDA a single multi-tensor launch (casting as it copies)
    where peft's fp32 adapters meet a bf16 / fp16 base, instead of a cat, a cast of the stack and one cast per B
    (five launches for q, k, v), every step."""
    sources: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    cast = _cast_targets(lora_a, lora_b, dtype, sources, targets)
    torch._foreach_copy_(targets, sources)
    return cast


def cast_groups(
    groups: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    dtype: torch.dtype,
    casts: Sequence[dict[str, Any]],
) -> None:
    """:func:`cast_adapters` for several groups (``(lora_a, lora_b)`` each) with one copy for all of them: fills each
    group's ``casts`` (``"a"``, ``"b"``), which :func:`forward` then uses. Nothing where no adapter needs a cast.

    A node that runs several groups (a whole decoder layer) calls it once, so its adapters cost one launch a step."""
    if all(t.dtype == dtype for lora_a, lora_b in groups for t in (*lora_a, *lora_b)):
        return
    sources: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    for (lora_a, lora_b), cast in zip(groups, casts, strict=True):
        if lora_a:
            cast["a"], cast["b"] = _cast_targets(lora_a, lora_b, dtype, sources, targets)
    torch._foreach_copy_(targets, sources)


def _cast_targets(
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    dtype: torch.dtype,
    sources: list[torch.Tensor],
    targets: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    # The new tensors a cast of one group writes (still empty), their sources and targets appended for one copy.
    first = lora_a[0]
    if len(lora_a) == 1:
        stacked = torch.empty(first.shape, dtype=dtype, device=first.device)
        targets.append(stacked)
    else:
        rows = [a.shape[0] for a in lora_a]
        stacked = torch.empty((sum(rows), first.shape[1]), dtype=dtype, device=first.device)
        targets.extend(stacked.split(rows))
    sources.extend(lora_a)
    cast_b = []
    for b in lora_b:
        if b.dtype != dtype:
            target = torch.empty_like(b, dtype=dtype)
            sources.append(b)
            targets.append(target)
            b = target
        cast_b.append(b)
    return stacked, cast_b


def _per_segment(spec: Spec, lora_b: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    # The B's of the LoRA segments as one entry per segment (None where a segment has no adapter).
    return [None if j < 0 else lora_b[j] for _, j, _, _ in spec.segments]


def _dense(
    spec: Spec,
    x2d: torch.Tensor,
    weights: Sequence[torch.Tensor],
    xa: torch.Tensor | None,
    lora_b: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
    accumulate: bool = False,
) -> list[torch.Tensor]:
    # The cuBLAS path (NF4 bases dequantised first), straight-line from the segment table, in either order
    # (gemm_tuner): the base GEMM (the bias through addmm's epilogue), then the low-rank term added in place, which
    # reads and writes the whole output again; or the low-rank term (and the bias) first, into a new output that the
    # base GEMM accumulates onto (beta = 1), reading it once in its epilogue. Without LoRA, one GEMM either way.
    dtype = x2d.dtype
    outputs = []
    # Each adapter's columns of X Aᵀ as one split of views, not a slice per adapter: one dispatch for the group.
    parts = (xa,) if xa is None or len(spec.lora) < 2 else torch.split_with_sizes(xa, spec.lora_rows, dim=1)
    for i, j, _, scale in spec.segments:
        weight = weights[i]
        if weight.dtype != dtype:
            weight = weight.to(dtype)
        bias = None if biases is None else biases[i]
        if j < 0:
            outputs.append(_linear(x2d, weight, bias))
            continue
        outputs.append(segment_output(x2d, weight, parts[j], lora_b[j], scale, accumulate, bias))
    return outputs


def segment_output(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    low_rank: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    accumulate: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One LoRA segment's ``X Wᵀ + b + s (X Aᵀ) Bᵀ`` on torch's matmul, ``low_rank`` being its ``X Aᵀ``: the base
    GEMM (the bias through addmm's epilogue) then the low-rank term added in place, or with ``accumulate`` the
    low-rank term (and the bias) first and the base GEMM accumulated onto it (gemm_tuner's two cuBLAS orders)."""
    if accumulate:
        # beta = 0 over the cached zero scalar: the output is only written, its shape taken from the product.
        start = unread_zero(x2d) if bias is None else bias
        out = torch.addmm(start, low_rank, lora_b.t(), beta=0 if bias is None else 1, alpha=scale)
        return out.addmm_(x2d, weight.t())
    return _linear(x2d, weight, bias).addmm_(low_rank, lora_b.t(), alpha=scale)


__all__ = [
    "biases_in",
    "cast_adapters",
    "cast_groups",
    "LAYOUT_FIELDS",
    "Spec",
    "dense_bases",
    "forward",
    "plan",
    "run",
    "segment_output",
    "segment_shapes",
    "spec_of",
    "unread_zero",
    "zero_of",
]
