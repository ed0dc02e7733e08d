"""Per-expert weights that live in separate tensors, read by the grouped GEMM as one ``[E, n, K]`` operand.

transformers 4.x keeps a mixture-of-experts block's experts as a ``ModuleList`` of MLPs, each with its own
``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` Linear. Stacking them into one tensor per call would copy every
expert's weights each forward, and re-homing the Linear weights as views of one buffer breaks ``save_pretrained``'s
shared-storage check and ``model.to()``. An :class:`ExpertTable` instead holds an int64 table of every expert's base
address (one row of E per part: gate then up, or down alone); the grouped GEMM
(:mod:`fastft.kernels.moe_grouped_gemm`, ``TABLE``) loads expert ``e``'s address and casts it to a pointer. Two parts
stack along the rows: part 0 holds rows ``[0, split)`` of expert e's logical ``[n, K]`` matrix, part 1 the rest, so
gate and up are gate | up rows like transformers 5's ``gate_up_proj``.

Every expert of every part must share shape, dtype, device and strides; that is checked once, when the table is
built. The table records the addresses it was built from: :meth:`ExpertTable.check_current` (run once per call by
:class:`~fastft.kernels.lora_moe_experts.LoRAMoEExperts`) refuses a table whose tensors were moved since (``model.to``,
``.half()``, ``param.data = ...`` keep the Parameter but swap its storage), so the kernel never reads freed memory.

:meth:`ExpertTable.transpose` gives the ``[E, K, n]`` view the backward reads (``dX = dY W``): the split then runs
along K, which the kernel walks as two K loops, one per part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastft.kernels.errors import ShapeContractError

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {t.dtype} on {t.device} with strides {t.stride()}"


class ExpertTable:
    """E experts' weights in separate tensors as one logical ``[E, n, K]`` weight (see the module docstring).

    Args:
        parts: One or two sequences of E tensors; part ``p``'s tensor ``e`` is rows ``[p · split, (p+1) · split)``
            of expert e's ``[n, K]`` matrix (gate's ``[I, H]`` then up's; or down's ``[H, I]`` alone).
        name: The module named in errors.

    Raises:
        ShapeContractError: A part without E tensors, or tensors that differ in shape or strides.
        TypeError: Tensors of another dtype than float32 / float16 / bfloat16, or of differing dtypes or devices.
    """

    __slots__ = ("_ptrs", "device", "dtype", "name", "parts", "shape", "split", "split_k", "strides", "table")

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]], name: str = "expert_table") -> None:
        if len(parts) not in (1, 2) or not parts[0]:
            raise ShapeContractError(
                f"{name}: an expert table takes one or two parts of per-expert weights, got {len(parts)} part(s); "
                "pass [gate weights, up weights] or [down weights]."
            )
        experts = len(parts[0])
        first = parts[0][0]
        if not isinstance(first, torch.Tensor) or first.dim() != 2 or first.dtype not in _FLOAT_DTYPES:
            got = _describe(first) if isinstance(first, torch.Tensor) else type(first).__name__
            raise TypeError(
                f"{name}: expert weights must be 2-D float32 / float16 / bfloat16 tensors [out, in], got {got}; "
                "4-bit experts run upstream's per-expert forward."
            )
        for p, part in enumerate(parts):
            if len(part) != experts:
                raise ShapeContractError(
                    f"{name}: part {p} holds {len(part)} expert weights, expected {experts} (one per expert like "
                    "part 0); pass every expert's projection."
                )
            for e, t in enumerate(part):
                if t.shape != first.shape or t.stride() != first.stride():
                    raise ShapeContractError(
                        f"{name}: expert {e}'s weight (part {p}) is {_describe(t)}, expected {list(first.shape)} with "
                        f"strides {first.stride()} like expert 0's; the grouped kernel reads every expert with one "
                        "shape and stride: give all experts the same shapes (or run the per-expert forward)."
                    )
                if t.dtype != first.dtype or t.device != first.device:
                    raise TypeError(
                        f"{name}: expert {e}'s weight (part {p}) is {t.dtype} on {t.device}, but expert 0's is "
                        f"{first.dtype} on {first.device}; load every expert in one dtype on one device."
                    )
        rows, cols = first.shape
        values = {
            "name": name,
            "parts": tuple(tuple(part) for part in parts),
            "shape": torch.Size((experts, rows * len(parts), cols)),
            "split": rows,
            "split_k": None,
            "strides": (first.stride(0), first.stride(1)),
            "dtype": first.dtype,
            "device": first.device,
        }
        ptrs = tuple(t.data_ptr() for part in parts for t in part)
        values["_ptrs"] = ptrs
        values["table"] = torch.tensor(ptrs, dtype=torch.int64).to(first.device)
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ExpertTable is immutable; build a new one instead of setting {name!r}.")

    def __repr__(self) -> str:
        return f"ExpertTable({self.name}: {list(self.shape)}, {len(self.parts)} part(s), {self.dtype})"

    @property
    def requires_grad(self) -> bool:
        """Whether any expert weight requires grad (the fused path treats them as frozen)."""
        return any(t.requires_grad for part in self.parts for t in part)

    def dim(self) -> int:
        """3, as the stacked ``[E, n, K]`` weight it stands for."""
        return 3

    def transpose(self, dim0: int, dim1: int) -> ExpertTable:
        """The ``[E, K, n]`` view (only ``transpose(1, 2)``): the same table, strides swapped, the split along K."""
        if sorted((dim0, dim1)) != [1, 2]:
            raise ValueError(f"{self.name}: an expert table transposes only its last two dims, got ({dim0}, {dim1}).")
        view = object.__new__(ExpertTable)
        values = {slot: getattr(self, slot) for slot in ExpertTable.__slots__}
        experts, n, k = self.shape
        values["shape"] = torch.Size((experts, k, n))
        values["strides"] = (self.strides[1], self.strides[0])
        # The split moves between the rows and K with each transpose.
        values["split"], values["split_k"] = self.split_k, self.split
        for key, value in values.items():
            object.__setattr__(view, key, value)
        return view

    @property
    def two_parts(self) -> bool:
        return len(self.parts) == 2

    def check_current(self) -> None:
        """Refuse a table whose tensors no longer live at the addresses it holds.

        Raises:
            RuntimeError: A weight was moved (``model.to``, ``.half()``, ``param.data = ...``) since the table was
                built: reading the old addresses would read freed memory.
        """
        now = tuple(t.data_ptr() for part in self.parts for t in part)
        if now != self._ptrs:
            moved = next(i for i, (a, b) in enumerate(zip(now, self._ptrs, strict=True)) if a != b)
            experts = self.shape[0]
            raise RuntimeError(
                f"{self.name}: expert {moved % experts}'s weight (part {moved // experts}) moved since its address "
                "table was built (model.to / .half() / param.data = ... swap a parameter's storage); build a new "
                "table from the weights as they are now (a patched model does so by itself on its next call)."
            )

    def matmul(self, a: torch.Tensor, expert: int) -> torch.Tensor:
        """``a @ W_eᵀ`` for expert ``expert``'s logical ``[n, K]`` weight (the torch reference; no weight copy)."""
        parts = [part[expert] for part in self.parts]
        if len(parts) == 1:
            return a @ (parts[0] if self.split is None else parts[0].t())
        if self.split is not None:
            # W_e = [P0; P1] (rows): a @ W_eᵀ = [a P0ᵀ | a P1ᵀ].
            return torch.cat([a @ parts[0].t(), a @ parts[1].t()], dim=1)
        # Transposed, W_e = [P0ᵀ | P1ᵀ] (the split along K): a @ W_eᵀ = a[:, :s] P0 + a[:, s:] P1.
        s = self.split_k
        return a[:, :s] @ parts[0] + a[:, s:] @ parts[1]


__all__ = ["ExpertTable"]
