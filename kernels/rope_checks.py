"""RoPE's shape contract: what q, k, cos, sin and position_ids must be (:mod:`fastft.kernels.rope`'s layouts), checked
once per signature, with an error that names the call, both shapes and the fix; only the position ids' values are
read on every call."""

from __future__ import annotations

from typing import Any

import torch

from fastft.kernels.custom_ops import compiling
from fastft.kernels.errors import ShapeContractError

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _error(where: str, expected: str, actual: str, fix: str) -> ShapeContractError:
    return ShapeContractError(f"fastft.kernels.rope.{where}: expected {expected}, got {actual}; {fix}")


def _check(
    where: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> None:
    """Raise ShapeContractError (naming ``where``) unless the shapes, dtypes and devices fit the contract in the
    module docstring (what position_ids hold is :func:`_check_positions`' part)."""

    def _fail(expected: str, actual: str, fix: str) -> ShapeContractError:
        return _error(where, expected, actual, fix)

    if q.dim() != 4 or k.dim() != 4:
        raise _fail(
            "q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim]",
            f"q {tuple(q.shape)} and k {tuple(k.shape)}",
            "pass the 4-d tensors after .view(batch, seq, heads, head_dim).transpose(1, 2)",
        )
    batch, _, seq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq:
        raise _fail(
            f"k with q's batch and seq ({batch}, *, {seq}, *)",
            f"q {tuple(q.shape)} and k {tuple(k.shape)}",
            "rotate queries and keys of the same tokens together",
        )
    if k.shape[3] != head_dim:
        raise _fail(
            f"k head_dim {head_dim} (q's)",
            f"q {tuple(q.shape)} and k {tuple(k.shape)}",
            "q and k must share head_dim; check head_dim against hidden_size // num_attention_heads in the config",
        )
    if head_dim % 2:
        raise _fail(
            "an even head_dim (rotate-half pairs element i with i + head_dim // 2)",
            f"head_dim {head_dim} in q {tuple(q.shape)}",
            "use an even head_dim",
        )
    if q.dtype != k.dtype or not q.is_floating_point():
        raise _fail(
            "q and k of one floating dtype",
            f"q {q.dtype} and k {k.dtype}",
            "cast both to the attention dtype first",
        )
    if cos.shape != sin.shape:
        raise _fail("cos and sin of one shape", f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)}", "pass a pair")
    if cos.shape[-1] != head_dim:
        raise _fail(
            f"cos / sin with head_dim {head_dim} in the last dimension (q's)",
            f"cos {tuple(cos.shape)} for q {tuple(q.shape)}",
            "build the rotary embedding from the same config (head_dim) as the attention",
        )
    devices = {t.device for t in (q, k, cos, sin) + (() if position_ids is None else (position_ids,))}
    if len(devices) != 1:
        raise _fail("every tensor on one device", f"devices {sorted(map(str, devices))}", "move them together")
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
            raise _fail(
                f"gathered cos / sin [{batch} or 1, {seq}, {head_dim}] (no position_ids given)",
                f"cos {tuple(cos.shape)} for q {tuple(q.shape)}",
                "pass what the rotary embedding returned for these positions, or pass the tables "
                "[max_positions, head_dim] together with position_ids [batch, seq]",
            )
        return
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq:
        raise _fail(
            f"position_ids [{batch} or 1, {seq}]",
            f"position_ids {tuple(position_ids.shape)} for q {tuple(q.shape)}",
            "pass one position per token",
        )
    if position_ids.dtype not in _INTEGER_DTYPES:
        raise _fail("integer position_ids", f"position_ids of dtype {position_ids.dtype}", "pass a long tensor")
    if cos.dim() != 2:
        raise _fail(
            f"cos / sin tables [max_positions, {head_dim}] (position_ids given)",
            f"cos {tuple(cos.shape)}",
            "pass the whole tables with position_ids, or gathered cos / sin [batch, seq, head_dim] without them",
        )


def _check_positions(where: str, cos: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    """Raise ShapeContractError unless every position_id is a row of the tables (data-dependent: one host sync)."""
    if position_ids is None or not position_ids.numel() or position_ids.is_meta:
        return
    # The kernel reads table row position_ids[b, s] with no bounds check of its own: an index past the table is
    # an out-of-bounds read (silently wrong rotations, or an illegal-address fault that kills the CUDA
    # context), where a torch gather would have raised. One min/max over batch * seq ints and a single
    # host sync is cheap next to attention; gathered cos / sin (the default path) carry no indices, so skip this.
    low, high = torch.stack(torch.aminmax(position_ids)).tolist()
    if low < 0 or high >= cos.shape[0]:
        raise _error(
            where,
            f"position_ids in [0, {cos.shape[0]}) (rows of the cos / sin tables)",
            f"position_ids from {low} to {high}",
            "build longer tables (max_position_embeddings) or truncate the sequences",
        )


# Signatures (shapes, dtypes, devices) that passed _check. Bounded: a run whose sequence length changes every step
# would otherwise grow it without end.
_CHECKED: set[tuple[Any, ...]] = set()
_MAX_CHECKED = 256


def _checked(
    where: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> None:
    """:func:`_check` once per signature, then :func:`_check_positions` (which reads data) on every call."""
    if compiling():
        # Traced once per graph, and symbolic sizes cannot key a set.
        _check(where, q, k, cos, sin, position_ids)
        return
    key = (q.shape, k.shape, cos.shape, sin.shape, q.dtype, k.dtype, q.device, k.device, cos.device, sin.device)
    if position_ids is not None:
        key += (position_ids.shape, position_ids.dtype, position_ids.device)
    if key not in _CHECKED:
        _check(where, q, k, cos, sin, position_ids)
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED.add(key)
    _check_positions(where, cos, position_ids)
