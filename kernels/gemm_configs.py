"""Which Triton configurations the fused LoRA GEMMs may launch with, per GPU generation and operand dtype.

A configuration is a tile shape, a warp count and a pipeline depth. The candidates of a target are the ones the
on-device tuner (:mod:`fastft.kernels.gemm_tuner`) times against cuBLAS, and the ones the static compile check
(:mod:`fastft.kernels.compile_check`) compiles for that target; a candidate that spills, overruns the target's shared
memory or lacks tensor-core instructions there fails the check and is never chosen.

Why the table looks the way it does:

- Below compute capability 8.0 (T4, V100) there is no candidate: Triton >= 3.2 lowers ``tl.dot`` to FMA there, about
  an eighth of what cuBLAS gets from the tensor cores.
- fp32 operands have no candidate either: the kernels multiply fp32 in IEEE precision (torch's default, no TF32),
  which no tensor core does, and cuBLAS's SGEMM is the better FMA GEMM.
- Shared memory per stage is ``(BLOCK_M + BLOCK_N) · BLOCK_K · 2`` bytes (32 KB at 128×128×64). Triton keeps
  ``num_stages - 1`` stages in flight below sm_90 and ``num_stages`` on sm_90, so 3 stages of 128×128×64 take 64 KB
  on sm_80 / 86 / 89 and 96 KB on sm_90, inside the 99 KB of an A10 or L4.
- The NF4 kernel decodes its W tile in registers on top of the dense kernel's work; its packed bytes are pipelined
  like the dense kernel's W tile.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of a fused LoRA GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def meta(self) -> dict[str, int]:
        """The kernel's keyword arguments for this configuration."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# The interpreter pays per program and per loop step in Python; 16 is tl.dot's smallest tile.
INTERPRETER = GemmConfig(32, 32, 32, 1, 1)

# Every entry passes the static check (no spill, shared memory within the limit, mma / wgmma, cp.async) at ranks 8 to
# 128 for the models it walks; what failed it: 64x128 and 128x64 tiles on 4 warps spill at rank 128 (the epilogue's B
# tile), 128x256 spills on sm_90.
_DENSE = {
    80: (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 64, 8, 4)),
    86: (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 32, 8, 4)),
    89: (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 32, 8, 4)),
    90: (GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 128, 64, 8, 4)),
}
# With one absmax per column per K step (the models' K are multiples of the 64-value blocks) 128x128x64 takes 97 KB.
_NF4 = {cc: (GemmConfig(128, 128, 64, 8, 3),) for cc in (80, 86, 89, 90)}

KINDS = ("dense", "nf4")


def candidates(capability: int, dtype: torch.dtype, kind: str = "dense") -> tuple[GemmConfig, ...]:
    """The Triton configurations a fused LoRA GEMM of ``kind`` (``"dense"`` or ``"nf4"``) may run with on a GPU of
    this compute capability with operands of ``dtype``; empty where only cuBLAS may run."""
    if kind not in KINDS:
        raise ValueError(f"fastft.kernels.gemm_configs: kind must be one of {KINDS}, got {kind!r}.")
    if capability < 80 or dtype not in (torch.float16, torch.bfloat16):
        return ()
    table = _DENSE if kind == "dense" else _NF4
    # A newer generation than the table knows runs the newest row's settings.
    return table[max(cc for cc in table if cc <= capability)]


__all__ = ["INTERPRETER", "KINDS", "GemmConfig", "candidates"]
