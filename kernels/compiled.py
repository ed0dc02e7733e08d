"""What a compiled Triton kernel costs on its target, read from its binary, and whether that target may run it.

Used twice: by the static compile check (:mod:`fastft.kernels.compile_check`, no GPU) and by the on-device tuner
(:mod:`fastft.kernels.gemm_tuner`), which never times a configuration that fails here. Registers and spill stack come
from ``cuobjdump -res-usage`` (shipped in the triton wheel) on the cubin; shared memory from the kernel's metadata;
instruction counts from its PTX.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastft.kernels.targets import target_for

_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)")


@dataclass
class Usage:
    """Resources and instruction counts of one compiled kernel on one target."""

    registers: int | None
    spill_bytes: int | None
    shared_bytes: int
    shared_limit: int
    mma: int
    wgmma: int
    cp_async: int
    tma: int
    fma: int
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.cache
def cuobjdump() -> str | None:
    """The ``cuobjdump`` triton ships (or one on PATH), or None."""
    try:
        import triton
    except ImportError:
        return shutil.which("cuobjdump")
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(shipped) if shipped.is_file() else shutil.which("cuobjdump")


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """``(registers, spill stack bytes)`` of the single kernel in a cubin, or ``(None, None)`` without cuobjdump."""
    tool = cuobjdump()
    if tool is None:
        return None, None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        result = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=False)
    match = _RESOURCES.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeError(
            f"fastft.kernels.compiled: {tool} -res-usage failed (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[:500]}"
        )
    return int(match.group(1)), int(match.group(2))


def usage(kernel: Any, capability: int, *, has_dot: bool, sixteen_bit: bool) -> Usage:
    """Read a compiled kernel's resources and judge it for a target.

    Args:
        kernel: A triton ``CompiledKernel`` (``asm["ptx"]``, ``asm["cubin"]``, ``metadata.shared``).
        capability: The compute capability it was compiled for (major * 10 + minor).
        has_dot: Whether the kernel multiplies with ``tl.dot`` (then it must use tensor cores).
        sixteen_bit: Whether its operands are fp16 / bf16 (then a GEMM must be software-pipelined).

    Returns:
        The :class:`Usage`, with ``problems`` naming each reason this kernel may not run on that target: spills,
        shared memory past the per-block limit, a dot without tensor-core instructions, a 16-bit GEMM without
        asynchronous copies.
    """
    target = target_for(capability)
    ptx = kernel.asm["ptx"]
    registers, spill = resource_usage(kernel.asm["cubin"])
    if spill is None:
        # On a GPU without cuobjdump the loaded kernel knows its own spill count.
        spill = getattr(kernel, "n_spills", None)
        registers = getattr(kernel, "n_regs", None)
    found = Usage(
        registers=registers,
        spill_bytes=spill,
        shared_bytes=int(kernel.metadata.shared),
        shared_limit=target.shared_bytes,
        mma=len(re.findall(r"\bmma\.sync\.", ptx)),
        wgmma=len(re.findall(r"\bwgmma\.mma_async\.", ptx)),
        cp_async=len(re.findall(r"\bcp\.async\.(?:ca|cg)\.", ptx)),
        tma=len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx)),
        fma=len(re.findall(r"\bfma\.rn\.", ptx)),
    )
    if spill is None:
        found.problems.append("spills unknown: no cuobjdump and the kernel was not loaded on a GPU")
    elif spill > 0:
        found.problems.append(f"spills {spill} bytes of registers to local memory")
    if found.shared_bytes > target.shared_bytes:
        found.problems.append(
            f"needs {found.shared_bytes} bytes of shared memory, {target.name} allows {target.shared_bytes}"
        )
    if has_dot and target.tensor_core_dot and found.mma + found.wgmma == 0:
        found.problems.append("tl.dot without tensor-core instructions (no mma / wgmma)")
    if has_dot and sixteen_bit and target.tensor_core_dot and found.cp_async + found.tma == 0:
        found.problems.append("16-bit GEMM not software-pipelined (no cp.async / TMA): its loads are unaligned")
    return found


__all__ = ["Usage", "cuobjdump", "resource_usage", "usage"]
