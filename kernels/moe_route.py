"""Token routing for the grouped-expert kernels: sort the router's (token, slot) picks by expert once.

A mixture-of-experts layer sends token ``t`` to the experts ``top_k_index[t, :k]``. Flattened, that is ``N = T · k``
rows, row ``i`` being token ``i // k``'s slot ``i % k``. Sorting the rows by expert (stably, so the rows of one expert
keep token order) makes each expert's rows one contiguous range of the sorted order: a grouped GEMM then reads one
weight per range instead of one ``[T, E, ...]`` product. Everything here is index work in torch (``argsort``,
``searchsorted``, scatters), with no Python loop over experts and no host synchronisation apart from the range check
of the indices (:func:`route`).

Grouped kernels tile the sorted rows in blocks of ``BLOCK_M`` rows that never straddle two experts;
:func:`block_table` lists those blocks (expert and first row) for a block size. The table's length is the bound
``cdiv(N, BLOCK_M) + E`` (each expert ends in at most one partial block), so the launch grid is known on the host
without reading the counts back; slots past the real blocks hold expert ``-1`` and their programs exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastft.kernels.errors import ShapeContractError


@dataclass(frozen=True)
class MoERouting:
    """The expert-sorted order of one call's ``N = T · k`` routed rows.

    Attributes:
        num_experts: E, the number of experts the indices were checked against.
        top_k: k, the experts per token.
        order: ``[N]`` int64: the flat ``(token, slot)`` index (``t · k + j``) of each sorted row.
        token: ``[N]`` int64: the token of each sorted row (``order // k``), the gather index into ``x [T, H]``.
        expert: ``[N]`` int64: the expert of each sorted row (non-decreasing).
        inverse: ``[N]`` int64: the sorted row of each flat ``(token, slot)`` index, so ``y_sorted[inverse]`` is back
            in ``[T · k]`` order and ``.view(T, k, H).sum(1)`` is the scatter-add back to the tokens.
        offsets: ``[E + 1]`` int64: expert ``e``'s rows are ``offsets[e]:offsets[e + 1]`` of the sorted order; an
            expert no token chose has an empty range.
    """

    num_experts: int
    top_k: int
    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    # block_m -> block_table's result: every grouped launch of one call with the same row block shares it.
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        """N, the number of routed rows (tokens · k)."""
        return self.order.shape[0]

    @property
    def tokens(self) -> int:
        """T, the number of tokens."""
        return self.rows // self.top_k if self.top_k else 0

    @classmethod
    def rebuild(cls, order: torch.Tensor, offsets: torch.Tensor, top_k: int) -> MoERouting:
        """The routing again from its ``order`` and ``offsets`` alone: what a backward keeps (two index vectors instead
        of five), the rest recomputed by index ops without reading anything back."""
        rows = order.shape[0]
        positions = torch.arange(rows, device=order.device, dtype=torch.int64)
        expert = torch.searchsorted(offsets, positions, right=True) - 1
        inverse = torch.empty_like(order)
        inverse[order] = positions
        token = torch.div(order, top_k, rounding_mode="floor")
        return cls(offsets.shape[0] - 1, top_k, order, token, expert, inverse, offsets)


def check_router(
    where: str, rows: int, num_experts: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> None:
    """The router outputs' shapes and dtypes against the tokens and the experts (no data is read).

    Raises:
        ShapeContractError: An index or weight tensor that is not ``[T, k]`` for the ``T`` tokens of x, or a top-k
            larger than the number of experts.
        TypeError: Indices that are not integers, or weights that are not floating point.
    """
    if top_k_index.dim() != 2 or top_k_index.shape[0] != rows:
        raise ShapeContractError(
            f"{where}: top_k_index must be [tokens, top_k] = [{rows}, k] for x of {rows} tokens, got "
            f"{list(top_k_index.shape)}; pass the router's selected experts with one row per token."
        )
    k = top_k_index.shape[1]
    if k > num_experts:
        raise ShapeContractError(
            f"{where}: top_k must be at most the number of experts ({num_experts}), got top_k_index of shape "
            f"{list(top_k_index.shape)} (top_k {k}); the router config does not match these experts."
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(f"{where}: top_k_index must hold integer expert indices, got {top_k_index.dtype}.")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ShapeContractError(
            f"{where}: top_k_weights must be [tokens, top_k] = {list(top_k_index.shape)} like top_k_index, got "
            f"{list(top_k_weights.shape)}; pass the router's weights of the selected experts, not all its scores."
        )
    if not top_k_weights.dtype.is_floating_point:
        raise TypeError(f"{where}: top_k_weights must be floating point, got {top_k_weights.dtype}.")


def route(top_k_index: torch.Tensor, num_experts: int, where: str = "moe_route") -> MoERouting:
    """Sort the routed rows of ``top_k_index [T, k]`` by expert.

    Args:
        top_k_index: The router's chosen experts per token, ``[T, k]`` integers in ``[0, num_experts)``.
        num_experts: E.
        where: The module named in errors.

    Returns:
        The :class:`MoERouting`.

    Raises:
        ShapeContractError: An index outside ``[0, num_experts)``. Checking reads the indices once (a host
            synchronisation on CUDA): an index past the last expert would otherwise make a kernel read another
            expert's (or no one's) weights.
    """
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    # meta tensors (the static compile check) hold no indices to check.
    if flat.numel() and not flat.is_meta:
        low, high = torch.aminmax(flat)
        low, high = int(low), int(high)
        if low < 0 or high >= num_experts:
            bad = low if low < 0 else high
            raise ShapeContractError(
                f"{where}: top_k_index must hold expert indices in [0, {num_experts}) for {num_experts} experts, got "
                f"{bad}; the router has more experts than these weights (or a masked slot was left in), so route "
                "with the experts' own router."
            )
    flat = flat.to(torch.int64)
    # Stable: each expert's rows stay in token order, so the sorted order (and the float sums over it) is
    # reproducible run to run.
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # The first sorted row of every expert (and N for the end): a search instead of bincount, which reads the
    # maximum back to the host on CUDA.
    boundaries = torch.arange(num_experts + 1, device=flat.device, dtype=torch.int64)
    offsets = torch.searchsorted(expert, boundaries)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=flat.device, dtype=torch.int64)
    return MoERouting(num_experts, k, order, torch.div(order, k, rounding_mode="floor"), expert, inverse, offsets)


def max_blocks(rows: int, num_experts: int, block_m: int) -> int:
    """The most ``block_m``-row blocks ``rows`` sorted rows over ``num_experts`` experts can need."""
    return -(-rows // block_m) + num_experts


def block_table(routing: MoERouting, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row blocks of a grouped launch: ``(block_expert, block_start)``, both ``[max_blocks]`` int32.

    Block ``b`` covers the sorted rows ``block_start[b] : min(block_start[b] + block_m, offsets[e + 1])`` of expert
    ``e = block_expert[b]``; ``-1`` marks the unused slots at the end.
    """
    cached = routing.tables.get(block_m)
    if cached is not None:
        return cached
    offsets = routing.offsets
    counts = offsets[1:] - offsets[:-1]
    blocks = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    ends = torch.cumsum(blocks, 0)
    slots = torch.arange(max_blocks(routing.rows, routing.num_experts, block_m), device=offsets.device)
    expert = torch.searchsorted(ends, slots, right=True)
    used = expert < routing.num_experts
    clamped = expert.clamp(max=routing.num_experts - 1)
    first_block = ends[clamped] - blocks[clamped]
    start = offsets[clamped] + (slots - first_block) * block_m
    block_expert = torch.where(used, expert, -1).to(torch.int32)
    block_start = torch.where(used, start, 0).to(torch.int32)
    routing.tables[block_m] = (block_expert, block_start)
    return block_expert, block_start


__all__ = ["MoERouting", "block_table", "check_router", "max_blocks", "route"]
