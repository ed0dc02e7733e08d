"""Mixture-of-experts tensors written the way transformers 5 saves them: one tensor per expert and projection.

transformers 5 holds a block's experts fused in memory (``experts.gate_up_proj [E, 2·I, H]``, ``experts.down_proj
[E, H, I]``) and, when it saves, reverts that conversion: the checkpoint keeps the hub's per-expert tensors
(``experts.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.<e>.w1`` /
``w3`` / ``w2``). The streaming merge plans the fused tensors; :func:`split_experts` maps the names transformers'
revert gives (read on shape-only tensors) onto slices of them, one expert's merged matrix at a time, and checks
every slice's shape against the shape transformers reverted to. Anything it cannot map exactly is left to the caller
to refuse.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from fastft.export.merge import MergedTensor

# A per-expert projection's role, by its name in the hub checkpoints (Qwen / OLMoE names, then Mixtral's).
_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SAVED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.[^.]+\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.[^.]+\.experts\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass
class ExpertSlice:
    """One saved per-expert tensor: rows ``rows`` of expert ``expert`` of a merged fused tensor.

    Attributes:
        name: Its name in the saved checkpoint.
        parent: The merged fused ``[E, out, in]`` tensor.
        expert: The expert's index.
        rows: Its rows in the expert's ``[out, in]`` matrix (gate's half or up's half of gate_up, all of down).
    """

    name: str
    parent: MergedTensor
    expert: int
    rows: slice

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows.stop - self.rows.start, *self.parent.shape[2:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parent.dtype

    @property
    def parameter(self) -> bool:
        return self.parent.parameter

    @property
    def numel(self) -> int:
        return (self.rows.stop - self.rows.start) * self.parent.numel // (self.parent.shape[0] * self.parent.shape[1])

    def chunks(self, max_elements: int) -> Iterator[torch.Tensor]:
        """The slice as blocks of at most ``max_elements`` values; the expert's merged matrix is made once."""
        matrix = self.parent.expert(self.expert)[self.rows]
        step = max(1, max_elements // max(1, matrix[0].numel()))
        for start in range(0, matrix.shape[0], step):
            yield matrix[start : start + step]


_BLOCK = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?P<block>[^.]+)\.(?P<rest>.+)$")


@dataclass
class _Renamed:
    """A planned tensor written under the name transformers saves it by."""

    name: str
    source: MergedTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def parameter(self) -> bool:
        return self.source.parameter

    @property
    def numel(self) -> int:
        return self.source.numel

    def chunks(self, max_elements: int) -> Iterator[torch.Tensor]:
        return self.source.chunks(max_elements)


def _renamed(planned: Mapping[str, MergedTensor], name: str, meta: torch.Tensor) -> MergedTensor | None:
    # The one planned tensor of the same layer and the same path below the block, of the same shape.
    match = _BLOCK.match(name)
    if match is None:
        return None
    found = [
        tensor
        for other, tensor in planned.items()
        if (m := _BLOCK.match(other)) and m["layer"] == match["layer"] and m["rest"] == match["rest"]
    ]
    if len(found) != 1 or tuple(found[0].shape) != tuple(meta.shape):
        return None
    return found[0]


def split_experts(
    planned: Mapping[str, MergedTensor], reverted: Mapping[str, torch.Tensor]
) -> list[MergedTensor | ExpertSlice | _Renamed] | None:
    """The tensors to write, in ``reverted``'s order, or None when the names cannot all be mapped exactly.

    Args:
        planned: The merge plan's tensors by in-memory name.
        reverted: transformers' reverted state dict on shape-only tensors: the saved names and shapes, in order.
    """
    fused: dict[tuple[str, str], MergedTensor] = {}
    for name, tensor in planned.items():
        match = _FUSED.match(name)
        if match and len(tensor.shape) == 3:
            fused[(match["layer"], match["kind"])] = tensor
    written: list[MergedTensor | ExpertSlice | _Renamed] = []
    used: dict[str, int] = {}
    for name, meta in reverted.items():
        if name in planned:
            written.append(planned[name])
            used[name] = used.get(name, 0) + 1
            continue
        match = _SAVED.match(name)
        role = None if match is None else _ROLES.get(match["proj"])
        if role is None:
            # The block itself renamed on disk (Mixtral's mlp is block_sparse_moe there): its router, say.
            moved = _renamed(planned, name, meta)
            if moved is None:
                return None
            written.append(_Renamed(name, moved))
            used[moved.name] = used.get(moved.name, 0) + 1
            continue
        kind = "down_proj" if role == "down" else "gate_up_proj"
        parent = fused.get((match["layer"], kind))
        expert = int(match["expert"])
        if parent is None or expert >= parent.shape[0]:
            return None
        out = parent.shape[1]
        rows = slice(0, out) if role == "down" else slice(0, out // 2) if role == "gate" else slice(out // 2, out)
        piece = ExpertSlice(name, parent, expert, rows)
        if tuple(meta.shape) != piece.shape:
            return None
        written.append(piece)
        used[parent.name] = used.get(parent.name, 0) + (rows.stop - rows.start)
    fused_ids = {id(tensor) for tensor in fused.values()}
    for name, tensor in planned.items():
        # Every planned tensor written whole exactly once: a fused one as all its experts' rows.
        whole = tensor.shape[0] * tensor.shape[1] if id(tensor) in fused_ids else 1
        if used.get(name) != whole:
            return None
    return written


__all__ = ["ExpertSlice", "split_experts"]
